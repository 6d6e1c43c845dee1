/* Gated DeltaNet over one engine step's sequences on CPU, fused (engine/layers/gated_delta_cpu.py
 * builds and loads it; the torch reference is gated_deltanet.py's torch path: causal_conv1d.py,
 * gated_delta.py, GatedRMSNorm).
 *
 * Each listed sequence s has num_tokens[s] rows from row start[s] and a state slot slots[s]
 * (fresh[s]: the sequence starts here, its states from zeros). A decode is one token, a prefill
 * chunk many; both run the recurrent rule token by token, which on CPU costs a small part of the
 * layer's projections (a head's state, Dk x Dv floats, stays in the core's cache):
 *   1. per block of channels: the causal conv of the mixed q|k|v rows over the conv state, then SiLU; the
 *      conv state left holding the last K - 1 inputs, in place in its slot;
 *   2. per value head h (key head h / (Hv / Hk)), token by token: q and k L2-normalised, q times
 *      Dk^-0.5, g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), and the gated delta
 *      rule on the recurrent state S [Dk, Dv], read and written in place in its slot:
 *          S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q
 *      then o RMS-normed over Dv, times the norm weight and silu(z), written to out's row.
 * No gather of the slots, no copies back. Float32 math; the model-dtype tensors (mixed, conv
 * states and weight, a, b, z, out) are float32 or bfloat16 (`bf16`). Work runs on the calling
 * process's OpenMP threads, as paged_attention_cpu.c's.
 *
 * Layouts (all contiguous):
 *   mixed        [rows, conv_dim], conv_dim = 2 Hk Dk + Hv Dv (q | k | v)
 *   a, b         [rows, Hv];  z, out [rows, Hv Dv]
 *   conv_states  [num_slots, conv_dim, K - 1];  conv_weight [conv_dim, K]
 *   rec_states   [num_slots, Hv, Dk, Dv] float32
 *   A_log, dt_bias [Hv], norm_weight [Dv] float32
 *   start, num_tokens, slots [num_seqs] int64;  fresh [num_seqs] int32
 *   conv_out     [rows, conv_dim] float32 scratch
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    const void *mixed, *a, *b, *z, *conv_weight;
    void *conv_states, *out;
    float *rec_states, *conv_out;
    const float *A_log, *dt_bias, *norm_weight;
    const int64_t *start, *num_tokens, *slots;
    const int32_t *fresh;
    int64_t num_seqs, conv_dim, kernel, num_k_heads, num_v_heads, k_dim, v_dim;
    float eps;
} Args;

static inline float from_bf16(uint16_t h) {
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)h << 16;
    return c.f;
}

static inline uint16_t to_bf16(float f) { /* round to nearest even, as torch's .to(torch.bfloat16) */
    union { uint32_t u; float f; } c;
    c.f = f;
    c.u += 0x7fffu + ((c.u >> 16) & 1u);
    return (uint16_t)(c.u >> 16);
}

static inline __attribute__((always_inline)) float load(const void *p, int64_t i, const int bf16) {
    return bf16 ? from_bf16(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline __attribute__((always_inline)) void store(void *p, int64_t i, float x, const int bf16) {
    if (bf16) ((uint16_t *)p)[i] = to_bf16(x);
    else ((float *)p)[i] = x;
}


static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); } /* torch's threshold */

#define INLINE static inline __attribute__((always_inline))
#define CONV_BLOCK 64 /* channels per conv work item: the inner loops run across them, vectorised */
#define MAX_KERNEL 8

/* Step 1 for sequence s, channels c0 .. c0 + CONV_BLOCK - 1 (fewer at the end), token by token:
 * conv_out's rows = silu(conv(window)), the conv state left holding the last K - 1 inputs. */
INLINE void conv_block(const Args *a, int64_t s, int64_t c0, const int bf16) {
    const int64_t C = a->conv_dim, K = a->kernel, L = K - 1, slot = a->slots[s] * C * L;
    const int64_t nc = C - c0 < CONV_BLOCK ? C - c0 : CONV_BLOCK;
    float w[MAX_KERNEL][CONV_BLOCK], win[MAX_KERNEL][CONV_BLOCK], acc[CONV_BLOCK];
    for (int64_t c = 0; c < nc; c++)
        for (int64_t j = 0; j < K; j++) {
            w[j][c] = load(a->conv_weight, (c0 + c) * K + j, bf16);
            if (j < L) win[j][c] = a->fresh[s] ? 0.0f : load(a->conv_states, slot + (c0 + c) * L + j, bf16);
        }
    for (int64_t t = a->start[s], end = t + a->num_tokens[s]; t < end; t++) {
        for (int64_t c = 0; c < nc; c++) win[L][c] = load(a->mixed, t * C + c0 + c, bf16);
        for (int64_t c = 0; c < nc; c++) acc[c] = 0.0f;
        for (int64_t j = 0; j < K; j++)
            for (int64_t c = 0; c < nc; c++) acc[c] += w[j][c] * win[j][c];
        float *y = a->conv_out + t * C + c0;
        for (int64_t c = 0; c < nc; c++) y[c] = acc[c] / (1.0f + expf(-acc[c]));
        for (int64_t j = 0; j < L; j++)
            for (int64_t c = 0; c < nc; c++) win[j][c] = win[j + 1][c];
    }
    for (int64_t c = 0; c < nc; c++)
        for (int64_t j = 0; j < L; j++) store(a->conv_states, slot + (c0 + c) * L + j, win[j][c], bf16);
}

