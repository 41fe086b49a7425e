/* GGUF's Q8_0, Q4_0 and Q4_1 weights read as the file stores them (llama.cpp's block layouts),
 * for a few fp32 rows of activations (`gguf_gemm`: a decode step's matmul) and dequantized to
 * fp32 rows (`gguf_dequant`: tiles of a weight for a prefill's matmul, rows of an embedding
 * table for a lookup).
 *
 * A row of a weight [N, K] is K / 32 blocks, each of 32 consecutive columns:
 *   Q8_0 (34 bytes): fp16 d, int8 q[32];                 w = d * q
 *   Q4_0 (18 bytes): fp16 d, 16 bytes of nibbles;        w = d * (u - 8)
 *   Q4_1 (20 bytes): fp16 d, fp16 m, 16 bytes of nibbles; w = d * u + m
 * where byte j of the nibbles holds column j (low nibble) and column j + 16 (high).
 *
 * The values are the file's bit for bit: d * q is exact in fp32 (an 11-bit mantissa times a
 * 4- or 8-bit integer), so the only rounding is Q4_1's one add of m, which `gguf_dequant` makes
 * once as gguf.quants.dequantize does (an fma rounds the same exact value once). `gguf_gemm`
 * forms the same values in registers and sums w_j x_j over the row in fp32 (activations are not
 * quantized): dequantize-then-matmul's result up to the order of the fp32 sums.
 *
 * Built at first use by workers/kernels/native.py: cc -O3 -march=native -ffast-math -fopenmp.
 * The AVX-512 path needs AVX-512F and F16C; elsewhere a portable C loop gives the same values.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "chunks.h"
#include "kernels.h"
#if defined(__AVX512F__) && defined(__F16C__)
#include <immintrin.h>
#define HAVE_AVX512 1
#else
#define HAVE_AVX512 0
#endif

enum { Q8_0 = 0, Q4_0 = 1, Q4_1 = 2 }; /* decoder_layer.c's kinds GGUF_* follow this order */
#define QK 32 /* columns per block */
#define MB 4  /* rows of x per pass over a quad of weight rows */
#define WIDE_MB 8 /* over a pair of them, when x has more than MB rows */

static const int64_t BLOCK_BYTES[3] = {34, 18, 20};

int gguf_block_bytes(int type) { return type >= 0 && type < 3 ? (int)BLOCK_BYTES[type] : -1; }

static inline float half_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if HAVE_AVX512
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    uint32_t bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal: normalise */
        exp = 113;
        while (!(man & 0x400u)) man <<= 1, exp--;
        bits = sign | (exp << 23) | ((man & 0x3FFu) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* One block's 32 values, as the file's dequantization gives them. */
static inline void block_values(const uint8_t *b, int type, float *out) {
    const float d = half_to_float(b);
    if (type == Q8_0) {
        const int8_t *q = (const int8_t *)(b + 2);
        for (int j = 0; j < QK; j++) out[j] = d * (float)q[j];
        return;
    }
    const float m = type == Q4_1 ? half_to_float(b + 2) : 0.0f;
    const uint8_t *qs = b + (type == Q4_1 ? 4 : 2);
    const int off = type == Q4_0 ? 8 : 0;
    for (int j = 0; j < QK / 2; j++) {
        const float lo = (float)((qs[j] & 0x0F) - off), hi = (float)((qs[j] >> 4) - off);
        out[j] = type == Q4_1 ? d * lo + m : d * lo;
        out[j + QK / 2] = type == Q4_1 ? d * hi + m : d * hi;
    }
}

#if HAVE_AVX512
#define CHUNK 64 /* blocks whose scales are widened to fp32 at once */
#define PREFETCH_TILES 2

/* The fp32 scales (and Q4_1's minimums) of `count` blocks from `b`, 16 blocks at a time: one
 * gather of each block's first 4 bytes (d, then m or data), widened in one instruction each
 * (one conversion per block cost as much as the block's dot products). */
static inline void block_scales(const uint8_t *b, int64_t bb, int type, int64_t count,
                                float *d, float *m) {
    const __m512i offsets = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
        _mm512_set1_epi32((int)bb));
    for (int64_t c = 0; c < count; c += 16) {
        const __mmask16 live = count - c >= 16 ? 0xFFFF : (__mmask16)((1u << (count - c)) - 1);
        const __m512i g = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, offsets,
                                                      (const void *)(b + c * bb), 1);
        _mm512_storeu_ps(d + c, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g)));
        if (type == Q4_1)
            _mm512_storeu_ps(m + c,
                             _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(g, 16))));
    }
}

/* The 4 sums of 4 vectors, as one. */
static inline __m128 sums4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
#define HALVES(v) _mm_add_ps(_mm256_castps256_ps128(_mm256_add_ps(                             \
        _mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1))),                            \
        _mm256_extractf128_ps(_mm256_add_ps(_mm512_castps512_ps256(v),                        \
                                            _mm512_extractf32x8_ps(v, 1)), 1))
    return _mm_hadd_ps(_mm_hadd_ps(HALVES(a0), HALVES(a1)), _mm_hadd_ps(HALVES(a2), HALVES(a3)));
