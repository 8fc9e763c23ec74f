/* y[M, N] (fp32) = x[M, K] (fp32) . W[N, K]^T, W in fp32, bf16 or fp16: the LM head
 * (and any dense linear that must not depend on its batch).
 *
 * Batch-invariant by construction: every output is one dot product summed in
 * one fixed order, whatever M, the tiling or the thread count: 16 lanes, lane
 * l accumulates x[k] * w[k] for k = l (mod 16) in increasing k with fused
 * multiply-adds (K zero-padded to a multiple of 16 in effect), then the lanes
 * are added pairwise l + 8, l + 4, l + 2, l + 1. The AVX-512 path and the
 * scalar one compute exactly that, so they agree bit for bit.
 *
 * The AVX-512 code (F/BW/VL) is compiled by target attributes and chosen at run
 * time; the library is built for a baseline x86-64 CPU.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include "bf16.h"

enum { LANES = 16 };

enum { W_FP32 = 0, W_BF16 = 1, W_FP16 = 2 };  /* w_kind: the weight dtype */

static inline float weight(const void *w, int kind, int64_t i) {
    return kind == W_FP16 ? half_to_float(((const uint16_t *)w)[i]) : load(w, kind == W_BF16, i);
}

static float lane_tree(float *s) {
    for (int h = LANES / 2; h >= 1; h /= 2)
        for (int l = 0; l < h; l++) s[l] = s[l] + s[l + h];
    return s[0];
}

static void rows_scalar(const float *x, int64_t M, int64_t K, const void *w, int w_kind,
                        int64_t n_lo, int64_t n_hi, int64_t N, float *y) {
    for (int64_t n = n_lo; n < n_hi; n++) {
        for (int64_t m = 0; m < M; m++) {
            float s[LANES] = {0};
            /* the padding lanes too: fma(0, 0, -0) is +0, as in the vector path */
            for (int64_t k = 0; k < (K + LANES - 1) / LANES * LANES; k++)
                s[k % LANES] = k < K ? fmaf(x[m * K + k], weight(w, w_kind, n * K + k), s[k % LANES])
                                     : fmaf(0.f, 0.f, s[k % LANES]);
            y[m * N + n] = lane_tree(s);
        }
    }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_SIMD 1
#define SIMD __attribute__((target("avx512f,avx512bw,avx512vl")))

static int simd_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
}

SIMD static inline __m512 load_w(const void *w, int w_kind, int64_t i, __mmask16 mask) {
    if (w_kind == W_BF16) {
        __m256i h = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)w + i);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    if (w_kind == W_FP16) return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, (const uint16_t *)w + i));
    return _mm512_maskz_loadu_ps(mask, (const float *)w + i);
}

/* the lane tree of lane_tree(), in registers */
SIMD static inline float reduce(__m512 v) {
    __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    __m128 d = _mm_add_ss(c, _mm_shuffle_ps(c, c, 1));
    return _mm_cvtss_f32(d);
}

enum { MR = 4, NR = 4, NR_WIDE = 8 };  /* MR x NR, or 1-2 rows x NR_WIDE */

/* an mr x nr tile (at most MR x NR); inlined with constant sizes, its
 * accumulators live in registers */
SIMD static inline __attribute__((always_inline)) void tile(const float *x, int64_t K, const void *w, int w_kind, int64_t m0, int mr,
                             int64_t n0, int nr, int64_t N, float *y) {
    __m512 acc[MR][NR_WIDE];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += LANES) {
        const __mmask16 mask = K - k >= LANES ? (__mmask16)0xffff : (__mmask16)((1u << (K - k)) - 1);
        __m512 wv[NR_WIDE], xv[MR];
        if (mr <= 2) {  /* a GEMV streams the weights: fetch two tiles ahead */
            const int es = w_kind == W_FP32 ? 4 : 2;
            for (int j = 0; j < nr; j++)
                _mm_prefetch((const char *)w + ((n0 + 2 * nr + j) * K + k) * es, _MM_HINT_T0);
        }
        for (int j = 0; j < nr; j++) wv[j] = load_w(w, w_kind, (n0 + j) * K + k, mask);
        for (int i = 0; i < mr; i++) xv[i] = _mm512_maskz_loadu_ps(mask, x + (m0 + i) * K + k);
        for (int i = 0; i < mr; i++)
            for (int j = 0; j < nr; j++) acc[i][j] = _mm512_fmadd_ps(xv[i], wv[j], acc[i][j]);
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) y[(m0 + i) * N + n0 + j] = reduce(acc[i][j]);
}

