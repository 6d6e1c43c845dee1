/* Paged decode attention on CPU, float32 (engine/attention/cpu_kernel.py builds and loads it),
 * over a float32 cache or an fp8 one (engine/attention/fp8_kv.py's packed rows: head_dim fp8
 * bytes and a float32 scale per token and kv head, turned into floats with shifts and a select).
 *
 * For each listed sequence and kv head: the q heads of that kv head (and, for a
 * draft's verification, each of the sequence's few query tokens) against the
 * keys it sees, read in place from the paged cache through the block table: no
 * gathered copy of K and V, no padding, no mask. One pass computes the scores,
 * a softmax over them, one pass sums the values. Work items run on the calling
 * process's OpenMP threads (torch's own runtime: this library is loaded after
 * torch, so its libgomp is the one already in the process).
 *
 * Layouts (all contiguous):
 *   query, out     [num_tokens, num_q_heads, head_dim]
 *   k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim] float32, or with `fp8` 1 / 2
 *                  [num_blocks, block_size, num_kv_heads, head_dim + 4] bytes (e4m3 / e5m2 values, scale)
 *   block_tables   [num_seqs, table_width] int32
 *   seq_lens       [num_seqs] int32: context length after this step
 *   cu_seqlens_q   [num_seqs + 1] int32: the sequence's query rows
 *   seq_ids        [num_work] int64: which sequences to attend
 * Query row j of a sequence with q_len rows and context L sits at position p = L - q_len + j and sees
 * keys 0 .. p, or with a sliding window W > 0 keys p - W + 1 .. p; with a soft-cap c > 0 its scores
 * s become c * tanh(s / c) before the softmax.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const float *query;
    const void *k_cache, *v_cache;

    const int32_t *block_tables, *seq_lens, *cu_seqlens_q;
    int64_t table_width, num_q_heads, num_kv_heads, head_dim, block_size, window;
    float scale, softcap;
    float *out;
} Args;

/* scores for `rows` query vectors, each of length head_dim, kept per thread and grown */
static __thread float *scratch = NULL;
static __thread int64_t scratch_len = 0;

static float *scratch_for(int64_t n) {
    if (n > scratch_len) {
        free(scratch);
        scratch = (float *)malloc((size_t)n * sizeof(float));
        scratch_len = scratch == NULL ? 0 : n;
    }
    return scratch;
}

/* Asks for `tokens` tokens' `floats` floats each (`stride` apart) to be brought into cache. */
static inline void prefetch_tokens(const float *p, int64_t tokens, int64_t stride, int64_t floats) {
    for (int64_t i = 0; i < tokens; i++)
        for (int64_t f = 0; f < floats; f += 16) __builtin_prefetch(p + i * stride + f);
}

/* Row r's scores s[r * L + t] over the keys it sees -> exp(score - max) (0 elsewhere from
 * first_block on), their sum in sums[r]: the softmax, normalised in write_rows. */
static inline void softmax_rows(const Args *a, float *s, float *sums, int64_t rows, int64_t per_head, int64_t G,
                                int64_t q_len, int64_t L, int64_t first_block) {
    for (int64_t r = 0; r < rows; r++) {
        const int64_t visible = L - q_len + (r % per_head) / G + 1;
        const int64_t lo = a->window > 0 && visible - a->window > 0 ? visible - a->window : 0;
        float *sr = s + r * L, sum = 0.f;
        if (a->softcap > 0.f)
            for (int64_t t = lo; t < visible; t++) sr[t] = a->softcap * tanhf(sr[t] / a->softcap);
        float m = sr[lo];
        for (int64_t t = lo + 1; t < visible; t++) m = sr[t] > m ? sr[t] : m;
        for (int64_t t = lo; t < visible; t++) {
            sr[t] = expf(sr[t] - m);
            sum += sr[t];
        }
        for (int64_t t = first_block; t < lo; t++) sr[t] = 0.f;
        for (int64_t t = visible; t < L; t++) sr[t] = 0.f;
        sums[r] = sum;
    }
}

/* out's rows: the value sums acc / the softmax sums. */
static inline void write_rows(const Args *a, const float *acc, const float *sums, int64_t rows, int64_t per_head,
                              int64_t G, int64_t q_start, int64_t h0, const int64_t D) {
    for (int64_t r = 0; r < rows; r++) {
        const int64_t hh = r / per_head, j = (r % per_head) / G, g = r % G;
        float *o = a->out + ((q_start + j) * a->num_q_heads + (h0 + hh) * G + g) * D;
        const float inv = 1.f / sums[r];
        for (int64_t d = 0; d < D; d++) o[d] = acc[r * D + d] * inv;
    }
}

