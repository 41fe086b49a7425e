/* GGUF's Q8_0, Q4_0 and Q4_1 weights times activations quantized to int8 in blocks of 32
 * columns (int_gemm.c's `int_acts_quantize`, llama.cpp's Q8_0 of x), by AVX-512 VNNI's 4-way
 * byte dot products, laid out so that a row of x costs few instructions beyond the products.
 *
 * Layout (workers/kernels/gguf_vnni.py `block_gguf` makes it from the file's blocks): tiles of 16
 * weight rows (the last padded with zero rows); per tile and block of 32 columns, the 16 rows'
 * unsigned values u as vpdpbusd operands: lane r of operand g holds row r's columns 4g..4g+3.
 *   Q8_0 (u = q + 128): 8 operands of 64 bytes;
 *   Q4_0 / Q4_1 (u the nibble): 4 runs of 64 bytes, run j's low nibbles operand j and its high
 *   ones operand j + 4 (columns 16 + 4j..).
 * and per tile and block the 16 rows' fp16 scales d, and for Q4_1 the offsets o = -m, so that
 * w = d (u - z) - o with z = 128 (Q8_0), 8 (Q4_0) or 0 (Q4_1): the file's values exactly.
 *
 * Per block and row of x: 8 vpdpbusd with x's 4 columns broadcast (512 multiply-adds, 16 rows
 * at once), z times the block's integer sum of x subtracted in int32 (exact), one conversion and
 * one fma by d times x's scale, and for Q4_1 one more by o times x's block sum. The 16 outputs
 * of a tile are one vector: no horizontal sums. A weight block is unpacked once for every row
 * of x (up to MB at a time), so extra rows cost their products, not the unpacking; `int_gemm.c`'s
 * int4 layout (4 rows, sums across lanes) took three times as long at 5 rows (3072 x 576, one
 * thread: 0.367 against 0.122 ms).
 *
 * A row's result has the same bits whatever the rows beside it and whichever thread took it.
 * Returns -1 without AVX-512 VNNI, -2 for a shape it does not take (K a multiple of 32), -3
 * when out of memory.
 *
 * Built at first use by workers/kernels/native.py: cc -O3 -march=native -ffast-math -fopenmp,
 * linked with int_gemm.c.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "chunks.h"
#include "kernels.h"
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__F16C__)
#include <immintrin.h>
#define HAVE_VNNI 1
#else
#define HAVE_VNNI 0
#endif

enum { Q8_0 = 0, Q4_0 = 1, Q4_1 = 2 }; /* gguf_gemm.c's ids */
#define TILE 16 /* weight rows per tile: one vector of outputs */
#define BLOCK 32
#define MB 8 /* rows of x per pass over a tile */
/* bytes of one tile's block of weights */
#define BLOCK_BYTES(type) ((type) == Q8_0 ? TILE * BLOCK : TILE * BLOCK / 2)

