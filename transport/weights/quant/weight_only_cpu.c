/* Weight-only quantized linears on CPU: y = x W^T + bias with W stored in 4 or 8 bits
 * (transport/weights/quant/weight_only_linear.py repacks a checkpoint's tensors into this
 * layout, builds and loads this file, and holds the torch reference the tests compare against).
 *
 * W is never expanded into a float copy: for each tile of NT = 32 output columns and each
 * group of G <= 256 input columns, the tile's G x 32 weights are dequantized into a buffer of
 * at most 32 KB (L1) exactly as the formats define them, then every row of x multiplies it:
 *     int4:  w = (q - zero) * scale     q 0..15, zero and scale per group and column (float)
 *     int8:  w = q * scale              q -128..127
 *     fp8:   w = e4m3(q) * scale        q an e4m3 byte (no NaN in a checkpoint's weights)
 * The dequantized values are those of the float reference, bit for bit; only the order of
 * the sums differs (float32 accumulation). A decode step's rows (up to ROW_BLOCK = 64) share
 * one dequantization of each tile, multiplied ROWS rows at a time from registers; a prefill's
 * many rows dequantize each tile once per 64 rows. Work: one tile of columns per OpenMP
 * iteration, on the caller's threads.
 *
 * Layouts (all contiguous; T = N / 32 tiles, K a multiple of G):
 *   x      [M, K] float32;  out [M, N] float32;  bias [N] float32 or NULL
 *   q      int4: uint8 [T, K, 16]: byte j of tile t, row k holds column 32t + j (low nibble)
 *                and column 32t + 16 + j (high nibble)
 *          int8 / fp8: uint8 [T, K, 32]
 *   scale  [T, K / G, 32] float32;  zero [T, K / G, 32] float32 (int4 only, else NULL)
 */
#include <stdint.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

#define NT 32    /* output columns per tile */
#define HALF 16  /* one vector of floats */
#if defined(__AVX512F__)
#define ROWS 8   /* rows of x per register block: 16 accumulators of the 32 vector registers */
#else
#define ROWS 4   /* rows of x per register block: 8 accumulators (two halves each) */
#endif
#define MAX_GROUP 256

typedef float v16f __attribute__((vector_size(64)));

enum { INT4 = 0, INT8 = 1, FP8 = 2 };

#define INLINE static inline __attribute__((always_inline))

INLINE v16f loadf(const float *p) { v16f v; memcpy(&v, p, sizeof v); return v; }
INLINE void storef(float *p, v16f v) { memcpy(p, &v, sizeof v); }

/* e4m3 bytes -> float. The byte's sign, exponent and mantissa moved into a half's bits give
 * the e4m3 value times 2^-8 (the exponent's bias 7 against half's 15), subnormals included;
 * the CPU's half -> float conversion (F16C) widens it exactly, and times 256 is exact. Without
 * F16C: the float's bits built directly (a subnormal e4m3 as its mantissa times 2^-9). */
INLINE void e4m3_to_float(float *restrict out, const uint8_t *restrict b) {
    uint16_t h[NT];
    for (int j = 0; j < NT; j++) h[j] = (uint16_t)(((b[j] & 0x7f) << 7) | ((b[j] & 0x80) << 8));
#if defined(__F16C__)
    for (int j = 0; j < NT; j += 8)
        _mm256_storeu_ps(out + j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + j))));
    for (int j = 0; j < NT; j++) out[j] *= 256.0f;
#else
    for (int j = 0; j < NT; j++) {
        const uint32_t mag = b[j] & 0x7f;
        union { float f; uint32_t u; } v = { .f = (float)(mag & 7) * 0x1p-9f };
        if (mag >> 3) v.u = (mag << 20) + (120u << 23);
        v.u |= (uint32_t)(b[j] & 0x80) << 24;
        out[j] = v.f;
    }
#endif
}

/* The tile's rows k0 .. k0 + G - 1 dequantized into w [G][NT]. Plain loops over the 32
 * columns: the compiler vectorises them (byte -> int32 -> float widening, no scalar steps). */