/* One sequence's kv heads h0 .. h1 - 1: each token's keys for those heads lie side by side
 * in its block, so a pass reads whole blocks in order. Query row r = (hh * q_len + j) * G + g
 * is query token j's q head (h0 + hh) * G + g. `D` is a compile-time constant where inlined
 * from the specialised callers below, so the inner loops vectorise at full width. */
static inline int attend(const Args *a, int64_t b, int64_t h0, int64_t h1, const int64_t D) {
    const int64_t G = a->num_q_heads / a->num_kv_heads, Hkv = a->num_kv_heads, bs = a->block_size;
    const int64_t q_start = a->cu_seqlens_q[b], q_len = a->cu_seqlens_q[b + 1] - q_start, L = a->seq_lens[b];
    const int64_t per_head = q_len * G, heads = h1 - h0, rows = heads * per_head;
    const int64_t stride = Hkv * D; /* floats from one token's keys to the next token's in a block */
    const int32_t *table = a->block_tables + b * a->table_width;
    /* the first key any row sees (row 0's window), from the start of its block */
    const int64_t first_key = a->window > 0 && L - q_len - a->window + 1 > 0 ? L - q_len - a->window + 1 : 0;
    const int64_t first_block = first_key / bs * bs;
    /* rows score vectors of L, then rows accumulators of D, then rows sums */
    float *s = scratch_for(rows * L + rows * D + rows);
    if (s == NULL) return -1;
    float *acc = s + rows * L, *sums = acc + rows * D;
    const float *q[rows];
    const float *k_cache = (const float *)a->k_cache, *v_cache = (const float *)a->v_cache;
    for (int64_t hh = 0; hh < heads; hh++)
        for (int64_t j = 0; j < q_len; j++)
            for (int64_t g = 0; g < G; g++)
                q[(hh * q_len + j) * G + g] = a->query + ((q_start + j) * a->num_q_heads + (h0 + hh) * G + g) * D;
    /* scores, four keys at a time: four independent sums per query row hide the FMA latency */
    for (int64_t t0 = first_block; t0 < L; t0 += bs) {
        const float *kb = k_cache + (int64_t)table[t0 / bs] * bs * stride + h0 * D;
        const int64_t n = L - t0 < bs ? L - t0 : bs;
        const float *next_k = t0 + bs < L ? k_cache + (int64_t)table[t0 / bs + 1] * bs * stride + h0 * D : NULL;
        int64_t i = 0;
        for (; i + 4 <= n; i += 4) {
            if (next_k != NULL) /* the next block is read while this one is: its keys of the same 4 tokens */
                prefetch_tokens(next_k + i * stride, 4, stride, heads * D);
            for (int64_t hh = 0; hh < heads; hh++) {
                const float *k0 = kb + i * stride + hh * D, *k1 = k0 + stride, *k2 = k1 + stride, *k3 = k2 + stride;
                for (int64_t rr = 0; rr < per_head; rr++) {
                    const int64_t r = hh * per_head + rr;
                    const float *qr = q[r];
                    float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;
                    for (int64_t d = 0; d < D; d++) {
                        const float x = qr[d];
                        d0 += x * k0[d];
                        d1 += x * k1[d];
                        d2 += x * k2[d];
                        d3 += x * k3[d];
                    }
                    float *sr = s + r * L + t0 + i;
                    sr[0] = d0 * a->scale;
                    sr[1] = d1 * a->scale;
                    sr[2] = d2 * a->scale;
                    sr[3] = d3 * a->scale;
                }
            }
        }
        for (; i < n; i++)
            for (int64_t hh = 0; hh < heads; hh++) {
                const float *k = kb + i * stride + hh * D;
                for (int64_t rr = 0; rr < per_head; rr++) {
                    const int64_t r = hh * per_head + rr;
                    float dot = 0.f;
                    for (int64_t d = 0; d < D; d++) dot += q[r][d] * k[d];
                    s[r * L + t0 + i] = dot * a->scale;
                }
            }
    }
    softmax_rows(a, s, sums, rows, per_head, G, q_len, L, first_block);
    memset(acc, 0, (size_t)(rows * D) * sizeof(float));
    for (int64_t t0 = first_block; t0 < L; t0 += bs) {
        const float *vb = v_cache + (int64_t)table[t0 / bs] * bs * stride + h0 * D;
        const int64_t n = L - t0 < bs ? L - t0 : bs;
        const float *next_v = t0 + bs < L ? v_cache + (int64_t)table[t0 / bs + 1] * bs * stride + h0 * D : NULL;
        for (int64_t i = 0; i < n; i++) {
            if (next_v != NULL)
                prefetch_tokens(next_v + i * stride, 1, stride, heads * D);
            for (int64_t hh = 0; hh < heads; hh++) {
                const float *v = vb + i * stride + hh * D;
                for (int64_t rr = 0; rr < per_head; rr++) {
                    const int64_t r = hh * per_head + rr;
                    const float p = s[r * L + t0 + i];
                    float *o = acc + r * D;
                    for (int64_t d = 0; d < D; d++) o[d] += p * v[d];
                }
            }
        }
    }
    write_rows(a, acc, sums, rows, per_head, G, q_start, h0, D);
    return 0;
}