#if HAVE_VNNI
static inline __attribute__((always_inline)) void tile_vnni(
    const acts_t *a, const uint8_t *tile, const uint16_t *d16, const uint16_t *o16, float *y,
    int64_t N, int64_t K, int64_t n0, int nr, int64_t m0, const int mr, const int type) {
    const int64_t blocks = K / BLOCK, bb = BLOCK_BYTES(type);
    const int zero = type == Q8_0 ? 128 : type == Q4_0 ? 8 : 0;
    const __m512i low = _mm512_set1_epi8(15);
    __m512 acc[MB];
    for (int i = 0; i < mr; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t c = 0; c < blocks; c++) {
        const uint8_t *b = tile + c * bb;
        _mm_prefetch((const char *)(b + 4 * bb), _MM_HINT_T0);
        _mm_prefetch((const char *)(b + 4 * bb + 64), _MM_HINT_T0);
        __m512i op[8];
        if (type == Q8_0) {
            for (int g = 0; g < 8; g++) op[g] = _mm512_loadu_si512((const void *)(b + 64 * g));
        } else {
            for (int j = 0; j < 4; j++) {
                const __m512i v = _mm512_loadu_si512((const void *)(b + 64 * j));
                op[j] = _mm512_and_si512(v, low);
                op[j + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d16 + c * TILE)));
        const __m512 o = type == Q4_1
            ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(o16 + c * TILE)))
            : _mm512_setzero_ps();
        for (int i = 0; i < mr; i++) {
            const int64_t at = (m0 + i) * blocks + c;
            const int32_t *xr = (const int32_t *)(a->xq + (m0 + i) * K + c * BLOCK);
            /* two chains of 4: each product waits on fewer before it */
            __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), op[0], _mm512_set1_epi32(xr[0]));
            __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), op[1], _mm512_set1_epi32(xr[1]));
            for (int g = 2; g < 8; g += 2) {
                s0 = _mm512_dpbusd_epi32(s0, op[g], _mm512_set1_epi32(xr[g]));
                s1 = _mm512_dpbusd_epi32(s1, op[g + 1], _mm512_set1_epi32(xr[g + 1]));
            }
            __m512i s = _mm512_add_epi32(s0, s1);
            if (zero) s = _mm512_sub_epi32(s, _mm512_set1_epi32(zero * a->xsum[at]));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s),
                                     _mm512_mul_ps(d, _mm512_set1_ps(a->xs[at])), acc[i]);
            if (type == Q4_1) acc[i] = _mm512_fnmadd_ps(o, _mm512_set1_ps(a->xw[at]), acc[i]);
        }
    }
    for (int i = 0; i < mr; i++) {
        if (nr == TILE) {
            _mm512_storeu_ps(y + (m0 + i) * N + n0, acc[i]);
        } else {
            float out[TILE];
            _mm512_storeu_ps(out, acc[i]);
            for (int r = 0; r < nr; r++) y[(m0 + i) * N + n0 + r] = out[r];
        }
    }
}

static void rows_vnni(const acts_t *a, const uint8_t *w, const uint16_t *d16,
                      const uint16_t *o16, int type, float *y, int64_t M, int64_t N, int64_t K,
                      int64_t start, int64_t end) {
    const int64_t blocks = K / BLOCK;
    for (int64_t n0 = start; n0 < end; n0 += TILE) {
        const int nr = end - n0 < TILE ? (int)(end - n0) : TILE;
        const int64_t t = n0 / TILE;
        const uint8_t *tile = w + t * blocks * BLOCK_BYTES(type);
        const uint16_t *d = d16 + t * blocks * TILE, *o = o16 ? o16 + t * blocks * TILE : NULL;
        for (int64_t m0 = 0; m0 < M; m0 += MB) {
#define V(MR, T) tile_vnni(a, tile, d, o, y, N, K, n0, nr, m0, MR, T)
#define V_ROWS(T)                                  \
    switch (M - m0 < MB ? (int)(M - m0) : MB) {    \
        case 1: V(1, T); break;                    \
        case 2: V(2, T); break;                    \
        case 3: V(3, T); break;                    \
        case 4: V(4, T); break;                    \
        case 5: V(5, T); break;                    \
        case 6: V(6, T); break;                    \
        case 7: V(7, T); break;                    \
        default: V(MB, T);                         \
    }
            if (type == Q8_0) { V_ROWS(Q8_0) } else if (type == Q4_0) { V_ROWS(Q4_0) }
            else { V_ROWS(Q4_1) }
#undef V_ROWS
#undef V
        }
    }
}
#endif

/* y [M, N] (fp32) = x [M, K] (fp32) times the blocked weight of `type`, its fp16 scales and
 * (Q4_1) offsets. */
int gguf_vnni_gemm(const float *x, const uint8_t *w, const uint16_t *scales,
                   const uint16_t *offsets, int type, float *y, int64_t M, int64_t N, int64_t K,
                   int num_threads) {
#if HAVE_VNNI
    if (K % BLOCK || type < Q8_0 || type > Q4_1 || (type == Q4_1 && offsets == NULL)) return -2;
    acts_t a;
    int rc = int_acts_quantize(x, 0, M, K, &a);
    if (rc == 0) {
        if (num_threads < 1) num_threads = 1;
#pragma omp parallel num_threads(num_threads)
        FOR_EACH_CHUNK(N, TILE, num_threads,
                       rows_vnni(&a, w, scales, offsets, type, y, M, N, K, start, end));
    }
    int_acts_release(&a);
    return rc;
#else
    (void)x, (void)w, (void)scales, (void)offsets, (void)type, (void)y, (void)M, (void)N, (void)K,
        (void)num_threads;
    return -1;
#endif
}