INLINE void dequantize_tile(float *restrict w, const uint8_t *restrict q, const float *restrict scale,
                            const float *restrict zero, int64_t G, const int format) {
    if (format == INT4) {
        for (int64_t k = 0; k < G; k++) {
            const uint8_t *b = q + k * HALF;
            float *row = w + k * NT;
            for (int j = 0; j < HALF; j++) {
                row[j] = ((float)(b[j] & 15) - zero[j]) * scale[j];
                row[j + HALF] = ((float)(b[j] >> 4) - zero[j + HALF]) * scale[j + HALF];
            }
        }
    } else if (format == INT8) {
        for (int64_t k = 0; k < G; k++) {
            const int8_t *b = (const int8_t *)q + k * NT;
            float *row = w + k * NT;
            for (int j = 0; j < NT; j++) row[j] = (float)b[j] * scale[j];
        }
    } else {
        for (int64_t k = 0; k < G; k++) {
            float *row = w + k * NT;
            e4m3_to_float(row, q + k * NT);
            for (int j = 0; j < NT; j++) row[j] *= scale[j];
        }
    }
}

/* acc[r] += x[r, k0 .. k0 + G) . w for `rows` (<= ROWS) rows: two vectors a row in registers. */
INLINE void multiply_tile(float *restrict acc, const float *restrict x, int64_t K, const float *restrict w,
                          int64_t G, int64_t rows) {
    if (rows == ROWS) {
        v16f a[ROWS][2];
        for (int r = 0; r < ROWS; r++) { a[r][0] = loadf(acc + r * NT); a[r][1] = loadf(acc + r * NT + HALF); }
        for (int64_t k = 0; k < G; k++) {
            const v16f w0 = loadf(w + k * NT), w1 = loadf(w + k * NT + HALF);
            for (int r = 0; r < ROWS; r++) {
                const float xv = x[r * K + k];
                a[r][0] += xv * w0;
                a[r][1] += xv * w1;
            }
        }
        for (int r = 0; r < ROWS; r++) { storef(acc + r * NT, a[r][0]); storef(acc + r * NT + HALF, a[r][1]); }
        return;
    }
    for (int64_t r = 0; r < rows; r++) {
        v16f a0 = loadf(acc + r * NT), a1 = loadf(acc + r * NT + HALF);
        for (int64_t k = 0; k < G; k++) {
            const float xv = x[r * K + k];
            a0 += xv * loadf(w + k * NT);
            a1 += xv * loadf(w + k * NT + HALF);
        }
        storef(acc + r * NT, a0);
        storef(acc + r * NT + HALF, a1);
    }
}

#define ROW_BLOCK 64 /* rows whose accumulators stay in a tile's scratch: 8 KB */

INLINE void run_tile(const float *x, const uint8_t *q, const float *scale, const float *zero, const float *bias,
                     float *out, int64_t M, int64_t K, int64_t N, int64_t G, int64_t t, const int format) {
    const int64_t groups = K / G, qrow = format == INT4 ? HALF : NT;
    float w[MAX_GROUP * NT] __attribute__((aligned(64)));
    float acc[ROW_BLOCK * NT] __attribute__((aligned(64)));
    for (int64_t m0 = 0; m0 < M; m0 += ROW_BLOCK) {
        const int64_t mb = M - m0 < ROW_BLOCK ? M - m0 : ROW_BLOCK;
        memset(acc, 0, sizeof(float) * mb * NT);
        for (int64_t g = 0; g < groups; g++) {
            const int64_t meta = (t * groups + g) * NT;
            dequantize_tile(w, q + (t * K + g * G) * qrow, scale + meta, zero ? zero + meta : 0, G, format);
            for (int64_t r = 0; r < mb; r += ROWS) {
                const int64_t rows = mb - r < ROWS ? mb - r : ROWS;
                multiply_tile(acc + r * NT, x + (m0 + r) * K + g * G, K, w, G, rows);
            }
        }
        for (int64_t r = 0; r < mb; r++)
            for (int64_t n = 0; n < NT; n++)
                out[(m0 + r) * N + t * NT + n] = acc[r * NT + n] + (bias ? bias[t * NT + n] : 0.0f);
    }
}

/* Returns 0, or -1 for sizes it does not take (the wrapper checks them first). */
int epd_weight_only_linear(const float *x, const uint8_t *q, const float *scale, const float *zero, const float *bias,
                           float *out, int64_t M, int64_t K, int64_t N, int64_t G, int format, int num_threads) {
    if (N % NT || G <= 0 || G > MAX_GROUP || K % G || format < INT4 || format > FP8) return -1;
    const int64_t tiles = N / NT;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        if (format == INT4) run_tile(x, q, scale, zero, bias, out, M, K, N, G, t, INT4);
        else if (format == INT8) run_tile(x, q, scale, zero, bias, out, M, K, N, G, t, INT8);
        else run_tile(x, q, scale, zero, bias, out, M, K, N, G, t, FP8);
    }
    return 0;
}
