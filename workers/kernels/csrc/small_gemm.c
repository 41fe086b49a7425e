/* Small-batch matmul for the CPU: y[m, n] = sum_k x[m, k] * w[n, k] for a few rows m (a decode
 * step's tokens), weights fp32 or bf16, activations and output fp32.
 *
 * A decode step of a small model reads every weight once per token: the step is bound by memory
 * bandwidth. torch's fp32 `linear` with one row goes to MKL's sgemv, which runs on one thread
 * (2.4 ms for a 5632 x 2048 weight on this 2-core machine with 1 or 2 threads: 19 GB/s, where
 * a streaming read reaches 35). Here `num_threads` OpenMP threads (torch's own pool: the library
 * links the same libgomp) take chunks of output rows as they ask (chunks.h); a tile of 4 weight
 * rows is read once and multiplied by up to 4 input rows held in 16 accumulators of 16 floats
 * (AVX-512 through GCC's vector extensions; pairs of AVX registers elsewhere), so each weight
 * byte crosses the memory bus once per 4 tokens. More than 4 input rows run in blocks of 4.
 *
 * bf16 weights are widened to fp32 in registers (a bf16 is the top half of an fp32). With one row
 * of x, 8 weight rows go at a time (more reads in flight). int8 and int4 weights go through
 * torch's own kernels (workers/quant/linear.py): versions of this loop widening bytes were no
 * faster than them (int8: 16-21 GB/s both, on weights out of cache).
 *
 * bf16 activations against bf16 weights (a bf16 model's layers and output projection) go through
 * AVX512-BF16's pairwise dot products where the CPU has them (`small_gemm_bf16_dot`): 32 weights
 * per instruction, no widening, so the loop keeps up with memory. The products of two bf16 are
 * exact in fp32; the sums are fp32, pairs first (the widening loop's order differs in rounding
 * only); denormal inputs count as zero (the instruction's rule).
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

typedef float vf __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));
#define VL 16
#define ROWS 4 /* weight rows per tile */
#define MB 4   /* input rows per pass */