SIMD static void rows_simd(const float *x, int64_t M, int64_t K, const void *w, int w_kind,
                           int64_t n_lo, int64_t n_hi, int64_t N, float *y) {
    if (M <= 2) {  /* decode: a GEMV, more weight rows in flight */
        for (int64_t n0 = n_lo; n0 < n_hi; n0 += NR_WIDE) {
            const int nr = n_hi - n0 < NR_WIDE ? (int)(n_hi - n0) : NR_WIDE;
            if (nr < NR_WIDE) tile(x, K, w, w_kind, 0, (int)M, n0, nr, N, y);
            else if (M == 2) tile(x, K, w, w_kind, 0, 2, n0, NR_WIDE, N, y);
            else tile(x, K, w, w_kind, 0, 1, n0, NR_WIDE, N, y);
        }
        return;
    }
    for (int64_t n0 = n_lo; n0 < n_hi; n0 += NR) {
        const int nr = n_hi - n0 < NR ? (int)(n_hi - n0) : NR;
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            const int mr = M - m0 < MR ? (int)(M - m0) : MR;
            if (nr < NR) { tile(x, K, w, w_kind, m0, mr, n0, nr, N, y); continue; }
            switch (mr) {
            case 4: tile(x, K, w, w_kind, m0, 4, n0, NR, N, y); break;
            case 3: tile(x, K, w, w_kind, m0, 3, n0, NR, N, y); break;
            case 2: tile(x, K, w, w_kind, m0, 2, n0, NR, N, y); break;
            default: tile(x, K, w, w_kind, m0, 1, n0, NR, N, y);
            }
        }
    }
}
#else
#define HAVE_SIMD 0
static int simd_supported(void) { return 0; }
static void rows_simd(const float *x, int64_t M, int64_t K, const void *w, int w_kind,
                      int64_t n_lo, int64_t n_hi, int64_t N, float *y) {
    rows_scalar(x, M, K, w, w_kind, n_lo, n_hi, N, y);
}
#endif

/* 1 when this CPU runs the AVX-512 path */
int float_linear_simd(void) { return simd_supported(); }

/* y = x W^T (+ bias, fp32 [N] or NULL). Returns 0, or -2 when simd is asked
 * for on a CPU without AVX-512. */
int float_linear(const float *x, int64_t M, int64_t K, const void *w, int w_kind, int64_t N,
                 const float *bias, float *y, int simd, int threads) {
    if (simd && !simd_supported()) return -2;
    if (M <= 0 || N <= 0) return 0;
    /* output columns in chunks of 64 (a multiple of NR): the chunking never
     * changes a result, only who computes it */
    const int64_t chunk = 64, chunks = (N + chunk - 1) / chunk;
    #pragma omp parallel for num_threads(threads) schedule(static) if (M * N * K > (1 << 16))
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t lo = c * chunk, hi = lo + chunk < N ? lo + chunk : N;
        if (simd) rows_simd(x, M, K, w, w_kind, lo, hi, N, y);
        else rows_scalar(x, M, K, w, w_kind, lo, hi, N, y);
        if (bias)
            for (int64_t m = 0; m < M; m++)
                for (int64_t n = lo; n < hi; n++) y[m * N + n] += bias[n];
    }
    return 0;
}
