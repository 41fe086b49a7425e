/* A matmul's output rows handed to its threads in chunks as each thread asks for more (OpenMP's
 * guided schedule: large chunks first, smaller ones as the rows run out), not as one fixed run
 * per thread.
 *
 * Why: a parallel region ends when its slowest thread does. With fixed runs, a thread whose
 * core is busy with something else (the server's event loop, the load generator, another
 * tenant of the host) holds the whole region up; with chunks, the other threads take its share.
 * On this project's 2-vCPU machine the second vCPU ran at a fraction of the first's speed for
 * seconds at a time: the int4 kernel's median over many calls at one row was 1.0-1.15x its
 * one-thread time at two threads with fixed runs, while its fastest call was 1.5-2x. Measured
 * at one row, fixed runs against chunks in one process (calls alternating, 600 each): p50
 * 1.0-1.3x and p90 1.1-1.3x faster with chunks, p10 even; guided and dynamic alike, guided with
 * fewer atomic adds.
 *
 * Chunks are whole tiles of `rows` output rows, an even number of them (one input row takes
 * tiles in pairs), the smallest about 1 / CHUNKS_PER_THREAD of a thread's share but at least
 * MIN_CHUNK_TILES (taking one costs an atomic add; 8 tiles of 4 rows at K = 512 are ~0.5 us of
 * int4 work). Each output is computed by one thread whichever it is, over k in the same order,
 * so results do not depend on which thread took which chunk. */
#ifndef CLEAVE_CHUNKS_H
#define CLEAVE_CHUNKS_H
#include <stdint.h>

enum { CHUNKS_PER_THREAD = 8, MIN_CHUNK_TILES = 8 };

/* Tiles per chunk for `tiles` tiles over `num_threads` threads. */
static inline int64_t chunk_tiles(int64_t tiles, int num_threads) {
    const int64_t want = (int64_t)CHUNKS_PER_THREAD * (num_threads > 0 ? num_threads : 1);
    int64_t per = (tiles + want - 1) / want;
    if (per < MIN_CHUNK_TILES) per = MIN_CHUNK_TILES;
    return (per + 1) / 2 * 2;
}

/* Inside a parallel region: each chunk of rows [start, end) of N rows (tiles of `rows`) to
 * whichever thread asks next; no barrier at the end (the region's own, or an explicit one where
 * a later phase reads these rows). `BODY` uses `start` and `end`. */
#define FOR_EACH_CHUNK(N, rows, num_threads, BODY)                                            \
    do {                                                                                      \
        const int64_t chunk_rows_ = chunk_tiles(((N) + (rows) - 1) / (rows), (num_threads))   \
                                    * (rows);                                                 \
        const int64_t chunks_ = ((N) + chunk_rows_ - 1) / chunk_rows_;                        \
        _Pragma("omp for schedule(guided) nowait")                                         \
        for (int64_t c_ = 0; c_ < chunks_; c_++) {                                            \
            const int64_t start = c_ * chunk_rows_;                                           \
            const int64_t end = start + chunk_rows_ < (N) ? start + chunk_rows_ : (N);        \
            BODY;                                                                             \
        }                                                                                     \
    } while (0)
#endif