static inline vf load_f32(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline vf load_bf16(const uint16_t *p) {
    vh h;
    memcpy(&h, p, sizeof h);
    vu u = __builtin_convertvector(h, vu) << 16;
    vf v;
    memcpy(&v, &u, sizeof v);
    return v;
}

static inline float hsum(vf v) {
    float s = 0.0f;
    for (int i = 0; i < VL; i++) s += v[i];
    return s;
}

static inline float widen(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* One tile: rows [n0, n0 + nr) of w against input rows [m0, m0 + mr). Inlined into calls with
 * constant counts (`DEFINE_ROWS`), so the accumulators live in registers: with the counts left
 * variable GCC kept them in memory. */
#define DEFINE_TILE(NAME, WTYPE, LOAD, SCALAR)                                                \
    static inline __attribute__((always_inline)) void NAME(                                   \
        const float *x, const WTYPE *w, float *y, int64_t N, int64_t K, int64_t m0,           \
        int64_t n0, const int mr, const int nr) {                                             \
        vf acc[MB][2 * ROWS];                                                                 \
        for (int i = 0; i < mr; i++)                                                          \
            for (int j = 0; j < nr; j++) acc[i][j] = (vf){0};                                 \
        int64_t k = 0;                                                                        \
        for (; k + VL <= K; k += VL) {                                                        \
            vf wv[2 * ROWS];                                                                  \
            for (int j = 0; j < nr; j++) wv[j] = LOAD(w + (n0 + j) * K + k);                  \
            for (int i = 0; i < mr; i++) {                                                    \
                vf xv = load_f32(x + (m0 + i) * K + k);                                       \
                for (int j = 0; j < nr; j++) acc[i][j] += xv * wv[j];                         \
            }                                                                                 \
        }                                                                                     \
        for (int i = 0; i < mr; i++)                                                          \
            for (int j = 0; j < nr; j++) {                                                    \
                float s = hsum(acc[i][j]);                                                    \
                for (int64_t t = k; t < K; t++)                                               \
                    s += x[(m0 + i) * K + t] * SCALAR(w[(n0 + j) * K + t]);                   \
                y[(m0 + i) * N + n0 + j] = s;                                                 \
            }                                                                                 \
    }

#define IDENTITY(v) (v)
DEFINE_TILE(tile_f32, float, load_f32, IDENTITY)
DEFINE_TILE(tile_bf16, uint16_t, load_bf16, widen)

/* Every tile of output rows [start, end), each read once for all M input rows: a tile (4 rows of
 * K weights, 8-90 KB) stays in the core's caches while every block of 4 input rows passes over
 * it. (Blocks of input rows outside, tiles inside, read the weights from memory once per 4 input
 * rows: at 8 rows the `small` preset's fp32 decode step took 4.3x its one-row time.) Constant
 * counts for full tiles; one input row takes 8 weight rows at a time. Each output's sum runs over
 * k in the same order whatever the tile, so results do not depend on the split. */
#define DEFINE_ROWS(NAME, TILE, XTYPE, WTYPE)                                                 \
    static void NAME(const XTYPE *x, const WTYPE *w, float *y, int64_t M, int64_t N,          \
                     int64_t K, int64_t start, int64_t end) {                                 \
        for (int64_t n0 = start; n0 < end;) {                                                 \
            if (M == 1 && end - n0 >= 2 * ROWS) {                                             \
                TILE(x, w, y, N, K, 0, n0, 1, 2 * ROWS);                                      \
                n0 += 2 * ROWS;                                                               \
                continue;                                                                     \
            }                                                                                 \
            const int nr = end - n0 < ROWS ? (int)(end - n0) : ROWS;                          \
            for (int64_t m0 = 0; m0 < M; m0 += MB) {                                          \
                const int mr = M - m0 < MB ? (int)(M - m0) : MB;                              \
                if (nr < ROWS) TILE(x, w, y, N, K, m0, n0, mr, nr);                           \
                else if (mr == 4) TILE(x, w, y, N, K, m0, n0, 4, ROWS);                       \
                else if (mr == 3) TILE(x, w, y, N, K, m0, n0, 3, ROWS);                       \
                else if (mr == 2) TILE(x, w, y, N, K, m0, n0, 2, ROWS);                       \
                else TILE(x, w, y, N, K, m0, n0, 1, ROWS);                                    \
            }                                                                                 \
            n0 += nr;                                                                         \
        }                                                                                     \
    }

DEFINE_ROWS(rows_f32, tile_f32, float, float)
DEFINE_ROWS(rows_bf16, tile_bf16, float, uint16_t)

/* `ROWS_FN(x, w, y, M, N, K, start, end)` on `num_threads` threads, over chunks of rows
 * (chunks.h). */
#define OVER_THREADS(ROWS_FN)                                                                 \
    do {                                                                                      \
        if (num_threads < 1) num_threads = 1;                                                 \
        _Pragma("omp parallel num_threads(num_threads)")                                      \
        FOR_EACH_CHUNK(N, ROWS, num_threads, ROWS_FN(x, w, y, M, N, K, start, end));          \
    } while (0)

int small_gemm_f32(const float *x, const float *w, float *y, int64_t M, int64_t N, int64_t K,
                   int num_threads) {
    OVER_THREADS(rows_f32);
    return 0;
}

int small_gemm_bf16(const float *x, const uint16_t *w, float *y, int64_t M, int64_t N,
                    int64_t K, int num_threads) {
    OVER_THREADS(rows_bf16);
    return 0;
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_BF16_DOT 1

/* Rows [n0, n0 + NR) of w against rows [m0, m0 + MR) of x, all bf16, K a multiple of 32 for
 * the vector loop (the rest widened one by one). */
static inline __attribute__((always_inline)) void tile_dot(
    const uint16_t *x, const uint16_t *w, float *y, int64_t N, int64_t K, int64_t m0,
    int64_t n0, const int mr, const int nr) {
    __m512 acc[MB][2 * ROWS];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) acc[i][j] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512bh wv[2 * ROWS];
        for (int j = 0; j < nr; j++) {
            /* rows of 1-8 KB read side by side: the hardware prefetcher alone lags */
            _mm_prefetch((const char *)(w + (n0 + j) * K + k) + 1024, _MM_HINT_T0);
            wv[j] = (__m512bh)_mm512_loadu_si512((const void *)(w + (n0 + j) * K + k));
        }
        for (int i = 0; i < mr; i++) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + (m0 + i) * K + k));
            for (int j = 0; j < nr; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) {
            float s = _mm512_reduce_add_ps(acc[i][j]);
            for (int64_t t = k; t < K; t++)
                s += widen(x[(m0 + i) * K + t]) * widen(w[(n0 + j) * K + t]);
            y[(m0 + i) * N + n0 + j] = s;
        }
}