INLINE float inv_norm(const float *x, int64_t n, float eps) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    return 1.0f / sqrtf(ss + eps);
}

/* One token t of value head h over the state S in place: steps 2 and 3. */
INLINE void head_token(const Args *a, float *S, int64_t t, int64_t h, const int bf16) {
    const int64_t Dk = a->k_dim, Dv = a->v_dim, Hv = a->num_v_heads, kh = h / (Hv / a->num_k_heads);
    const int64_t key_size = a->num_k_heads * Dk;
    const float *y = a->conv_out + t * a->conv_dim;
    const float *q_in = y + kh * Dk, *k_in = y + key_size + kh * Dk, *v = y + 2 * key_size + h * Dv;
    float q[256], k[256], delta[256], o[256]; /* Dk, Dv <= 256 (checked by the wrapper) */
    const float q_scale = inv_norm(q_in, Dk, 1e-6f) / sqrtf((float)Dk), k_scale = inv_norm(k_in, Dk, 1e-6f);
    for (int64_t i = 0; i < Dk; i++) {
        q[i] = q_in[i] * q_scale;
        k[i] = k_in[i] * k_scale;
    }
    const float g = -expf(a->A_log[h]) * softplus(load(a->a, t * Hv + h, bf16) + a->dt_bias[h]);
    const float beta = 1.0f / (1.0f + expf(-load(a->b, t * Hv + h, bf16))), decay = expf(g);

    for (int64_t j = 0; j < Dv; j++) delta[j] = 0.0f, o[j] = 0.0f;
    for (int64_t i = 0; i < Dk; i++) { /* S_old^T k */
        const float *Si = S + i * Dv;
        for (int64_t j = 0; j < Dv; j++) delta[j] += Si[j] * k[i];
    }
    for (int64_t j = 0; j < Dv; j++) delta[j] = beta * (v[j] - decay * delta[j]);
    for (int64_t i = 0; i < Dk; i++) { /* S = decay S_old + k delta^T, o = S^T q */
        float *Si = S + i * Dv;
        for (int64_t j = 0; j < Dv; j++) {
            Si[j] = decay * Si[j] + k[i] * delta[j];
            o[j] += Si[j] * q[i];
        }
    }
    float ss = 0.0f;
    for (int64_t j = 0; j < Dv; j++) ss += o[j] * o[j];
    const float rms = 1.0f / sqrtf(ss / (float)Dv + a->eps);
    const int64_t base = (t * Hv + h) * Dv;
    for (int64_t j = 0; j < Dv; j++) { /* o <- norm(o) * silu(z) */
        const float gate = load(a->z, base + j, bf16);
        o[j] = a->norm_weight[j] * o[j] * rms * gate / (1.0f + expf(-gate));
    }
    for (int64_t j = 0; j < Dv; j++) store(a->out, base + j, o[j], bf16);
}

/* Step 2 and 3 for sequence s, value head h: its tokens in order. */
INLINE void head_step(const Args *a, int64_t s, int64_t h, const int bf16) {
    const int64_t size = a->k_dim * a->v_dim;
    float *S = a->rec_states + (a->slots[s] * a->num_v_heads + h) * size;
    if (a->fresh[s]) memset(S, 0, (size_t)size * sizeof(float));
    for (int64_t t = a->start[s], end = t + a->num_tokens[s]; t < end; t++) head_token(a, S, t, h, bf16);
}

INLINE void run(const Args *a, int num_threads, const int bf16) {
    const int64_t n = a->num_seqs, Hv = a->num_v_heads, blocks = (a->conv_dim + CONV_BLOCK - 1) / CONV_BLOCK;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t w = 0; w < n * blocks; w++) conv_block(a, w / blocks, w % blocks * CONV_BLOCK, bf16);
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < n * Hv; w++) head_step(a, w / Hv, w % Hv, bf16);
    }
}

/* dtype_is_bf16: the model-dtype tensors are bfloat16 (else float32). */
void epd_gated_delta(const void *mixed, const void *a_proj, const void *b_proj, const void *z, void *conv_states,
                     const void *conv_weight, float *rec_states, const float *A_log, const float *dt_bias,
                     const float *norm_weight, const int64_t *start, const int64_t *num_tokens,
                     const int64_t *slots, const int32_t *fresh, int64_t num_seqs, int64_t conv_dim, int64_t kernel,
                     int64_t num_k_heads, int64_t num_v_heads, int64_t k_dim, int64_t v_dim, float eps,
                     float *conv_out, void *out, int dtype_is_bf16, int num_threads) {
    const Args args = {mixed, a_proj, b_proj, z, conv_weight, conv_states, out, rec_states, conv_out, A_log, dt_bias,
                       norm_weight, start, num_tokens, slots, fresh, num_seqs, conv_dim, kernel, num_k_heads,
                       num_v_heads, k_dim, v_dim, eps};
    if (dtype_is_bf16) run(&args, num_threads, 1);
    else run(&args, num_threads, 0);
}
