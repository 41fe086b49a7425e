/* Integer matmuls on the CPU: int8 or int4 weights times activations quantized to int8 in blocks
 * of 32 columns (each block's absolute maximum / 127, as llama.cpp's Q8_0 does), with AVX-512
 * VNNI's 4-way byte dot products (vpdpbusd). Widening each weight byte to a float first (the
 * weight-only way) keeps a core busy converting: 16-21 GB/s of int8 weights on this 2-core
 * machine, where one vpdpbusd does 64 multiply-adds with no conversion. Blocks of 32 columns
 * make a tensor-parallel shard of x (whole blocks) quantize exactly as the whole row does.
 *
 * vpdpbusd multiplies unsigned bytes by signed ones. Weights are the unsigned side:
 * - int8 q stored as q + 128 (one scale per output row): per block b,
 *   sum (q + 128) xq = sum q xq + 128 sum xq, and the last term is the row of x's alone;
 * - int4 stored as u = q + 8 (one scale and zero per group of columns g):
 *   w = (u - 8 - z_g) s_g, so y = sum_g s_g sum_b xs_b sum u xq - sum_g (8 + z_g) s_g X_g with
 *   X_g = sum_{b in g} xs_b sum xq, the offsets (8 + z_g) s_g given per group, or NULL
 *   for symmetric weights (z_g = 0: each block's integer sums start from -8 sum xq instead,
 *   exact, with no correction per group; a step reads 4 bytes per row and group fewer, and at
 *   1-8 rows of x with groups of 32 the kernel is 1.03-1.22x the general path, paired).
 * Both come blocked by workers/kernels/int_gemm.py (`block_int8`, `block_int4`): a thread reads
 * each tile of 4 output rows as one sequential stream (rows of a few KB read side by side left
 * the prefetcher restarting: 20 GB/s, where a stream reaches 30+), and a tile read once serves
 * every pass over the rows of x from the core's own caches.
 *
 * Returns -1 where the CPU has no AVX-512 VNNI (the caller then uses torch's kernels), -2 for a
 * shape it does not take (K a multiple of 64 for int8; of 32, with groups of 32 dividing it, for
 * int4), -3 when out of memory.
 *
 * Built at first use by workers/kernels/native.py: cc -O3 -march=native -ffast-math -fopenmp.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "chunks.h"
#include "kernels.h"
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAVE_VNNI 1
#else
#define HAVE_VNNI 0
#endif

#define ROWS 4  /* weight rows per tile */
#define BLOCK 32 /* columns of x per activation scale */
#define MB 4    /* rows of x per pass over a tile */

int int_gemm_available(void) { return HAVE_VNNI; }

/* Rows of x and y are fp32, or bf16 (`bf16` set): a decode step's activations are bf16, and
 * converting them here saves two torch calls per matmul (a few microseconds each, against
 * tens for a whole 0.6B layer's matmul at one row). */
static inline float load_x(const void *x, int bf16, int64_t i) {
    if (!bf16) return ((const float *)x)[i];
    uint32_t bits = (uint32_t)((const uint16_t *)x)[i] << 16;
    float v;
    memcpy(&v, &bits, 4);
    return v;
}

/* y[i] = v, rounded to the nearest even bf16 when `bf16` (as torch's fp32 -> bf16 does). */
static inline void store_y(void *y, int bf16, int64_t i, float v) {
    if (!bf16) {
        ((float *)y)[i] = v;
        return;
    }
    uint32_t bits;
    memcpy(&bits, &v, 4);
    /* NaN tested on the bits: -ffast-math lets the compiler assume isnan() is false */
    ((uint16_t *)y)[i] = (bits & 0x7FFFFFFFu) > 0x7F800000u
                             ? (uint16_t)0x7FC0
                             : (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

/* x [M, K] -> int8 blocks xq, each block's scale xs [M, K / BLOCK], the sum of its values
 * (xsum) and that times the scale (xw), both [M, K / BLOCK], for the offsets of the unsigned
 * weights. */
static void quantize_blocks(const void *x, int x_bf16, int64_t M, int64_t K, int8_t *xq,
                            float *xs, float *xw, int32_t *xsum) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < K / BLOCK; b++) {
            float src[BLOCK];
            for (int k = 0; k < BLOCK; k++) src[k] = load_x(x, x_bf16, m * K + b * BLOCK + k);
            float amax = 0.0f;
            for (int k = 0; k < BLOCK; k++) amax = fmaxf(amax, fabsf(src[k]));
            float scale = amax > 0.0f ? amax / 127.0f : 1.0f, inv = 1.0f / scale;
            int sum = 0;
            /* rintf, not lrintf (the same nearest even): this loop vectorizes, where lrintf's
             * long kept it scalar (5 rows of 1,536: 4.1 against 10.2 us, the same bits) */
            for (int k = 0; k < BLOCK; k++) {
                const int v = (int)rintf(src[k] * inv);
                xq[m * K + b * BLOCK + k] = (int8_t)v;
                sum += v;
            }
            xs[m * (K / BLOCK) + b] = scale;
            xw[m * (K / BLOCK) + b] = scale * (float)sum;
            xsum[m * (K / BLOCK) + b] = sum;
        }
}