/* One fp8 byte's value (finite ones: the cache never holds another). The byte's exponent and
 * mantissa bits moved into float32's, the exponent rebased (e4m3: bias 7, e5m2: 15, float32:
 * 127); a subnormal byte (exponent 0) is its mantissa times the smallest step. Branch-free, so
 * a row's loop vectorises. */
static inline float fp8_value(uint32_t b, const int e5m2) {
    const uint32_t bits = e5m2 ? ((b & 0x7fu) << 21) + (112u << 23) : ((b & 0x7fu) << 20) + (120u << 23);
    float f;
    memcpy(&f, &bits, sizeof(float));
    const float sub = e5m2 ? (float)(b & 0x3u) * 0x1p-16f : (float)(b & 0x7u) * 0x1p-9f;
    f = (b & (e5m2 ? 0x7cu : 0x78u)) == 0 ? sub : f;
    return (b & 0x80u) ? -f : f;
}

/* attend() over fp8 caches: each (token, kv head) row is D fp8 bytes then its float32 scale.
 * A row is turned into floats once and read by all its query rows; the
 * K scale multiplies the dot product, the V scale the row. */
static inline int attend_fp8(const Args *a, int64_t b, int64_t h0, int64_t h1, const int64_t D, const int e5m2) {
    const int64_t G = a->num_q_heads / a->num_kv_heads, Hkv = a->num_kv_heads, bs = a->block_size;
    const int64_t q_start = a->cu_seqlens_q[b], q_len = a->cu_seqlens_q[b + 1] - q_start, L = a->seq_lens[b];
    const int64_t per_head = q_len * G, heads = h1 - h0, rows = heads * per_head;
    const int64_t W = D + 4, stride = Hkv * W; /* bytes of one row, of one token's rows */
    const int32_t *table = a->block_tables + b * a->table_width;
    const uint8_t *k_cache = (const uint8_t *)a->k_cache, *v_cache = (const uint8_t *)a->v_cache;
    const int64_t first_key = a->window > 0 && L - q_len - a->window + 1 > 0 ? L - q_len - a->window + 1 : 0;
    const int64_t first_block = first_key / bs * bs;
    float *s = scratch_for(rows * L + rows * D + rows + D);
    if (s == NULL) return -1;
    float *acc = s + rows * L, *sums = acc + rows * D, *row = sums + rows;
    const float *q[rows];
    for (int64_t hh = 0; hh < heads; hh++)
        for (int64_t j = 0; j < q_len; j++)
            for (int64_t g = 0; g < G; g++)
                q[(hh * q_len + j) * G + g] = a->query + ((q_start + j) * a->num_q_heads + (h0 + hh) * G + g) * D;
    for (int64_t t0 = first_block; t0 < L; t0 += bs) {
        const uint8_t *kb = k_cache + (int64_t)table[t0 / bs] * bs * stride + h0 * W;
        const int64_t n = L - t0 < bs ? L - t0 : bs;
        for (int64_t i = 0; i < n; i++)
            for (int64_t hh = 0; hh < heads; hh++) {
                const uint8_t *k8 = kb + i * stride + hh * W;
                float scale;
                memcpy(&scale, k8 + D, sizeof(float));
                for (int64_t d = 0; d < D; d++) row[d] = fp8_value(k8[d], e5m2);
                scale *= a->scale;
                for (int64_t rr = 0; rr < per_head; rr++) {
                    const int64_t r = hh * per_head + rr;
                    const float *qr = q[r];
                    float dot = 0.f;
                    for (int64_t d = 0; d < D; d++) dot += qr[d] * row[d];
                    s[r * L + t0 + i] = dot * scale;
                }
            }
    }
    softmax_rows(a, s, sums, rows, per_head, G, q_len, L, first_block);
    memset(acc, 0, (size_t)(rows * D) * sizeof(float));
    for (int64_t t0 = first_block; t0 < L; t0 += bs) {
        const uint8_t *vb = v_cache + (int64_t)table[t0 / bs] * bs * stride + h0 * W;
        const int64_t n = L - t0 < bs ? L - t0 : bs;
        for (int64_t i = 0; i < n; i++)
            for (int64_t hh = 0; hh < heads; hh++) {
                const uint8_t *v8 = vb + i * stride + hh * W;
                float scale;
                memcpy(&scale, v8 + D, sizeof(float));
                for (int64_t d = 0; d < D; d++) row[d] = fp8_value(v8[d], e5m2) * scale;
                for (int64_t rr = 0; rr < per_head; rr++) {
                    const int64_t r = hh * per_head + rr;
                    const float p = s[r * L + t0 + i];
                    float *o = acc + r * D;
                    for (int64_t d = 0; d < D; d++) o[d] += p * row[d];
                }
            }
    }
    write_rows(a, acc, sums, rows, per_head, G, q_start, h0, D);
    return 0;
}

