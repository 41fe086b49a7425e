/* Paged decode attention for the CPU, fp32 queries over an fp32 or bf16 cache: one new query token
 * per sequence attends over its context in the paged KV cache, reading each cached K and V row
 * once, straight from its block (no gathered copy), with an online softmax.
 *
 * Layouts (row-major, contiguous unless a stride is given):
 *   q, out       [batch, num_heads, head_dim]
 *   k, v         [num_blocks, block_size, num_kv_heads, head_dim]  (a layer's cache, two halves)
 *   block_tables [batch, table_stride] int32
 *   seq_lens     [batch] int32: context length, the new token included
 *   window       the last `window` tokens are attended (a sliding window); 0 for all of them
 *   sinks        [num_heads] attention-sink logits (scaled units) joining each softmax's
 *                denominator, or NULL for none
 * head_dim must be a multiple of 8 (the caller checks). A bf16 cache's rows are widened to fp32
 * as they are read (`kv_bf16`); the arithmetic is fp32 either way.
 *
 * A work item is one sequence, all heads (or, below one sequence per thread, a range of them). Per
 * block, head by head (the query, then the accumulator, held in registers over the block's tokens;
 * the block's K or V rows stay in L1 for the heads of a group): the scores (the next block's rows
 * of the head prefetched a token at a time between them), an online-softmax update, and the V
 * rows weighted into the accumulator.
 * Measured on 2 cores: 128 sequences of 250-500 tokens, 8 layers of 256 MiB, cold caches: 6.3-6.4
 * ms a layer, as for the token-major order this replaced (the bytes bound it); 32 sequences of 190
 * tokens, warm: 0.24 ms against 0.36, and one sequence 13.6 us against 15.6. (Earlier: plain C
 * loops 8-9 ms and a head-major order over whole sequences 10-12 ms on the cold case, ~20 ms for
 * the torch backend's gather + SDPA.) Prefetching the next block into every cache level rather
 * than non-temporally (`small` preset's heads, fp32 cache of 1,024-16,384 blocks, sequences on
 * random blocks, both builds alternating in one process): 32-64 sequences of 192-256 tokens
 * 3.0-3.4x faster (~28 GB/s: the bytes bound it again), 8 sequences 1.2-1.6x, 4 of 1,024
 * tokens 3.8x; bf16 cache 1.1-2.1x. Spread over the dot products rather than issued all at once
 * before the block (whose loop took half the kernel's time at one sequence, stalled on the
 * prefetches): 1.03-1.1x more at 8-64 sequences, 1.6-2x at one of 1,024 tokens (split over
 * the threads; a burst of only its heads' part was 1.25x of the whole block's). No prefetch at all
 * was 5-10% faster with an fp32 cache in one run, 16% slower at 64 sequences in another, and 14%
 * slower on a bf16 cache at 32 sequences.
 *
 * `num_threads` OpenMP threads take items longest-first (the runner sorts decodes shortest-first)
 * from an atomic counter; with fewer sequences than threads, an item is a sequence's share of its
 * KV-head groups (one sequence of the `small` preset's shape, 170 tokens, 2 threads: 26-27 us
 * against 33 alone; its decode step about 10% shorter). The library links libgomp.so.1, the soname
 * of the OpenMP runtime torch ships, so once torch is loaded the kernel runs on torch's own thread
 * pool: threads of a second pool (pthreads, as first written) competed with torch's, which spin
 * for a while after each op, and the kernel took 1.7x as long inside the engine as alone.
 *
 * Built at first use by workers/attention/cpu_backend.py: cc -O3 -march=native -ffast-math.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

typedef struct {
    const float *q, *sinks;
    const void *k, *v; /* fp32, or bf16 when kv_bf16 */
    const int32_t *block_tables;
    const int32_t *seq_lens;
    float *out;
    int64_t table_stride;
    int num_heads, num_kv_heads, head_dim, block_size, num_items, window, kv_bf16;
    int splits; /* work items per sequence, each a range of KV-head groups */
    float scale;
    atomic_int next;
    int failed;
} job_t;

/* Eight floats; GCC/Clang vector extensions compile to AVX (x86-64) or NEON pairs (AArch64). */
typedef float vf __attribute__((vector_size(32)));
#define VL 8