#undef HALVES
}

/* `nr` weight rows from row n (row_bytes apart) against `mr` rows of x from row m0 (inlined
 * with type, nr and mr constants, so the accumulators stay in registers and nothing is tested
 * per block; rows side by side, so each row's chain of fmas waits on the others' less, and the
 * per-row work around the loop is shared). A 4-bit block's 16 possible values d * u (+ m) are
 * one vector, and `vpermps` picks each column's from its nibble (it reads an index's low 4 bits
 * only, so the byte widened to 32 bits serves the low nibble as it is and the high one
 * shifted): each product is w_j x_j with the file's w_j, and no integer becomes a float. */
static inline __attribute__((always_inline)) void tile_dot(
    const float *x, const uint8_t *w, const int type, float *y, int64_t N, int64_t K,
    int64_t n, const int nr, int64_t m0, const int mr) {
    const int64_t blocks = K / QK, bb = BLOCK_BYTES[type], row_bytes = blocks * bb;
    const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512 iota8 = _mm512_sub_ps(iota, _mm512_set1_ps(8.0f));
    __m512 acc[WIDE_MB][4];
    /* widened 16 at a time: whole vectors, within CHUNK */
    float d[4][CHUNK], m[4][CHUNK];
    for (int i = 0; i < mr; i++)
        for (int r = 0; r < nr; r++) acc[i][r] = _mm512_setzero_ps();
    for (int64_t c0 = 0; c0 < blocks; c0 += CHUNK) {
        const int64_t count = blocks - c0 < CHUNK ? blocks - c0 : CHUNK;
        for (int r = 0; r < nr; r++)
            block_scales(w + r * row_bytes + c0 * bb, bb, type, count, d[r], m[r]);
        for (int64_t c = c0; c < c0 + count; c++) {
            for (int r = 0; r < nr; r++) {
                const uint8_t *b = w + r * row_bytes + c * bb;
                /* the tile's rows are one run of bytes, read at this pace: fetch as far
                 * into the run PREFETCH_TILES tiles ahead */
                _mm_prefetch((const char *)(w + PREFETCH_TILES * nr * row_bytes
                                            + (c * nr + r) * bb), _MM_HINT_T0);
                __m512 f0, f1;
                const __m512 ds = _mm512_set1_ps(d[r][c - c0]);
                if (type == Q8_0) {
                    f0 = _mm512_mul_ps(ds, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                               _mm_loadu_si128((const __m128i *)(b + 2)))));
                    f1 = _mm512_mul_ps(ds, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                               _mm_loadu_si128((const __m128i *)(b + 18)))));
                } else {
                    const __m512 table =
                        type == Q4_1 ? _mm512_fmadd_ps(ds, iota, _mm512_set1_ps(m[r][c - c0]))
                                     : _mm512_mul_ps(ds, iota8);
                    const __m512i u = _mm512_cvtepu8_epi32(
                        _mm_loadu_si128((const __m128i *)(b + (type == Q4_1 ? 4 : 2))));
                    f0 = _mm512_permutexvar_ps(u, table);
                    f1 = _mm512_permutexvar_ps(_mm512_srli_epi32(u, 4), table);
                }
                for (int i = 0; i < mr; i++) {
                    const float *xr = x + (m0 + i) * K + c * QK;
                    acc[i][r] = _mm512_fmadd_ps(f0, _mm512_loadu_ps(xr), acc[i][r]);
                    acc[i][r] = _mm512_fmadd_ps(f1, _mm512_loadu_ps(xr + 16), acc[i][r]);
                }
            }
        }
    }
    for (int i = 0; i < mr; i++) {
        if (nr == 4) {
            _mm_storeu_ps(y + (m0 + i) * N + n, sums4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]));
        } else if (nr == 2) { /* a quad's lanes 0 and 1: the same sums as a quad's, bit for bit */
            float s[4];
            _mm_storeu_ps(s, sums4(acc[i][0], acc[i][1], acc[i][0], acc[i][1]));
            y[(m0 + i) * N + n] = s[0];
            y[(m0 + i) * N + n + 1] = s[1];
        } else {
            for (int r = 0; r < nr; r++) y[(m0 + i) * N + n + r] = _mm512_reduce_add_ps(acc[i][r]);
        }
    }
}

/* Rows [start, end) of y: the weight's rows 4 at a time (then one by one) against every row of
 * x, MB at a time; with more than MB rows of x (a speculative verification's k + 1, a short
 * prefill), each quad as two pairs against up to WIDE_MB rows at a time, so each block is
 * widened once for all of them (dequantizing, not reading, bounds this kernel at a few rows).
 * A row of y is the same bits whatever M: each sum runs over the blocks in order, and a
 * pair's is reduced as its quad's (`tile_dot`). */
