/* The arithmetic of paged_decode.c: one query head of one row over one block of its context
 * (`head_scores`, then `head_weigh`: an online-softmax step and the V rows weighted into its
 * accumulator), the same code whichever rows and heads share the work item, so a row's result
 * is the same alone or in a verification's group, on any thread count. */
#ifndef CLEAVE_PAGED_BLOCK_H
#define CLEAVE_PAGED_BLOCK_H
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* Eight floats; GCC/Clang vector extensions compile to AVX (x86-64) or NEON pairs (AArch64). */
typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));
#define VL 8

static inline vf load_vf(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store_vf(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* `n` cached bf16 values from `src` widened to fp32 at `dst` (exactly: the high half of each) */
static void widen_bf16(const uint16_t *src, float *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const uint32_t u = (uint32_t)src[i] << 16;
        memcpy(dst + i, &u, sizeof u);
    }
}

/* Lanes of two vectors picked by index (0-7: a's, 8-15: b's), in either compiler's spelling. */
#if defined(__clang__)
#define PICK(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define PICK(a, b, ...) __builtin_shuffle(a, b, (vi){__VA_ARGS__})
#endif

/* Lane j: the sum of a[j]'s lanes, ((0+1)+(2+3))+((4+5)+(6+7)) in every lane and for every j,
 * whatever the other vectors hold: eight dot products' horizontal sums in seven adds. */
static inline vf sum8(const vf a[8]) {
    vf s[4], u[2];
    for (int p = 0; p < 4; p++)
        s[p] = PICK(a[2 * p], a[2 * p + 1], 0, 8, 2, 10, 4, 12, 6, 14)
               + PICK(a[2 * p], a[2 * p + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    for (int p = 0; p < 2; p++)
        u[p] = PICK(s[2 * p], s[2 * p + 1], 0, 1, 8, 9, 4, 5, 12, 13)
               + PICK(s[2 * p], s[2 * p + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return PICK(u[0], u[1], 0, 1, 2, 3, 8, 9, 10, 11)
           + PICK(u[0], u[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

/* Scores of a (pre-scaled) query `qv` against a block's tokens [t0, n): K row t at k + t * ks,
 * into s[t]; returns their maximum. Eight tokens at a time, each a chain of FMAs over the
 * head's dims, summed by sum8; a token outside [t0, n) reads `zero`, so every score is the same
 * whichever tokens share its eight (s needs room up to the next multiple of 8 past n). The
 * maximum in vectors too (as a scalar loop it was an eighth of the kernel's time): a maximum
 * is exact in any order. */
static inline __attribute__((always_inline)) float scores(const vf *qv, const float *k,
                                                          int64_t ks, const float *zero, int t0,
                                                          int n, float *s, const int dv) {
    const vi lane = {0, 1, 2, 3, 4, 5, 6, 7};
    vf top = (vf){0} - FLT_MAX; /* no score is below it (and no infinities: -ffast-math) */
    for (int c = t0 & ~(VL - 1); c < n; c += VL) {
        const float *kp[VL];
        for (int j = 0; j < VL; j++) kp[j] = c + j >= t0 && c + j < n ? k + (c + j) * ks : zero;
        vf a[VL];
        for (int j = 0; j < VL; j++) a[j] = qv[0] * load_vf(kp[j]);
        for (int i = 1; i < dv; i++)
            for (int j = 0; j < VL; j++) a[j] += qv[i] * load_vf(kp[j] + i * VL);
        const vf sc = sum8(a);
        store_vf(s + c, sc);
        const vi in = (lane + c >= t0) & (lane + c < n), more = in & (sc > top);
        top = (vf)(((vi)sc & more) | ((vi)top & ~more));
    }
    float m = top[0];
    for (int i = 1; i < VL; i++) m = top[i] > m ? top[i] : m;
    return m;
}

/* One online-softmax step of a query head over a block's scores s[t0, n), their maximum
 * `block_max`: exponentiated in place; returns the rescale of what was accumulated under the old
 * running max `*m`. `first`: the head's first block, without a sink (the max starts at the
 * block's). */
static inline float softmax_block(float *restrict s, int t0, int n, float block_max, float *m,
                                  float *l, int first) {
    float c = 1.0f, mx = *m;
    if (first) {
        mx = block_max; /* no infinities anywhere, so -ffast-math is safe */
    } else if (block_max > mx) {
        c = expf(mx - block_max);
        mx = block_max;
    }
    float sum = 0.0f;
    for (int t = t0; t < n; t++) { /* vectorized, expf from libmvec */
        s[t] = expf(s[t] - mx);
        sum += s[t];
    }
    *m = mx;
    *l = *l * c + sum;
    return c;
}

/* The next block's K and V rows of one KV head for token t (`kn`, `vn`: that head's first
 * row), into every cache level. (As non-temporal prefetches, which skip L2, the next block's
 * rows were often evicted from L1 before their turn and read from memory again; issued all at
 * once before the block, the prefetches stalled the core, their loop half of the kernel's time
 * at one sequence.) */
static inline void prefetch_row(const char *kn, const char *vn, int64_t t, int64_t row_bytes,
                                int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) {
        __builtin_prefetch(kn + t * row_bytes + i, 0, 3);
        __builtin_prefetch(vn + t * row_bytes + i, 0, 3);
    }
}

/* A query head's scores over a block's tokens [t0, n) into s (`scores`), from its scaled query
 * at qs; returns their maximum. */
static inline __attribute__((always_inline)) float head_scores(const float *qs, const float *k,
                                                               int64_t ks, const float *zero,
                                                               int t0, int n, float *s,
                                                               const int dv) {
    vf qv[dv];
    for (int i = 0; i < dv; i++) qv[i] = load_vf(qs + i * VL);
    return scores(qv, k, ks, zero, t0, n, s, dv);
}

/* The rest of a query head's block after its scores s[t0, n) (maximum `top`): the
 * online-softmax step (state m, l) and the V rows [t0, n) (row t at v + t * ks) weighted into
 * the accumulator `acc`, held in registers over the block. `pf_k`, `pf_v`: the next block's
 * rows of the KV head to prefetch, a token's between the V rows (NULL: none), `pf_row` bytes
 * apart. */
static inline __attribute__((always_inline)) void head_weigh(
    const float *v, int64_t ks, int t0, int n, float *s, float top, float *acc, float *m,
    float *l, int first, const char *pf_k, const char *pf_v, int64_t pf_row, int bs,
    const int dv, const int bf16) {
    const int64_t pf_bytes = (int64_t)dv * VL * (bf16 ? 2 : 4); /* a head's row, constant */
    const float c = softmax_block(s, t0, n, top, m, l, first);
    vf av[dv];
    for (int i = 0; i < dv; i++) av[i] = load_vf(acc + i * VL) * c;
    if (pf_k == NULL) /* two loops: with the prefetches in it, GCC kept av in memory */
        for (int t = t0; t < n; t++)
            for (int i = 0; i < dv; i++) av[i] += s[t] * load_vf(v + t * ks + i * VL);
    else
        for (int t = t0; t < n; t++) {
            prefetch_row(pf_k, pf_v, t, pf_row, pf_bytes);
            for (int i = 0; i < dv; i++) av[i] += s[t] * load_vf(v + t * ks + i * VL);
        }
    for (int i = 0; i < dv; i++) store_vf(acc + i * VL, av[i]);
    if (pf_k != NULL) /* the rest of the next block's rows */
        for (int t = 0; t < bs; t++)
            if (t < t0 || t >= n) prefetch_row(pf_k, pf_v, t, pf_row, pf_bytes);
}
#endif