static int attend_64(const Args *a, int64_t b, int64_t h0, int64_t h1) { return attend(a, b, h0, h1, 64); }
static int attend_128(const Args *a, int64_t b, int64_t h0, int64_t h1) { return attend(a, b, h0, h1, 128); }
static int attend_any(const Args *a, int64_t b, int64_t h0, int64_t h1) { return attend(a, b, h0, h1, a->head_dim); }
static int e4m3_64(const Args *a, int64_t b, int64_t h0, int64_t h1) { return attend_fp8(a, b, h0, h1, 64, 0); }
static int e4m3_128(const Args *a, int64_t b, int64_t h0, int64_t h1) { return attend_fp8(a, b, h0, h1, 128, 0); }
static int e4m3_any(const Args *a, int64_t b, int64_t h0, int64_t h1) {
    return attend_fp8(a, b, h0, h1, a->head_dim, 0);
}
static int e5m2_64(const Args *a, int64_t b, int64_t h0, int64_t h1) { return attend_fp8(a, b, h0, h1, 64, 1); }
static int e5m2_128(const Args *a, int64_t b, int64_t h0, int64_t h1) { return attend_fp8(a, b, h0, h1, 128, 1); }
static int e5m2_any(const Args *a, int64_t b, int64_t h0, int64_t h1) {
    return attend_fp8(a, b, h0, h1, a->head_dim, 1);
}

/* 0 on success, -1 if a work item could not get its scratch memory. */
int epd_paged_decode_attention(const float *query, const void *k_cache, const void *v_cache,
                               const int32_t *block_tables, int64_t table_width, const int32_t *seq_lens,
                               const int32_t *cu_seqlens_q, const int64_t *seq_ids, int64_t num_work,
                               int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                               int64_t window, float scale, float softcap, float *out, int num_threads,
                               int fp8) {
    const Args a = {query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, table_width,
                    num_q_heads, num_kv_heads, head_dim, block_size, window, scale, softcap, out};
    int (*fn)(const Args *, int64_t, int64_t, int64_t) =
        fp8 == 1   ? (head_dim == 64 ? e4m3_64 : head_dim == 128 ? e4m3_128 : e4m3_any)
        : fp8 == 2 ? (head_dim == 64 ? e5m2_64 : head_dim == 128 ? e5m2_128 : e5m2_any)
                   : (head_dim == 64 ? attend_64 : head_dim == 128 ? attend_128 : attend_any);
    /* a work item is a whole sequence (its blocks read once, in order) when there are enough
     * of them to keep every thread busy, else one kv head of a sequence */
    const int64_t split = num_work >= 4 * (int64_t)num_threads ? 1 : num_kv_heads;
    const int64_t items = num_work * split, heads = num_kv_heads / split;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(| : failed)
    for (int64_t i = 0; i < items; i++)
        failed |= fn(&a, seq_ids[i / split], (i % split) * heads, (i % split + 1) * heads) != 0;
    return failed ? -1 : 0;
}