#if HAVE_VNNI
/* The 4 sums of each 128-bit lane of v. */
static inline __m128 lane_sums(__m512 v) {
    __m128 a0 = _mm512_extractf32x4_ps(v, 0), a1 = _mm512_extractf32x4_ps(v, 1);
    __m128 a2 = _mm512_extractf32x4_ps(v, 2), a3 = _mm512_extractf32x4_ps(v, 3);
    return _mm_hadd_ps(_mm_hadd_ps(a0, a1), _mm_hadd_ps(a2, a3));
}

/* int8, tile layout: per 64 columns, the tile's 4 rows' 64 bytes (q + 128) one after another.
 * One tile against `mr` rows of x from m0; inlined with mr a constant, so the accumulators stay
 * in registers (with mr a variable they lived on the stack: 25 cycles per 64 columns at one row
 * of x, where this takes about a third of that). */
static inline __attribute__((always_inline)) void tile_i8(
    const int8_t *xq, const float *xs, const float *xw, const uint8_t *tile,
    const float *scales, void *y, int y_bf16, int64_t N, int64_t K, int64_t n0, int nr,
    int64_t m0, const int mr) {
    const int64_t blocks = K / BLOCK;
    __m512 acc[MB][ROWS];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < ROWS; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t c = 0; c < K / 64; c++) {
        __m512i wv[ROWS];
        for (int j = 0; j < ROWS; j++)
            wv[j] = _mm512_loadu_si512((const void *)(tile + (c * ROWS + j) * 64));
        for (int i = 0; i < mr; i++) {
            const int64_t row = m0 + i;
            __m512i xv = _mm512_loadu_si512((const void *)(xq + row * K + c * 64));
            /* lanes 0-7 hold the first block of 32 columns, 8-15 the second */
            __m512 sv = _mm512_insertf32x8(_mm512_set1_ps(xs[row * blocks + 2 * c]),
                                           _mm256_set1_ps(xs[row * blocks + 2 * c + 1]), 1);
            for (int j = 0; j < ROWS; j++) {
                __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[j], xv);
                acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), sv, acc[i][j]);
            }
        }
    }
    for (int i = 0; i < mr; i++) {
        const int64_t row = m0 + i;
        float corr = 0.0f;
        for (int64_t b = 0; b < blocks; b++) corr += xw[row * blocks + b];
        for (int j = 0; j < nr; j++)
            store_y(y, y_bf16, row * N + n0 + j,
                    (_mm512_reduce_add_ps(acc[i][j]) - 128.0f * corr) * scales[n0 + j]);
    }
}

static void rows_i8(const int8_t *xq, const float *xs, const float *xw, const uint8_t *w,
                    const float *scales, void *y, int y_bf16, int64_t M, int64_t N, int64_t K,
                    int64_t start, int64_t end) {
    for (int64_t n0 = start; n0 < end; n0 += ROWS) {
        const int nr = end - n0 < ROWS ? (int)(end - n0) : ROWS;
        const uint8_t *tile = w + n0 * K;
        for (int64_t m0 = 0; m0 < M; m0 += MB) {
#define I8(MR) tile_i8(xq, xs, xw, tile, scales, y, y_bf16, N, K, n0, nr, m0, MR)
            switch (M - m0 < MB ? (int)(M - m0) : MB) {
                case 1: I8(1); break;
                case 2: I8(2); break;
                case 3: I8(3); break;
                default: I8(MB);
            }
#undef I8
        }
    }
}

