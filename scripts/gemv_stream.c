/* The GEMVs of one batch-1 decode step of the embedded model against a plain
 * read of the same bytes (docs/benchmarks.md, "Batch-1 decode"): 30 layers x
 * (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536), g64 codes and
 * group bytes, each layer its own buffers (53 MB: past the L3, as in a step),
 * called in a step's order; then one AVX-512 read of the same buffers in the
 * same order with the same threads. Fastest of `reps` steps each.
 *
 *   gcc -O3 -march=x86-64 -mtune=native -fopenmp -ffp-contract=off \
 *       -Iqoqserve/kernels/cpu scripts/gemv_stream.c -o /tmp/gemv_stream -lm
 *   /tmp/gemv_stream [threads=2] [rows=1] [reps=100]
 *
 * -DW4A8_SRC='"path/to/w4a8_gemm.c"' builds it on another version of the
 * kernel (the codes are random: any byte is a valid pair of codes, and the
 * harness only times).
 */
#ifndef W4A8_SRC
#define W4A8_SRC "w4a8_gemm.c"
#endif
#include W4A8_SRC
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

/* this thread's share of p[0..n), whole 256-byte steps (a tail under 256 bytes is skipped) */
__attribute__((target("avx512f"))) static int64_t read_share(const uint8_t *p, size_t n, int t, int T) {
    const size_t lo = n / 256 * t / T * 256, hi = n / 256 * (t + 1) / T * 256;
    __m512i a = _mm512_setzero_si512(), b = a, c = a, d = a;
    for (size_t i = lo; i < hi; i += 256) {
        a = _mm512_add_epi32(a, _mm512_loadu_si512(p + i));
        b = _mm512_add_epi32(b, _mm512_loadu_si512(p + i + 64));
        c = _mm512_add_epi32(c, _mm512_loadu_si512(p + i + 128));
        d = _mm512_add_epi32(d, _mm512_loadu_si512(p + i + 192));
    }
    return _mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a, b), _mm512_add_epi32(c, d)));
}

/* one linear's codes and group bytes, in one parallel region as the GEMV's */
static int64_t read_linear(const uint8_t *w, size_t wn, const uint8_t *g, size_t gn, int threads) {
    int64_t total = 0;
    #pragma omp parallel num_threads(threads) reduction(+ : total)
    total += read_share(w, wn, omp_get_thread_num(), omp_get_num_threads()) +
             read_share(g, gn, omp_get_thread_num(), omp_get_num_threads());
    return total;
}

int main(int argc, char **argv) {
    const int threads = argc > 1 ? atoi(argv[1]) : 2, M = argc > 2 ? atoi(argv[2]) : 1;
    const int reps = argc > 3 ? atoi(argv[3]) : 100, layers = 30, group = 64;
    const int shapes[4][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}};
    uint8_t *w[30][4], *gp[30][4];
    size_t wb[4], gb[4];
    double bytes = 0;
    srand(1);
    for (int s = 0; s < 4; s++) {
        const int N = shapes[s][0], K = shapes[s][1];
        wb[s] = (size_t)((N + 15) / 16) * (K / 8) * 64;
        gb[s] = (size_t)((N + 15) / 16) * (K / group) * 16;
    }
    for (int l = 0; l < layers; l++)
        for (int s = 0; s < 4; s++) {
            w[l][s] = aligned_alloc(64, wb[s]);
            gp[l][s] = aligned_alloc(64, gb[s]);
            for (size_t i = 0; i < wb[s]; i++) w[l][s][i] = (uint8_t)rand();
            for (size_t i = 0; i < gb[s]; i++) gp[l][s][i] = (uint8_t)((rand() % 8) << 4 | (rand() % 16));
            bytes += (double)(wb[s] + gb[s]);
        }
    float *x = malloc(sizeof(float) * (size_t)M * 1536), *y = malloc(sizeof(float) * (size_t)M * 3072);
    float *s1 = malloc(sizeof(float) * 3072);
    for (int i = 0; i < M * 1536; i++) x[i] = rand() / (float)RAND_MAX - 0.5f;
    for (int i = 0; i < 3072; i++) s1[i] = 0.01f;
    const int simd = w4a8_gemm_simd();  /* the path the engine takes on this CPU */
    double gemv = 1e9, read = 1e9;
    int64_t sink = 0;
    for (int rep = 0; rep < reps; rep++) {
        double t = now();
        for (int l = 0; l < layers; l++)
            for (int s = 0; s < 4; s++)
                if (w4a8_gemm(x, 0, 0, NULL, NULL, 0.f, M, shapes[s][1], w[l][s], gp[l][s], group, shapes[s][0],
                              s1, NULL, NULL, NULL, y, 0, 0, simd, threads))
                    return 1;
        t = now() - t;
        gemv = t < gemv ? t : gemv;
        t = now();
        for (int l = 0; l < layers; l++)
            for (int s = 0; s < 4; s++) sink += read_linear(w[l][s], wb[s], gp[l][s], gb[s], threads);
        t = now() - t;
        read = t < read ? t : read;
    }
    printf("%s, %d threads, %d row(s), %.1f MB of codes and group bytes, fastest of %d steps:\n", W4A8_SRC,
           threads, M, bytes / 1e6, reps);
    printf("  GEMVs %.3f ms (%.1f GB/s); plain read of the same buffers %.3f ms (%.1f GB/s); ratio %.2f (%ld)\n",
           gemv * 1e3, bytes / gemv / 1e9, read * 1e3, bytes / read / 1e9, gemv / read, (long)(sink & 1));
    return 0;
}