static void rows_dot(const float *x, const uint8_t *w, int type, float *y, int64_t M, int64_t N,
                     int64_t K, int64_t start, int64_t end) {
    const int64_t row_bytes = K / QK * BLOCK_BYTES[type];
    const int wide = M > MB;
    const int mb = wide ? WIDE_MB : MB;
    for (int64_t n = start; n < end;) {
        const int quad = end - n >= 4;
        const int nr = !quad ? 1 : wide ? 2 : 4;
        const int64_t step = quad ? 4 : 1;
        for (int64_t n1 = n; n1 < n + step; n1 += nr) {
            const uint8_t *wr = w + n1 * row_bytes;
            for (int64_t m0 = 0; m0 < M; m0 += mb) {
                const int mr = M - m0 < mb ? (int)(M - m0) : mb;
#define DOT(T, NR, MR) tile_dot(x, wr, T, y, N, K, n1, NR, m0, MR)
/* 1-7 input rows, or a wide pass (up to WIDE_MB), against NR weight rows */
#define DOT_WIDE(T, NR)                                                                       \
    switch (mr) {                                                                             \
        case 1: DOT(T, NR, 1); break;                                                         \
        case 2: DOT(T, NR, 2); break;                                                         \
        case 3: DOT(T, NR, 3); break;                                                         \
        case 4: DOT(T, NR, 4); break;                                                         \
        case 5: DOT(T, NR, 5); break;                                                         \
        case 6: DOT(T, NR, 6); break;                                                         \
        case 7: DOT(T, NR, 7); break;                                                         \
        default: DOT(T, NR, WIDE_MB);                                                         \
    }
#define DOT_ROWS(T)                                                                           \
    if (nr == 4) {                                                                            \
        switch (mr) {                                                                         \
            case 1: DOT(T, 4, 1); break;                                                      \
            case 2: DOT(T, 4, 2); break;                                                      \
            case 3: DOT(T, 4, 3); break;                                                      \
            default: DOT(T, 4, MB);                                                           \
        }                                                                                     \
    } else if (nr == 2) {                                                                     \
        DOT_WIDE(T, 2)                                                                        \
    } else {                                                                                  \
        DOT_WIDE(T, 1)                                                                        \
    }
                if (type == Q8_0) { DOT_ROWS(Q8_0) } else if (type == Q4_0) { DOT_ROWS(Q4_0) }
                else { DOT_ROWS(Q4_1) }
#undef DOT_ROWS
#undef DOT_WIDE
#undef DOT
            }
        }
        n += step;
    }
}
#else
/* Rows [start, end) of y, one dot product at a time over the blocks' values. */
static void rows_dot(const float *x, const uint8_t *w, int type, float *y, int64_t M, int64_t N,
                     int64_t K, int64_t start, int64_t end) {
    const int64_t blocks = K / QK, bb = BLOCK_BYTES[type];
    for (int64_t n = start; n < end; n++)
        for (int64_t i = 0; i < M; i++) {
            float acc = 0.0f;
            for (int64_t c = 0; c < blocks; c++) {
                float v[QK];
                block_values(w + (n * blocks + c) * bb, type, v);
                for (int j = 0; j < QK; j++) acc += v[j] * x[i * K + c * QK + j];
            }
            y[i * N + n] = acc;
        }
}
#endif

/* y [M, N] = x [M, K] (fp32) times the weight w [N, K] (rows of `type`'s blocks), fp32.
 * Returns -2 for a type or K (a multiple of 32) it does not take. */
int gguf_gemm(const float *x, const uint8_t *w, int type, float *y, int64_t M, int64_t N,
              int64_t K, int num_threads) {
    if (type < 0 || type > 2 || K % QK) return -2;
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel num_threads(num_threads)
    FOR_EACH_CHUNK(N, 4, num_threads, rows_dot(x, w, type, y, M, N, K, start, end));
    return 0;
}

/* out [count, K] fp32 = rows of the weight w [*, K]: rows[i] when `rows` is given (an
 * embedding lookup; the caller checks the ids), else start + i (a tile of a weight).
 * Returns -2 for a type or K it does not take. */
int gguf_dequant(const uint8_t *w, int type, int64_t K, const int64_t *rows, int64_t start,
                 int64_t count, float *out, int num_threads) {
    if (type < 0 || type > 2 || K % QK) return -2;
    const int64_t blocks = K / QK, bb = BLOCK_BYTES[type], row_bytes = blocks * bb;
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t i = 0; i < count; i++) {
        const uint8_t *wr = w + (rows ? rows[i] : start + i) * row_bytes;
        for (int64_t c = 0; c < blocks; c++) block_values(wr + c * bb, type, out + i * K + c * QK);
    }
    return 0;
}
