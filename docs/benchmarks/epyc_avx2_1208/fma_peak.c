/* One core's fp32 FMA peak: 12 independent chains of 8-lane FMAs, nothing
 * else in the loop (no stores: a store per FMA would bound it instead).
 *     gcc -O2 fma_peak.c -o fma_peak && ./fma_peak */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

__attribute__((target("avx2,fma"))) int main(int argc, char **argv) {
    (void)argv;
    __m256 a[12];
    for (int i = 0; i < 12; i++) a[i] = _mm256_set1_ps(i * 0.001f * argc);
    const __m256 x = _mm256_set1_ps(0.999999f), y = _mm256_set1_ps(1e-7f);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    const long n = 200000000;
    for (long k = 0; k < n; k++) {
#pragma GCC unroll 12
        for (int i = 0; i < 12; i++) a[i] = _mm256_fmadd_ps(a[i], x, y);
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    const double s = (t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec);
    float o = 0;
    for (int i = 0; i < 12; i++) o += a[i][0] + a[i][3];
    printf("%.1f GFLOP/s per core (%f)\n", n * 12 * 16 / s / 1e9, o);
    return 0;
}
