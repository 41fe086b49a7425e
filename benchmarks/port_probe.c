/* How many 512-bit byte dot products (VPDPBUSD, the GGUF VNNI kernel's products: 64 multiply-adds
 * each) and 512-bit fp32 FMAs (the attention kernel's: 16 each) one core issues per second:
 * `chains` independent accumulators, so the port, not the latency, bounds it. Built by
 * benchmarks/verify_cost.py with workers/kernels/native.py's flags. Returns the seconds `n`
 * rounds took, -1 without AVX-512 VNNI. */
#include <stdint.h>
#include <time.h>
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
#include <immintrin.h>
#endif

/* the 12 chains held in registers and opaque to the compiler: each round's products are done */
#define KEEP_CHAINS(a)                                                                      \
    __asm__ volatile("" : "+v"(a[0]), "+v"(a[1]), "+v"(a[2]), "+v"(a[3]), "+v"(a[4]),        \
                     "+v"(a[5]), "+v"(a[6]), "+v"(a[7]), "+v"(a[8]), "+v"(a[9]), "+v"(a[10]), \
                     "+v"(a[11]))

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* kind 0: VPDPBUSD, 1: VFMADD231PS, each 12 chains a round; *sink keeps the result live */
double port_probe(int kind, int64_t n, int32_t *sink) {
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
    const double start = now();
    if (kind == 0) {
        __m512i a[12];
        const __m512i b = _mm512_set1_epi32(0x01020304), c = _mm512_set1_epi32(0x05060708);
        for (int i = 0; i < 12; i++) a[i] = _mm512_set1_epi32(i);
        for (int64_t r = 0; r < n; r++) {
            for (int i = 0; i < 12; i++) a[i] = _mm512_dpbusd_epi32(a[i], b, c);
            KEEP_CHAINS(a);
        }
        int32_t s = 0;
        for (int i = 0; i < 12; i++) s += _mm512_reduce_add_epi32(a[i]);
        *sink = s;
    } else {
        __m512 a[12];
        const __m512 x = _mm512_set1_ps(0.999f), y = _mm512_set1_ps(0.001f);
        for (int i = 0; i < 12; i++) a[i] = _mm512_set1_ps((float)i);
        for (int64_t r = 0; r < n; r++) {
            for (int i = 0; i < 12; i++) a[i] = _mm512_fmadd_ps(a[i], x, y);
            KEEP_CHAINS(a);
        }
        float s = 0.0f;
        for (int i = 0; i < 12; i++) s += _mm512_reduce_add_ps(a[i]);
        *sink = (int32_t)s;
    }
    return now() - start;
#else
    (void)kind, (void)n, (void)sink;
    return -1.0;
#endif
}
