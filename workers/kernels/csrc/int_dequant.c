/* The packed int8/int4 weights of int_gemm.c, unpacked to bf16 rows for a bf16 matmul (oneDNN,
 * AMX where the CPU has it) when x has many rows: there the VNNI kernels, which quantize x and
 * take each tile's dot products 4 rows of x at a time, are compute-bound at a fifth of what a
 * bf16 matmul does (workers/kernels/int_gemm.py `unpacked_mm`).
 *
 * Both read the layouts workers/kernels/int_gemm.py's `block_int8` / `block_int4` make (tiles
 * of 4 output rows, the last padded) and write rows [n0, n1) of the [N, K] weight, row-major, to
 * `out` (n0 a multiple of 4):
 * - int8: tile bytes q + 128, per 64 columns the 4 rows' 64 bytes; out = q, exact in bf16 (the
 *   caller applies the per-channel scale to the fp32 result);
 * - int4: tile bytes, per 32 columns 16 per row (byte i: column i in the low nibble, i + 16 in
 *   the high one) of u = q + 8; out = u s_g - o_g rounded to the nearest even bf16, with the
 *   scales s and offsets o = (8 + z) s as [tiles, groups, 4] (o NULL: 8 s).
 *
 * Returns -1 where the CPU lacks AVX-512 BF16 (the caller keeps the VNNI kernels), -2 for a
 * shape it does not take (rows not from a tile's start, K not a multiple of 64 for int8 or of
 * 32 and the group for int4).
 *
 * Built at first use by workers/kernels/native.py: cc -O3 -march=native -ffast-math -fopenmp.
 */
#include <omp.h>
#include <stdint.h>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAVE_BF16 1
#else
#define HAVE_BF16 0
#endif

#define ROWS 4 /* weight rows per tile */

int int_dequant_available(void) { return HAVE_BF16; }

#if HAVE_BF16
/* 16 floats rounded to nearest even bf16, stored at out. */
static inline void store16(uint16_t *out, __m512 v) {
    _mm256_storeu_si256((__m256i *)out, (__m256i)_mm512_cvtneps_pbh(v));
}

static void tile_i8(const uint8_t *tile, int nr, int64_t K, uint16_t *out) {
    const __m128i bias = _mm_set1_epi8((char)0x80);
    for (int64_t c = 0; c < K / 64; c++)
        for (int j = 0; j < nr; j++)
            for (int h = 0; h < 4; h++) {
                const uint8_t *u = tile + (c * ROWS + j) * 64 + h * 16;
                /* q + 128 -> q, as signed bytes */
                __m128i q = _mm_xor_si128(_mm_loadu_si128((const __m128i *)u), bias);
                store16(out + j * K + c * 64 + h * 16,
                        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)));
            }
}

static inline __m512 scale_of(const void *scales, int bf16, int64_t at) {
    if (!bf16) return _mm512_set1_ps(((const float *)scales)[at]);
    uint32_t bits = (uint32_t)((const uint16_t *)scales)[at] << 16;
    return _mm512_castsi512_ps(_mm512_set1_epi32((int)bits));
}

static void tile_i4(const uint8_t *tile, const void *scales, int s_bf16, const float *offsets,
                    int64_t t, int nr, int64_t K, int64_t group, uint16_t *out) {
    const int64_t groups = K / group, per_group = group / 32;
    const __m512i low = _mm512_set1_epi32(15);
    for (int j = 0; j < nr; j++)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t at = (t * groups + g) * ROWS + j;
            __m512 s = scale_of(scales, s_bf16, at);
            __m512 o = offsets ? _mm512_set1_ps(offsets[at])
                               : _mm512_mul_ps(s, _mm512_set1_ps(8.0f));
            for (int64_t c = g * per_group; c < (g + 1) * per_group; c++) {
                __m128i b = _mm_loadu_si128((const __m128i *)(tile + c * 64 + j * 16));
                __m512i u = _mm512_cvtepu8_epi32(b);
                __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(u, low));
                __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(u, 4));
                store16(out + j * K + c * 32, _mm512_fmsub_ps(lo, s, o));
                store16(out + j * K + c * 32 + 16, _mm512_fmsub_ps(hi, s, o));
            }
        }
}
#endif

/* Rows [n0, n1) of the [N, K] int8 weight `block_int8` blocked -> out [n1 - n0, K] bf16. */
int int8_to_bf16(const uint8_t *w, int64_t N, int64_t K, int64_t n0, int64_t n1,
                 uint16_t *out, int num_threads) {
#if HAVE_BF16
    if (K % 64 || n0 % ROWS || n0 < 0 || n1 > N || n1 < n0) return -2;
    const int64_t t0 = n0 / ROWS, t1 = (n1 + ROWS - 1) / ROWS;
#pragma omp parallel for num_threads(num_threads < 1 ? 1 : num_threads) schedule(static)
    for (int64_t t = t0; t < t1; t++) {
        const int nr = n1 - t * ROWS < ROWS ? (int)(n1 - t * ROWS) : ROWS;
        tile_i8(w + t * ROWS * K, nr, K, out + (t * ROWS - n0) * K);
    }
    return 0;
#else
    return -1;
#endif
}

/* Rows [n0, n1) of the [N, K] int4 weight `block_int4` blocked (groups of `group` columns) ->
 * out [n1 - n0, K] bf16. */
int int4_to_bf16(const uint8_t *w, const void *scales, int s_bf16, const float *offsets,
                 int64_t N, int64_t K, int64_t group, int64_t n0, int64_t n1, uint16_t *out,
                 int num_threads) {
#if HAVE_BF16
    if (K % 32 || group % 32 || K % group || n0 % ROWS || n0 < 0 || n1 > N || n1 < n0)
        return -2;
    const int64_t t0 = n0 / ROWS, t1 = (n1 + ROWS - 1) / ROWS;
#pragma omp parallel for num_threads(num_threads < 1 ? 1 : num_threads) schedule(static)
    for (int64_t t = t0; t < t1; t++) {
        const int nr = n1 - t * ROWS < ROWS ? (int)(n1 - t * ROWS) : ROWS;
        tile_i4(w + t * ROWS * (K / 2), scales, s_bf16, offsets, t, nr, K, group,
                out + (t * ROWS - n0) * K);
    }
    return 0;
#else
    return -1;
#endif
}
