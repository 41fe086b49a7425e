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
 * A work item is a group of rows with one context and a range of its KV heads: consecutive rows
 * whose block tables agree over every block each reads (a speculative verification's k + 1 rows:
 * one sequence, seq_lens one apart) form a group of up to MAX_GROUP_ROWS (`group_rows`); a plain
 * decode's rows are groups of one. Per block and KV head, the head's K and V rows (widened once
 * from bf16) stay in L1 while each of the item's rows takes, for its query heads of that KV
 * head (paged_block.h; the query, then the accumulator, in registers over the block's tokens),
 * their scores, eight tokens at a time summed together, with the block max in vectors, then
 * each head's online-softmax update and the V rows weighted into its accumulator; the first
 * prefetches the next block's rows of the KV head, a token's at a time. A row's arithmetic is
 * the same whatever shares its item, so each row of a verification is its 1-row decode step's
 * bit for bit (tests/workers/test_cpu_attention.py).
 * Why (SmolLM2-135M's heads: 9, 3 KV heads of 64; 30 layers' caches in turn, one thread): a
 * verification of 5 rows took 4.5, 7.7 and 12.7 ms at 300, 500 and 800 tokens against 1.3, 2.9 and
 * 5.0 for one row, 3.5-4.6x with one layer's cache warm too: the extra rows' arithmetic (16 FMAs
 * of 8 floats per row, head and token), not their reads, and each score's horizontal sum and the
 * scalar block max on top. Grouped (both builds alternating in one process): 5 rows 0.73-0.84x the
 * time (2 threads 0.72-0.89x, a bf16 cache 0.52-0.55x), one row even (bf16 0.76-0.81x), plain
 * decodes of 32-128 sequences 0.94-1.00x; the offline step of SmolLM2's Q4_1 file on the GGUF VNNI
 * kernel, 5 rows over 1, 1.58 / 1.65 / 1.72 against 1.64 / 1.79 / 2.03 (medians of 30, one
 * thread). The FMAs bound it now: 16-float vectors were no help, a 512-bit FMA taking twice a
 * 256-bit one on this machine; splitting the V sum into even and odd tokens was 7% slower.
 * Before that (one sequence per item, head by head, with the same prefetch), measured on 2
 * cores: 128 sequences of 250-500 tokens, 8 layers of 256 MiB, cold caches: 6.3-6.4
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
 * against 33 alone; its decode step about 10% shorter), and of a group's rows; a group longer
 * than a thread's share of the step's rows is split in row ranges (SmolLM2's heads, 2 threads,
 * a 5-row verification beside a 1-row decode at 300 / 500 tokens: 4.1 / 7.5 ms for 30 layers
 * against 4.8 / 8.6 unsplit and 4.7 / 8.1 before grouping). The library links libgomp.so.1,
 * the soname of the OpenMP runtime torch ships, so once torch is loaded the kernel runs on
 * torch's own thread pool: threads of a second pool (pthreads, as first written) competed with
 * torch's, which spin for a while after each op, and the kernel took 1.7x as long inside the
 * engine as alone.
 *
 * Built at first use by workers/attention/cpu_backend.py: cc -O3 -march=native -ffast-math.
 */
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "paged_block.h"

enum { MAX_GROUP_ROWS = 8 }; /* rows of one sequence that share a work item's reads */

typedef struct {
    const float *q, *sinks;
    const void *k, *v; /* fp32, or bf16 when kv_bf16 */
    const int32_t *block_tables;
    const int32_t *seq_lens;
    float *out;
    int64_t table_stride;
    int num_heads, num_kv_heads, head_dim, block_size, window, kv_bf16;
    const int *group_start; /* [num_groups + 1]: group i is rows [group_start[i], ..[i + 1]) */
    int num_groups, head_splits, row_splits, num_items; /* an item: a group's heads x rows */
    float scale;
    atomic_int next;
    int failed;
} job_t;

/* Where one row of an item reads: tokens [first, len) of blocks [b0, nb). */
typedef struct {
    int len, first, b0, nb;
} span_t;

static span_t row_span(const job_t *j, int r) {
    const int len = j->seq_lens[r], bs = j->block_size;
    const int first = j->window > 0 && len > j->window ? len - j->window : 0;
    return (span_t){len, first, first / bs, len > 0 ? (len + bs - 1) / bs : 0};
}

/* One item: rows [r0, r1) of a group (one sequence's rows, one context) and its query heads of
 * KV heads [g0, g1); `dv` = head_dim / 8. Inlined with dv a constant for the usual head sizes,
 * so the row loops are unrolled (head_dim 16, the embedded tiny model's: 64 sequences of 170
 * tokens in 0.28 ms against 0.57 ms with dv a variable, on this project's 2-core machine). */