/* 4 scales from `at`: fp32, or bf16 (`bf16`: a checkpoint's bf16 scales, exact, in half the
 * bytes). */
static inline __m128 load4(const void *scales, int bf16, int64_t at) {
    if (!bf16) return _mm_loadu_ps((const float *)scales + at);
    __m128i h = _mm_loadl_epi64((const __m128i *)((const uint16_t *)scales + at));
    return _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(h), 16));
}

/* int4, tile layout: per 32 columns, 64 bytes, 16 per row, byte i of row j holding column i
 * (low nibble) and i + 16 (high). One 64-byte load gives all 4 rows: the low nibbles against
 * x's 16 columns broadcast to each 128-bit lane, the high ones against the next 16, so lane j
 * of the accumulator sums row j. Scales and offsets are [tiles, groups, 4].
 * `sym` (symmetric weights, no offsets): u - 8 is q, so each block's dot products start from
 * -8 times the block's integer sum of x, in one lane per row: exact, and nothing is left to
 * subtract per group (the general case keeps a float correction per group and row: at one row of
 * x and groups of 32, a third of the loop's instructions). */
static inline __attribute__((always_inline)) void tile_i4(
    const int8_t *xq, const float *xs, const float *xw, const int32_t *xsum, const uint8_t *tile,
    const void *scales, int s_bf16, const float *offsets, void *y, int y_bf16, int64_t N,
    int64_t K,
    int64_t group, int64_t t, int64_t n0, int nr, int64_t m0, const int mr, const int sym) {
    const int64_t groups = K / group, per_group = group / BLOCK, blocks = K / BLOCK;
    const __m512i low = _mm512_set1_epi8(15);
    const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    __m512 total[MB];
    __m128 corr[MB];
    for (int i = 0; i < mr; i++) total[i] = _mm512_setzero_ps(), corr[i] = _mm_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512 acc[MB];
        float xg[MB];
        for (int i = 0; i < mr; i++) acc[i] = _mm512_setzero_ps(), xg[i] = 0.0f;
        for (int64_t c = g * per_group; c < (g + 1) * per_group; c++) {
            /* a kilobyte ahead: the next tile's lines when this one ends (measured: 3% at one
             * row of a 0.6B model's projections; 4 KB ahead was slower) */
            _mm_prefetch((const char *)(tile + (c + 16) * 64), _MM_HINT_T0);
            __m512i b = _mm512_loadu_si512((const void *)(tile + c * 64));
            __m512i lo = _mm512_and_si512(b, low);
            __m512i hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), low);
            for (int i = 0; i < mr; i++) {
                const int64_t row = m0 + i;
                const int8_t *xr = xq + row * K + c * BLOCK;
                __m512i xl = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)xr));
                __m512i xh =
                    _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(xr + 16)));
                __m512i d0 = sym ? _mm512_maskz_set1_epi32(0x1111, -8 * xsum[row * blocks + c])
                                 : _mm512_setzero_si512();
                __m512i d = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(d0, lo, xl), hi, xh);
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d),
                                         _mm512_set1_ps(xs[row * blocks + c]), acc[i]);
                if (!sym) xg[i] += xw[row * blocks + c];
            }
        }
        const int64_t at = (t * groups + g) * ROWS;
        __m512 s = _mm512_permutexvar_ps(spread,
                                         _mm512_castps128_ps512(load4(scales, s_bf16, at)));
        for (int i = 0; i < mr; i++) total[i] = _mm512_fmadd_ps(acc[i], s, total[i]);
        if (!sym) {
            __m128 o = offsets ? _mm_loadu_ps(offsets + at)
                               : _mm_mul_ps(load4(scales, s_bf16, at), _mm_set1_ps(8.0f));
            for (int i = 0; i < mr; i++) corr[i] = _mm_fmadd_ps(o, _mm_set1_ps(xg[i]), corr[i]);
        }
    }
    for (int i = 0; i < mr; i++) {
        float out[ROWS];
        _mm_storeu_ps(out, _mm_sub_ps(lane_sums(total[i]), corr[i]));
        for (int j = 0; j < nr; j++) store_y(y, y_bf16, (m0 + i) * N + n0 + j, out[j]);
    }
}