DEFINE_ROWS(rows_dot, tile_dot, uint16_t, uint16_t)
#else
#define HAVE_BF16_DOT 0
#endif

int small_gemm_has_bf16_dot(void) { return HAVE_BF16_DOT; }

/* bf16 x times bf16 w; -1 where the CPU (or compiler) has no AVX512-BF16. */
int small_gemm_bf16_dot(const uint16_t *x, const uint16_t *w, float *y, int64_t M, int64_t N,
                        int64_t K, int num_threads) {
#if HAVE_BF16_DOT
    OVER_THREADS(rows_dot);
    return 0;
#else
    (void)x, (void)w, (void)y, (void)M, (void)N, (void)K, (void)num_threads;
    return -1;
#endif
}

/* LoRA (workers/models/lora/projection.py), for a projection's output y [M, N] from x [M, K]:
 * for each segment (slot, first, end) of `l->rows` (the step's adapter rows grouped by slot),
 * y[r] += (x[r] A[slot]^T) B[slot]^T for r in rows[first:end], in the base matmul's parallel
 * region (no region or barrier more: on this shared 2-core machine each could wait out a time
 * slice of a preempted thread). First `lora_shrink`: units of (segment, 32 of its rows, 4 stack
 * rows) taken as threads ask, each row of x read where it lies, into scratch [num_rows, width];
 * then the base matmul's chunks of output columns, each followed by `lora_expand` of the same
 * columns (once every unit of the shrink is done: `lora_wait`): each row's few shrunk values
 * times rows of B transposed, as vectors along the output, only over the block of its sub (q,
 * k, v; gate, up). The rows of y come out the same whatever the other rows of the step.
 *
 * Against the previous form (the shrink on the calling thread before the region, the expand
 * as dot products of length `width` with a horizontal sum per output, B's zero blocks read),
 * the `small` preset, 32 streams under 8 rank-16 adapters, the offline engine's CPU time of
 * the same requests alternated with an engine without LoRA (6 rounds each): 0.79x -> 0.90x
 * and 0.91x its tokens per CPU-second. */
static inline __attribute__((always_inline)) void shrink_tile(
    const float *x, const int64_t *rows, const float *a, float *sh, int64_t K, int64_t W,
    const int mr, const int nr) {
    vf acc[MB][ROWS];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) acc[i][j] = (vf){0};
    int64_t k = 0;
    for (; k + VL <= K; k += VL) {
        vf av[ROWS];
        for (int j = 0; j < nr; j++) av[j] = load_f32(a + j * K + k);
        for (int i = 0; i < mr; i++) {
            const vf xv = load_f32(x + rows[i] * K + k);
            for (int j = 0; j < nr; j++) acc[i][j] += xv * av[j];
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) {
            float s = hsum(acc[i][j]);
            for (int64_t t = k; t < K; t++) s += x[rows[i] * K + t] * a[j * K + t];
            sh[i * W + j] = s;
        }
}

