/* RMSNorm and rotary embeddings for the CPU, fp32 and bf16, each one call instead of torch's
 * chain of small ops.
 *
 * Why: a decode step of a small model is a few rows per layer, so the model's elementwise work is
 * its dispatch: torch's RMSNorm is 6-8 ops (~25 us on this 2-core machine for one row of 512),
 * its rotary embedding ~14 (index_select, cat, cast, neg, mul, add: ~60 us for q and k of one
 * token). Here each is one pass over the row (~2-4 us with the ctypes call).
 *
 * Arithmetic is transformers' (`LlamaRMSNorm`, `apply_rotary_pos_emb`), rounding where it rounds:
 *   rms_norm   n = x * rsqrt(mean(x^2) + eps) in fp32; fp32: out = w * n; bf16: out =
 *              bf16(w * bf16(n)) (the product of two bf16 values is exact in fp32)
 *   rope       neox halves: out[i] = x[i] cos[i] - x[i+h] sin[i], out[i+h] = x[i+h] cos[i] +
 *              x[i] sin[i], cos and sin from the model's shared cache in x's dtype; bf16:
 *              each product rounded to bf16, then the sum, as torch's bf16 ops do one by one
 * fp32 results may differ from torch's in the last bit (the order of the squares' sum, fused
 * multiply-adds); bf16 rope results are torch's exactly.
 *
 * Layouts: rows of `n` contiguous elements; a row's start is given by strides (in elements), so
 * q and k may be views into the fused qkv projection's output. Rows split over `num_threads`
 * OpenMP threads (torch's own pool, as in paged_decode.c) when there are many.
 *
 * Built at first use by workers/kernels/norm_rope.py: cc -O3 -march=native -ffast-math.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"

#define PARALLEL_ROWS 64 /* rows below this run on the calling thread */

/* 1 / sqrt(mean(x^2) + eps) of one row */
static inline float inv_rms_f32(const float *x, int64_t n, float eps) {
    float acc[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += x[i + j] * x[i + j];
    float sum = 0.0f;
    for (int j = 0; j < 8; j++) sum += acc[j];
    for (; i < n; i++) sum += x[i] * x[i];
    return 1.0f / sqrtf(sum / (float)n + eps);
}

void rms_norm_f32(const float *x, int64_t x_stride, const float *w, float *out, int64_t rows,
                  int64_t n, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float *o = out + r * n;
        const float inv = inv_rms_f32(xr, n, eps);
        for (int64_t i = 0; i < n; i++) o[i] = w[i] * (xr[i] * inv);
    }
}

void rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, uint16_t *out,
                   int64_t rows, int64_t n, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * x_stride;
        uint16_t *o = out + r * n;
        float acc[8] = {0};
        int64_t i = 0;
        for (; i + 8 <= n; i += 8)
            for (int j = 0; j < 8; j++) {
                const float v = bf16_to_f32(xr[i + j]);
                acc[j] += v * v;
            }
        float sum = 0.0f;
        for (int j = 0; j < 8; j++) sum += acc[j];
        for (; i < n; i++) sum += bf16_to_f32(xr[i]) * bf16_to_f32(xr[i]);
        const float inv = 1.0f / sqrtf(sum / (float)n + eps);
        for (i = 0; i < n; i++)
            o[i] = f32_to_bf16(bf16_to_f32(w[i]) * round_bf16(bf16_to_f32(xr[i]) * inv));
    }
}

/* One head's row: x [2h] -> out [2h] with this position's cos/sin [h]. */
static inline void rope_row_f32(const float *x, float *out, const float *cos, const float *sin,
                                int64_t h) {
    for (int64_t i = 0; i < h; i++) {
        const float x1 = x[i], x2 = x[i + h];
        out[i] = x1 * cos[i] - x2 * sin[i];
        out[i + h] = x2 * cos[i] + x1 * sin[i];
    }
}

static inline void rope_row_bf16(const uint16_t *x, uint16_t *out, const uint16_t *cos,
                                 const uint16_t *sin, int64_t h) {
    for (int64_t i = 0; i < h; i++) {
        const float x1 = bf16_to_f32(x[i]), x2 = bf16_to_f32(x[i + h]);
        const float c = bf16_to_f32(cos[i]), s = bf16_to_f32(sin[i]);
        /* q * cos + rotate_half(q) * sin, rotate_half(q) = cat(-x2, x1) */
        out[i] = f32_to_bf16(round_bf16(x1 * c) + round_bf16(-x2 * s));
        out[i + h] = f32_to_bf16(round_bf16(x2 * c) + round_bf16(x1 * s));
    }
}

/* Returns 0, or -1 (nothing written) when a position is outside [0, max_position). */
static int positions_ok(const int64_t *positions, int64_t tokens, int64_t max_position) {
    for (int64_t t = 0; t < tokens; t++)
        if (positions[t] < 0 || positions[t] >= max_position) return 0;
    return 1;
}

/* NAME(x, ...): x [T, H, D] of type T with strides (token, head) in elements and contiguous D;
 * out [T, H, D] contiguous; cos_sin cache [max_position, D] of type T (row stride
 * cache_stride): cos in its first D / 2 columns, sin in the rest, rows picked by positions [T].
 * Returns 0, or -1 (nothing written) for a position past the cache. */
#define DEFINE_ROPE(NAME, T, ROW_FN)                                                           \
    int NAME(const T *x, int64_t tok_stride, int64_t head_stride, T *out,                      \
             const int64_t *positions, const T *cos_sin, int64_t cache_stride,                 \
             int64_t max_position, int64_t tokens, int64_t heads, int64_t half,                \
             int num_threads) {                                                                \
        if (!positions_ok(positions, tokens, max_position)) return -1;                         \
        _Pragma("omp parallel for num_threads(num_threads) if (tokens >= PARALLEL_ROWS)")      \
        for (int64_t t = 0; t < tokens; t++) {                                                 \
            const T *c = cos_sin + positions[t] * cache_stride, *s = c + half;                 \
            for (int64_t hd = 0; hd < heads; hd++)                                             \
                ROW_FN(x + t * tok_stride + hd * head_stride,                                  \
                       out + (t * heads + hd) * 2 * half, c, s, half);                         \
        }                                                                                      \
        return 0;                                                                              \
    }

DEFINE_ROPE(rope_f32, float, rope_row_f32)
DEFINE_ROPE(rope_bf16, uint16_t, rope_row_bf16)