static void rows_i4(const int8_t *xq, const float *xs, const float *xw, const int32_t *xsum,
                    const uint8_t *w,
                    const void *scales, int s_bf16, const float *offsets, void *y, int y_bf16,
                    int64_t M,
                    int64_t N, int64_t K, int64_t group, int64_t start, int64_t end) {
    for (int64_t n0 = start; n0 < end; n0 += ROWS) {
        const int nr = end - n0 < ROWS ? (int)(end - n0) : ROWS;
        const int64_t t = n0 / ROWS;
        const uint8_t *tile = w + t * ROWS * (K / 2);
        for (int64_t m0 = 0; m0 < M; m0 += MB) {
#define I4(MR, SYM)                                                                          \
    tile_i4(xq, xs, xw, xsum, tile, scales, s_bf16, offsets, y, y_bf16, N, K, group, t, n0, nr, \
            m0, MR, SYM)
#define I4_ROWS(SYM)                                       \
    switch (M - m0 < MB ? (int)(M - m0) : MB) {            \
        case 1: I4(1, SYM); break;                         \
        case 2: I4(2, SYM); break;                         \
        case 3: I4(3, SYM); break;                         \
        default: I4(MB, SYM);                              \
    }
            if (offsets == NULL) I4_ROWS(1) else I4_ROWS(0)
#undef I4_ROWS
#undef I4
        }
    }
}
#endif

/* The quantized activations (acts_t, kernels.h; gguf_vnni.c's too). */
int int_acts_quantize(const void *x, int x_bf16, int64_t M, int64_t K, acts_t *a) {
    a->xq = malloc(M * K);
    a->xs = malloc(sizeof(float) * M * (K / BLOCK));
    a->xw = malloc(sizeof(float) * M * (K / BLOCK));
    a->xsum = malloc(sizeof(int32_t) * M * (K / BLOCK));
    if (!a->xq || !a->xs || !a->xw || !a->xsum) return -3;
    quantize_blocks(x, x_bf16, M, K, a->xq, a->xs, a->xw, a->xsum);
    return 0;
}

void int_acts_release(acts_t *a) { free(a->xq), free(a->xs), free(a->xw), free(a->xsum); }

/* Quantizes x, then runs `CALL` (a rows_* call over [start, end)) on `num_threads` threads,
 * over chunks of rows (chunks.h). */
#define QUANTIZE_THEN_OVER_THREADS(CALL)                                                      \
    do {                                                                                      \
        acts_t a;                                                                             \
        int rc = int_acts_quantize(x, x_bf16, M, K, &a);                                      \
        if (rc == 0) {                                                                        \
            if (num_threads < 1) num_threads = 1;                                             \
            _Pragma("omp parallel num_threads(num_threads)")                                  \
            FOR_EACH_CHUNK(N, ROWS, num_threads, CALL);                                       \
        }                                                                                     \
        int_acts_release(&a);                                                                 \
        return rc;                                                                            \
    } while (0)

/* x [M, K] (bf16 when x_bf16, else fp32) times the blocked weights -> y [M, N] (bf16 when
 * y_bf16, else fp32). */
int int8_gemm(const void *x, int x_bf16, const uint8_t *w, const float *scales, void *y,
              int y_bf16, int64_t M, int64_t N, int64_t K, int num_threads) {
#if HAVE_VNNI
    if (K % 64) return -2;
    QUANTIZE_THEN_OVER_THREADS(
        rows_i8(a.xq, a.xs, a.xw, w, scales, y, y_bf16, M, N, K, start, end));
#else
    return -1;
#endif
}

int int4_gemm(const void *x, int x_bf16, const uint8_t *w, const void *scales, int s_bf16,
              const float *offsets, void *y, int y_bf16, int64_t M, int64_t N, int64_t K,
              int64_t group, int num_threads) {
#if HAVE_VNNI
    if (K % BLOCK || group % BLOCK || K % group) return -2;
    QUANTIZE_THEN_OVER_THREADS(rows_i4(a.xq, a.xs, a.xw, a.xsum, w, scales, s_bf16, offsets, y,
                                       y_bf16,
                                       M, N, K, group, start, end));
#else
    return -1;
#endif
}