#define SHRINK_ROWS 32 /* rows of a segment per unit of the shrink (a prefill's segments are long) */

/* Units of `lora_shrink`'s work for `l`: (segment, SHRINK_ROWS of its rows, ROWS stack rows),
 * as many row blocks for each segment as the longest needs. */
static int64_t shrink_blocks(const lora_args_t *l) {
    int64_t longest = 0;
    for (int64_t s = 0; s < l->num_segments; s++) {
        const int64_t n = l->segments[3 * s + 2] - l->segments[3 * s + 1];
        longest = n > longest ? n : longest;
    }
    return (longest + SHRINK_ROWS - 1) / SHRINK_ROWS;
}

static int64_t shrink_units(const lora_args_t *l) {
    return l->num_segments * shrink_blocks(l) * ((l->width + ROWS - 1) / ROWS);
}

/* This thread's share of the shrink's units, taken as it asks (no barrier); each unit done
 * counted in `*done`. */
static void lora_shrink(const float *x, int64_t K, const lora_args_t *l, int64_t *done) {
    const int64_t W = l->width, tiles = (W + ROWS - 1) / ROWS, blocks = shrink_blocks(l);
#pragma omp for schedule(dynamic) nowait
    for (int64_t u = 0; u < l->num_segments * blocks * tiles; u++) {
        const int64_t *seg = l->segments + 3 * (u / (blocks * tiles));
        const int64_t first = seg[1] + u / tiles % blocks * SHRINK_ROWS, w0 = u % tiles * ROWS;
        const int64_t last = first + SHRINK_ROWS < seg[2] ? first + SHRINK_ROWS : seg[2];
        const float *a = l->a + (seg[0] * W + w0) * K;
        const int nr = W - w0 < ROWS ? (int)(W - w0) : ROWS;
        for (int64_t i0 = first; i0 < last; i0 += MB) {
            const int mr = last - i0 < MB ? (int)(last - i0) : MB;
            float *sh = l->scratch + i0 * W + w0;
            if (mr == MB && nr == ROWS) shrink_tile(x, l->rows + i0, a, sh, K, W, MB, ROWS);
            else shrink_tile(x, l->rows + i0, a, sh, K, W, mr, nr);
        }
        __atomic_fetch_add(done, 1, __ATOMIC_RELEASE);
    }
}

/* Until every unit of the shrink is done (by whichever thread took it): by then the base
 * matmul's first chunk has usually taken longer than the whole shrink. */
static void lora_wait(const int64_t *done, int64_t units) {
    while (__atomic_load_n(done, __ATOMIC_ACQUIRE) < units) {
#if defined(__x86_64__)
        __builtin_ia32_pause();
#endif
    }
}

#define EXPAND_VECS 4 /* vectors of output columns at once: chains of fmas side by side */

/* `nr` rows' (1 or 2, sharing each vector of B read) columns [c, c + nv * VL) of y plus their
 * shrunk values `sh` times R rows of B transposed (`bt`, rows N apart). */
static inline __attribute__((always_inline)) void expand_vecs(
    float *const *yr, const float *const *sh, const int nr, const float *bt, int64_t N,
    int64_t R, int64_t c, const int nv) {
    vf acc[2][EXPAND_VECS];
    for (int i = 0; i < nr; i++)
        for (int v = 0; v < nv; v++) acc[i][v] = load_f32(yr[i] + c + v * VL);
    for (int64_t r = 0; r < R; r++) {
        vf b[EXPAND_VECS];
        for (int v = 0; v < nv; v++) b[v] = load_f32(bt + r * N + c + v * VL);
        for (int i = 0; i < nr; i++) {
            const float f = sh[i][r];
            for (int v = 0; v < nv; v++) acc[i][v] += f * b[v];
        }
    }
    for (int i = 0; i < nr; i++) memcpy(yr[i] + c, acc[i], sizeof(vf) * (size_t)nv);
}