static inline __attribute__((always_inline)) int attend_dv(job_t *j, int item, const int dv,
                                                           const int bf16) {
    const int H = j->num_heads, Hkv = j->num_kv_heads, G = H / Hkv, bs = j->block_size;
    const int parts = j->head_splits * j->row_splits, grp = item / parts;
    const int hp = item % parts / j->row_splits, rp = item % j->row_splits;
    const int gs = j->group_start[grp], gn = j->group_start[grp + 1] - gs;
    const int r0 = gs + rp * gn / j->row_splits, R = gs + (rp + 1) * gn / j->row_splits - r0;
    const int g0 = hp * Hkv / j->head_splits, g1 = (hp + 1) * Hkv / j->head_splits;
    const int nh = (g1 - g0) * G, D = dv * VL;
    const int64_t esize = bf16 ? 2 : 4, row = (int64_t)Hkv * D; /* a token's values, all heads */
    /* the group's first row's table: every row's equals it over the blocks that row reads */
    const int32_t *table = j->block_tables + (int64_t)gs * j->table_stride;
    if (R == 0) return 0;
    /* per (row, head): scaled query, accumulator, running max and sum; a block's scores, a
     * zero row, a bf16 block's K and V rows of one KV head widened */
    const size_t nq = (size_t)R * nh, wide = bf16 ? (size_t)2 * bs * D : 0;
    const int sn = bs + VL; /* floats of a head's block scores */
    float *mem = malloc(sizeof(float) * (nq * (2 * D + 2) + (size_t)G * (sn + 1) + D + wide));
    if (mem == NULL) return -1;
    float *qs = mem, *acc = qs + nq * D, *m = acc + nq * D, *l = m + nq, *s = l + nq;
    float *top = s + G * sn, *zero = top + G, *kw = zero + D, *vw = kw + (wide / 2);
    memset(zero, 0, sizeof(float) * (size_t)D);
    span_t sp[MAX_GROUP_ROWS];
    int lo = 1 << 30, hi = 0; /* the item's blocks */
    for (int r = 0; r < R; r++) {
        sp[r] = row_span(j, r0 + r);
        if (sp[r].nb > 0) lo = sp[r].b0 < lo ? sp[r].b0 : lo;
        hi = sp[r].nb > hi ? sp[r].nb : hi;
        for (int h = 0; h < nh; h++) { /* a sink starts a softmax: max = its logit, sum 1 */
            const float *q = j->q + ((int64_t)(r0 + r) * H + g0 * G + h) * D;
            for (int i = 0; i < D; i++) {
                qs[(r * nh + h) * D + i] = q[i] * j->scale;
                acc[(r * nh + h) * D + i] = 0.0f;
            }
            l[r * nh + h] = j->sinks != NULL ? 1.0f : 0.0f;
            m[r * nh + h] = j->sinks != NULL ? j->sinks[g0 * G + h] : 0.0f;
        }
    }
    for (int b = lo; b < hi; b++) {
        const int64_t kb = (int64_t)table[b] * bs * row, width = b * bs + bs; /* tokens so far */
        const char *kn = b + 1 < hi ? (const char *)j->k + (int64_t)table[b + 1] * bs * row * esize
                                    : NULL;
        const char *vn = kn == NULL ? NULL : (const char *)j->v + (kn - (const char *)j->k);
        for (int g = g0; g < g1; g++) {
            const float *k = (const float *)j->k + kb + g * D;
            const float *v = (const float *)j->v + kb + g * D;
            int64_t ks = row;
            if (bf16) { /* widened once for all the item's rows and heads */
                int filled = 0;
                for (int r = 0; r < R; r++) {
                    const int end = sp[r].len < width ? sp[r].len - b * bs : bs;
                    filled = end > filled ? end : filled;
                }
                for (int t = 0; t < filled; t++) {
                    widen_bf16((const uint16_t *)j->k + kb + t * row + g * D, kw + t * D, D);
                    widen_bf16((const uint16_t *)j->v + kb + t * row + g * D, vw + t * D, D);
                }
                k = kw, v = vw, ks = D;
            }
            const char *pf_k = kn == NULL ? NULL : kn + g * D * esize;
            const char *pf_v = vn == NULL ? NULL : vn + g * D * esize;
            for (int r = 0; r < R; r++) {
                if (b < sp[r].b0 || b >= sp[r].nb) continue;
                const int t0 = b == sp[r].b0 ? sp[r].first - b * bs : 0;
                const int n = b == sp[r].nb - 1 ? sp[r].len - b * bs : bs;
                const int x0 = r * nh + (g - g0) * G; /* the row's heads of this KV head */
                for (int h = 0; h < G; h++) /* all their scores first, for the core to overlap */
                    top[h] = head_scores(qs + (x0 + h) * D, k, ks, zero, t0, n, s + h * sn, dv);
                for (int h = 0; h < G; h++) {
                    const int x = x0 + h;
                    head_weigh(v, ks, t0, n, s + h * sn, top[h], acc + x * D, m + x, l + x,
                               b == sp[r].b0 && j->sinks == NULL, pf_k, pf_v, row * esize, bs,
                               dv, bf16);
                    pf_k = pf_v = NULL; /* prefetched once per block and KV head */
                }
            }
        }
    }
    /* each head normalized in vector registers: as a loop of floats, GCC vectorized this across
     * the heads, and -ffast-math's vector division (a reciprocal estimate and a Newton step)
     * rounds unlike the scalar division of the loop's remainder, so a head's output depended on
     * how many heads its item held, so on the thread count below one sequence per thread (the
     * tiny model's 4 heads: a last bit apart at 1 thread against 2, on GCC 12 for Cascade Lake).
     * Here every head takes the same scalar division, whatever the item's heads: the loop holds
     * vector statements, which GCC does not vectorize again. A row with no context gets zeros. */
    for (int r = 0; r < R; r++)
        for (int h = 0; h < nh; h++) {
            const int x = r * nh + h;
            const vf inv = (vf){0} + (sp[r].len > 0 ? 1.0f / l[x] : 0.0f);
            float *o = j->out + ((int64_t)(r0 + r) * H + g0 * G + h) * D;
            for (int i = 0; i < dv; i++) store_vf(o + i * VL, load_vf(acc + x * D + i * VL) * inv);
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

/* The rows into groups in `start` (group i: rows [start[i], start[i + 1])); returns how many.
 * A row joins the group before it (up to MAX_GROUP_ROWS rows) when its table holds the group's
 * first row's blocks over all the blocks it reads: the same context, a verification's rows. */
static int group_rows(const int32_t *tables, int64_t stride, const int32_t *seq_lens, int batch,
                      int block_size, int *start) {
    int groups = 0;
    for (int r = 0; r < batch; r++) {
        const int f = groups > 0 ? start[groups - 1] : -1;
        const int64_t blocks = seq_lens[r] > 0 ? (seq_lens[r] + block_size - 1) / block_size : 0;
        if (f < 0 || r - f >= MAX_GROUP_ROWS
            || memcmp(tables + f * stride, tables + r * stride, sizeof(int32_t) * blocks) != 0)
            start[groups++] = r;
    }
    start[groups] = batch;
    return groups;
}

/* Returns 0 on success, -1 when memory for a work item's scratch could not be allocated.
 * k and v: fp32, or bf16 when kv_bf16 is 1. */
int paged_decode_f32(const float *q, const void *k, const void *v, const float *sinks,
                     const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                     float *out, int batch, int num_heads, int num_kv_heads, int head_dim,
                     int block_size, float scale, int window, int kv_bf16, int num_threads) {
    int *start = malloc(sizeof(int) * ((size_t)batch + 1));
    if (start == NULL) return -1;
    job_t j = {.q = q, .k = k, .v = v, .sinks = sinks, .block_tables = block_tables,
               .seq_lens = seq_lens, .out = out, .table_stride = table_stride,
               .num_heads = num_heads, .num_kv_heads = num_kv_heads, .head_dim = head_dim,
               .block_size = block_size, .scale = scale, .window = window,
               .kv_bf16 = kv_bf16, .group_start = start, .head_splits = 1, .row_splits = 1,
               .failed = 0};
    j.num_groups = group_rows(block_tables, table_stride, seq_lens, batch, block_size, start);
    /* items of about equal work. Fewer groups than threads (one stream decoding): each group's
     * KV heads, and its rows, are split over the threads, so none sits idle. Else a group of
     * more rows than a thread's share of all the rows (a verification beside a plain decode)
     * is split in ranges of rows, so no thread waits on one long item. A row's and head's
     * result is the same either way. */
    int most = 1;
    for (int g = 0; g < j.num_groups; g++)
        most = start[g + 1] - start[g] > most ? start[g + 1] - start[g] : most;
    if (j.num_groups > 0 && j.num_groups < num_threads) {
        const int want = (num_threads + j.num_groups - 1) / j.num_groups;
        j.head_splits = want < num_kv_heads ? want : num_kv_heads;
        j.row_splits = want < most ? want : most;
    } else if (j.num_groups > 0) {
        const int share = (batch + num_threads - 1) / num_threads;
        j.row_splits = (most + share - 1) / share;
    }
    j.num_items = j.num_groups * j.head_splits * j.row_splits;
    atomic_init(&j.next, 0);
    if (num_threads > j.num_items) num_threads = j.num_items;
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel num_threads(num_threads)
    work(&j);
    free(start);
    return j.failed ? -1 : 0;
}