static inline vf load_vf(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store_vf(float *p, vf v) { memcpy(p, &v, sizeof v); }

typedef uint16_t vh __attribute__((vector_size(16)));
typedef uint32_t vu __attribute__((vector_size(32)));

/* Eight cached values from element `i` of `base`, as fp32 (bf16: the high half of each). */
static inline vf load_kv(const void *base, int64_t i, const int bf16) {
    if (!bf16) return load_vf((const float *)base + i);
    vh h;
    memcpy(&h, (const uint16_t *)base + i, sizeof h);
    vu u = __builtin_convertvector(h, vu) << 16;
    vf f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float sum_vf(vf v) {
    float s = 0.0f;
    for (int i = 0; i < VL; i++) s += v[i];
    return s;
}

/* One sequence, every head; `dv` = head_dim / 8. Inlined with dv a constant for the usual head
 * sizes, so the row loops are unrolled (head_dim 16, the embedded tiny model's: 64 sequences of
 * 170 tokens in 0.28 ms against 0.57 ms with dv a variable, on this project's 2-core machine). */
static inline __attribute__((always_inline)) int attend_dv(job_t *j, int item, const int dv,
                                                           const int bf16) {
    const int64_t esize = bf16 ? 2 : 4; /* bytes per cached value */
    const int H = j->num_heads, Hkv = j->num_kv_heads, G = H / Hkv, bs = j->block_size;
    /* this item's sequence and query heads [h0, h1): whole KV-head groups */
    const int seq = item / j->splits, part = item % j->splits;
    const int h0 = part * Hkv / j->splits * G, h1 = (part + 1) * Hkv / j->splits * G;
    const int D = dv * VL, len = j->seq_lens[seq];
    const int64_t row = (int64_t)Hkv * D;  /* floats per token in a block (every KV head) */
    const int32_t *table = j->block_tables + (int64_t)seq * j->table_stride;
    const float *q = j->q + (int64_t)seq * H * D;
    float *out = j->out + (int64_t)seq * H * D;
    if (len <= 0) {  /* nothing to attend to (callers never ask): zeros, not NaN */
        memset(out + (size_t)h0 * D, 0, sizeof(float) * (size_t)(h1 - h0) * D);
        return 0;
    }
    /* per query head: scaled query, accumulator, running max, sum and rescale; block scores */
    float *mem = malloc(sizeof(float) * ((size_t)H * D * 2 + (size_t)H * 3 + (size_t)H * bs));
    if (mem == NULL) return -1;
    float *qs = mem, *acc = qs + (size_t)H * D, *m = acc + (size_t)H * D, *l = m + H;
    float *c = l + H, *s = c + H;  /* s: [H][bs] scores of a block */
    for (int i = h0 * D; i < h1 * D; i++) {
        qs[i] = q[i] * j->scale;
        acc[i] = 0.0f;
    }
    /* a sink starts each head's softmax: running max = its logit, sum = exp(0) = 1 */
    const float *sinks = j->sinks;
    for (int h = h0; h < h1; h++) {
        l[h] = sinks != NULL ? 1.0f : 0.0f;
        m[h] = sinks != NULL ? sinks[h] : 0.0f;
    }
    const int num_blocks = (len + bs - 1) / bs;
    /* a sliding window starts at token `first`: blocks before it are never read */
    const int first = j->window > 0 && len > j->window ? len - j->window : 0, b0 = first / bs;
    for (int b = b0; b < num_blocks; b++) {
        const int n = b == num_blocks - 1 ? len - b * bs : bs;
        const int t0 = b == b0 ? first - b * bs : 0;  /* tokens [t0, n) of this block */
        /* element offsets of this block and the next in either half */
        const int64_t kb = (int64_t)table[b] * bs * row;
        const int has_next = b + 1 < num_blocks;
        const char *kn = has_next ? (const char *)j->k + (int64_t)table[b + 1] * bs * row * esize
                                  : NULL;
        const char *vn = has_next ? (const char *)j->v + (int64_t)table[b + 1] * bs * row * esize
                                  : NULL;
        /* head-major within the block: a head's query stays in registers over the block's
         * tokens (the block's K rows, 16 x 1 KiB here, stay in L1 for the group's heads) */
        for (int h = h0; h < h1; h++) {
            vf qv[dv];
            for (int i = 0; i < dv; i++) qv[i] = load_vf(qs + h * D + i * VL);
            const int64_t kh = kb + (h / G) * D;
            /* the next block's rows of this KV head, a token's at a time between the dot
             * products, into every cache level. (As non-temporal prefetches, which skip L2, the
             * next block's 2 x 16 KiB were often evicted from L1 before their turn and read from
             * memory again; issued all at once before the block, the prefetches stalled the
             * core, their loop half of the kernel's time at one sequence.) */
            const int64_t ahead = h % G == 0 && kn != NULL ? (int64_t)(h / G) * D * esize : -1;
            for (int t = t0; t < n; t++) {
                if (ahead >= 0)
                    for (int64_t i = 0; i < D * esize; i += 64) {
                        __builtin_prefetch(kn + ahead + t * row * esize + i, 0, 3);
                        __builtin_prefetch(vn + ahead + t * row * esize + i, 0, 3);
                    }
                const int64_t kr = kh + t * row;
                vf a0 = {0}, a1 = {0};
                int i = 0;
                for (; i + 1 < dv; i += 2) {
                    a0 += qv[i] * load_kv(j->k, kr + i * VL, bf16);
                    a1 += qv[i + 1] * load_kv(j->k, kr + (i + 1) * VL, bf16);
                }
                if (i < dv) a0 += qv[i] * load_kv(j->k, kr + i * VL, bf16);
                s[h * bs + t] = sum_vf(a0 + a1);
            }
        }
        for (int h = h0; h < h1; h++) {
            float *sh = s + h * bs;
            float block_max = sh[t0];
            for (int t = t0 + 1; t < n; t++) block_max = sh[t] > block_max ? sh[t] : block_max;
            c[h] = 1.0f;  /* rescales what was accumulated under the old maximum */
            if (b == b0 && sinks == NULL) {
                m[h] = block_max;  /* no infinities anywhere, so -ffast-math is safe */
            } else if (block_max > m[h]) {
                c[h] = expf(m[h] - block_max);
                m[h] = block_max;
            }
            float sum = 0.0f;
            for (int t = t0; t < n; t++) {
                sh[t] = expf(sh[t] - m[h]);
                sum += sh[t];
            }
            l[h] = l[h] * c[h] + sum;
        }
        for (int h = h0; h < h1; h++) {  /* a head's accumulator in registers over the block */
            vf av[dv];
            float *ah = acc + h * D;
            for (int i = 0; i < dv; i++) av[i] = load_vf(ah + i * VL) * c[h];
            const int64_t vh = kb + (h / G) * D;  /* the V half has the K half's layout */
            const float *sh = s + h * bs;
            for (int t = t0; t < n; t++) {
                const float p = sh[t];
                const int64_t vr = vh + t * row;
                for (int i = 0; i < dv; i++) av[i] += p * load_kv(j->v, vr + i * VL, bf16);
            }
            for (int i = 0; i < dv; i++) store_vf(ah + i * VL, av[i]);
        }
    }
    /* each head normalized in vector registers: as a loop of floats, GCC vectorized this across
     * the heads, and -ffast-math's vector division (a reciprocal estimate and a Newton step)
     * rounds unlike the scalar division of the loop's remainder, so a head's output depended on
     * how many heads its item held, so on the thread count below one sequence per thread (the
     * tiny model's 4 heads: a last bit apart at 1 thread against 2, on GCC 12 for Cascade Lake).
     * Here every head takes the same scalar division, whatever the item's heads: the loop holds
     * vector statements, which GCC does not vectorize again. */
    for (int h = h0; h < h1; h++) {
        const vf inv = (vf){0} + 1.0f / l[h];
        for (int i = 0; i < dv; i++)
            store_vf(out + h * D + i * VL, load_vf(acc + h * D + i * VL) * inv);
    }
    free(mem);
    return 0;
}

/* `bf16` a constant at both call sites below, so each cache dtype gets its own copies */
static inline __attribute__((always_inline)) int attend_cache(job_t *j, int item,
                                                              const int bf16) {
    switch (j->head_dim) {  /* constant trip counts for the usual head sizes */
        case 16: return attend_dv(j, item, 2, bf16);
        case 32: return attend_dv(j, item, 4, bf16);
        case 64: return attend_dv(j, item, 8, bf16);
        case 128: return attend_dv(j, item, 16, bf16);
        default: return attend_dv(j, item, j->head_dim / VL, bf16);
    }
}

static int attend(job_t *j, int item) {
    return j->kv_bf16 ? attend_cache(j, item, 1) : attend_cache(j, item, 0);
}

static void *work(void *arg) {
    job_t *j = arg;
    for (;;) {
        const int item = atomic_fetch_add(&j->next, 1);
        if (item >= j->num_items) break;
        if (attend(j, j->num_items - 1 - item) != 0) j->failed = 1;
    }
    return NULL;
}

/* Returns 0 on success, -1 when memory for a work item's scratch could not be allocated.
 * k and v: fp32, or bf16 when kv_bf16 is 1. */
int paged_decode_f32(const float *q, const void *k, const void *v, const float *sinks,
                     const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                     float *out, int batch, int num_heads, int num_kv_heads, int head_dim,
                     int block_size, float scale, int window, int kv_bf16, int num_threads) {
    job_t j = {.q = q, .k = k, .v = v, .sinks = sinks, .block_tables = block_tables,
               .seq_lens = seq_lens, .out = out, .table_stride = table_stride,
               .num_heads = num_heads, .num_kv_heads = num_kv_heads, .head_dim = head_dim,
               .block_size = block_size, .scale = scale, .window = window,
               .kv_bf16 = kv_bf16, .failed = 0};
    /* fewer sequences than threads (one stream decoding): each sequence's KV-head groups are
     * split over the threads, so none sits idle; a head's result is the same either way */
    int splits = 1;
    if (batch > 0 && batch < num_threads) {
        splits = (num_threads + batch - 1) / batch;
        if (splits > num_kv_heads) splits = num_kv_heads;
    }
    j.splits = splits;
    j.num_items = batch * splits;
    atomic_init(&j.next, 0);
    if (num_threads > j.num_items) num_threads = j.num_items;
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel num_threads(num_threads)
    work(&j);
    return j.failed ? -1 : 0;
}