/* The next segment's block of B for these columns, on its way into the cache while this one's
 * rows are computed (8 adapters' blocks are read from memory each step: they do not stay in
 * the cache beside the base weights). */
static inline void prefetch_rows(const float *bt, int64_t N, int64_t R, int64_t lo, int64_t hi) {
    for (int64_t r = 0; r < R; r++)
        for (int64_t c = lo; c < hi; c += 16) __builtin_prefetch(bt + r * N + c, 0, 3);
}

static void lora_expand(float *y, int64_t N, const lora_args_t *l, int64_t start,
                        int64_t end) {
    const int64_t W = l->width, R = W / l->num_subs;
    for (int64_t j = 0; j < l->num_subs; j++) {
        const int64_t c0 = j == 0 ? 0 : l->column_ends[j - 1], c1 = l->column_ends[j];
        const int64_t lo = start > c0 ? start : c0, hi = end < c1 ? end : c1;
        for (int64_t s = 0; s < l->num_segments && lo < hi; s++) {
            const int64_t *seg = l->segments + 3 * s;
            const float *bt = l->bt + (seg[0] * W + j * R) * N;
            if (s + 1 < l->num_segments)
                prefetch_rows(l->bt + (seg[3] * W + j * R) * N, N, R, lo, hi);
            for (int64_t i = seg[1]; i < seg[2]; i += 2) {
                const int nr = seg[2] - i >= 2 ? 2 : 1;
                float *yr[2] = {y + l->rows[i] * N, y + l->rows[i + nr - 1] * N};
                const float *sh[2] = {l->scratch + i * W + j * R,
                                      l->scratch + (i + nr - 1) * W + j * R};
                int64_t c = lo;
                for (; c + EXPAND_VECS * VL <= hi; c += EXPAND_VECS * VL) {
                    if (nr == 2) expand_vecs(yr, sh, 2, bt, N, R, c, EXPAND_VECS);
                    else expand_vecs(yr, sh, 1, bt, N, R, c, EXPAND_VECS);
                }
                for (; c + VL <= hi; c += VL) {
                    if (nr == 2) expand_vecs(yr, sh, 2, bt, N, R, c, 1);
                    else expand_vecs(yr, sh, 1, bt, N, R, c, 1);
                }
                for (int k = 0; k < nr; k++)
                    for (int64_t t = c; t < hi; t++) {
                        float acc = yr[k][t];
                        for (int64_t r = 0; r < R; r++) acc += sh[k][r] * bt[r * N + t];
                        yr[k][t] = acc;
                    }
            }
        }
    }
}

/* Inside a parallel region of `nt` threads: y = x w^T plus `l`'s products (l NULL: none), the
 * shrink's units counted in `*done` (zero before the region). */
static void rows_lora(const float *x, const float *w, float *y, int64_t M, int64_t N, int64_t K,
                      const lora_args_t *l, int64_t *done, int nt) {
    const int64_t units = l != NULL ? shrink_units(l) : 0;
    if (l != NULL) lora_shrink(x, K, l, done);
    FOR_EACH_CHUNK(N, ROWS, nt, {
        rows_f32(x, w, y, M, N, K, start, end);
        if (l != NULL) {
            lora_wait(done, units);
            lora_expand(y, N, l, start, end);
        }
    });
}

/* small_gemm_f32 with `l`'s products added (l NULL: none). */
int small_gemm_lora_f32(const float *x, const float *w, float *y, int64_t M, int64_t N,
                        int64_t K, const lora_args_t *l, int num_threads) {
    int64_t done = 0;
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel num_threads(num_threads)
    rows_lora(x, w, y, M, N, K, l, &done, num_threads);
    return 0;
}

/* `l`'s products added to y, after a base matmul of another kind (int8, int4, GGUF). */
int lora_add_f32(const float *x, float *y, int64_t N, int64_t K, const lora_args_t *l,
                 int num_threads) {
    int64_t done = 0;
    const int64_t units = shrink_units(l);
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel num_threads(num_threads)
    {
        lora_shrink(x, K, l, &done);
        lora_wait(&done, units);
        FOR_EACH_CHUNK(N, ROWS, num_threads, lora_expand(y, N, l, start, end));
    }
    return 0;
}

/* A gated MLP's few rows in one parallel region (`small_mlp_f32`): y = down(act(x gate^T) *
 * (x up^T)), w_gate_up [2I, H] (the gate's I rows, then the up's), w_down [H, I], all fp32;
 * act: SiLU, or GELU's tanh form (`gelu`). The threads take chunks of gate/up rows, then
 * (after a barrier) each its share of the activation, then (after another) chunks of output
 * rows: no return to Python between the two matmuls. Returns -1 when scratch could not be
 * allocated. */
static inline float act_f32(float g, int gelu) {
    if (gelu) return 0.5f * g * (1.0f + tanhf(0.7978845608f * (g + 0.044715f * g * g * g)));
    return g / (1.0f + expf(-g));
}

/* Thread t of nt's share of a = act(gate) * up over gu [M, 2I] (gate, then up, per row). */
static inline void act_run(const float *gu, float *a, int64_t M, int64_t I, int gelu, int t,
                           int nt) {
    /* runs of 64 elements: where the vectorised loop and its scalar tail fall (they round
     * the exponential differently) then does not depend on the thread count */
    const int64_t runs = (I + 63) / 64;
    int64_t i0 = runs * t / nt * 64, i1 = runs * (t + 1) / nt * 64;
    if (i0 > I) i0 = I;
    if (i1 > I) i1 = I;
    for (int64_t m = 0; m < M; m++)
        for (int64_t i = i0; i < i1; i++)
            a[m * I + i] = act_f32(gu[m * 2 * I + i], gelu) * gu[m * 2 * I + I + i];
}

int small_mlp_f32(const float *x, const float *w_gate_up, const float *w_down, float *y,
                  int64_t M, int64_t H, int64_t I, int gelu, int num_threads) {
    return small_mlp_lora_f32(x, w_gate_up, w_down, y, M, H, I, gelu, NULL, NULL, num_threads);
}

/* small_mlp_f32 with LoRA products added to gate/up (`gu_lora`) and down (`down_lora`; NULL:
 * none), each shrunk before its base matmul's chunks and expanded after each of them. */
int small_mlp_lora_f32(const float *x, const float *w_gate_up, const float *w_down, float *y,
                       int64_t M, int64_t H, int64_t I, int gelu, const lora_args_t *gu_lora,
                       const lora_args_t *down_lora, int num_threads) {
    float *gu = malloc(sizeof(float) * (size_t)(M * 3 * I)); /* [M, 2I] then act [M, I] */
    if (gu == NULL) return -1;
    float *a = gu + M * 2 * I;
    int64_t gu_done = 0, down_done = 0;
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel num_threads(num_threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        rows_lora(x, w_gate_up, gu, M, 2 * I, H, gu_lora, &gu_done, nt);
#pragma omp barrier
        act_run(gu, a, M, I, gelu, t, nt);
#pragma omp barrier
        rows_lora(a, w_down, y, M, H, I, down_lora, &down_done, nt);
    }
    free(gu);
    return 0;
}

/* out [M, I] = act(gate) * up of gate_up [M, 2I] (each row: the gate's I values, then the
 * up's), as `small_mlp_f32` computes it: the quantized MLP's middle, fused or not
 * (workers/kernels/small_gemm.py `act_and_mul`, csrc/decoder_layer.c), so both round alike. */
int act_mul_f32(const float *gate_up, float *out, int64_t M, int64_t I, int gelu,
                int num_threads) {
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel num_threads(num_threads)
    act_run(gate_up, out, M, I, gelu, omp_get_thread_num(), omp_get_num_threads());
    return 0;
}
