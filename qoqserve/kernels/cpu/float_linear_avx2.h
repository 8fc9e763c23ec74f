/* float_linear's AVX2 path (+FMA, F16C): the same sums as the AVX-512 and
 * scalar loops, each 16-lane sum as two 8-lane halves. Included by
 * float_linear.c inside its x86 block. */
#ifndef QOQSERVE_FLOAT_LINEAR_AVX2_H
#define QOQSERVE_FLOAT_LINEAR_AVX2_H

#define AVX2 __attribute__((target("avx2,fma,f16c")))

static int avx2_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

/* elements k..k+7 of row r as fp32 (n valid, the rest 0) */
AVX2 static inline __m256 load8(const void *w, int w_kind, int64_t i, int64_t n) {
    if (n < 8) {
        float tmp[8] = {0};
        for (int64_t e = 0; e < n; e++) tmp[e] = weight(w, w_kind, i + e);
        return _mm256_loadu_ps(tmp);
    }
    if (w_kind == W_BF16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    if (w_kind == W_FP16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + i)));
    return _mm256_loadu_ps((const float *)w + i);
}

/* lane_tree of the 16 lanes (lo = 0..7, hi = 8..15): l + 8, l + 4, l + 2, l + 1 */
AVX2 static inline float tree16(__m256 lo, __m256 hi) {
    const __m256 s8 = _mm256_add_ps(lo, hi);
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

/* 2 x 3 sums of two halves: 12 of the 16 ymm registers; the other four hold
 * one half of each row and one weight vector at a time (both halves of the
 * rows at once would spill sums to the stack, a store and a reload per FMA) */
enum { MR2 = 2, NR2 = 3 };

/* a value the compiler must keep in a register: folded into every FMA that
 * uses it, it would be loaded once per use, and the loads outnumber the FMAs */
#define IN_REGISTER(v) __asm__("" : "+x"(v))

AVX2 static inline __attribute__((always_inline)) void tile2(const float *x, int64_t K, const void *w, int w_kind,
                                                             int64_t m0, int mr, int64_t n0, int nr, int64_t N,
                                                             float *y) {
    __m256 lo[MR2 * NR2], hi[MR2 * NR2];
    for (int i = 0; i < MR2 * NR2; i++) lo[i] = hi[i] = _mm256_setzero_ps();
    const float *xr = x + m0 * K;
    int64_t k = 0;
    for (; k + LANES <= K; k += LANES) {  /* whole 16-lane steps: plain loads */
        for (int h = 0; h < LANES; h += 8) {
            __m256 xv[MR2], *sums = h ? hi : lo;
            for (int i = 0; i < mr; i++) {
                xv[i] = _mm256_loadu_ps(xr + i * K + k + h);
                IN_REGISTER(xv[i]);
            }
            for (int j = 0; j < nr; j++) {
                __m256 wv = load8(w, w_kind, (n0 + j) * K + k + h, 8);
                IN_REGISTER(wv);
                for (int i = 0; i < mr; i++) sums[i * NR2 + j] = _mm256_fmadd_ps(xv[i], wv, sums[i * NR2 + j]);
            }
        }
    }
    if (k < K) {  /* the ragged last step, zero-padded as the other paths */
        for (int j = 0; j < nr; j++) {
            const __m256 wl = load8(w, w_kind, (n0 + j) * K + k, K - k);
            const __m256 wh = load8(w, w_kind, (n0 + j) * K + k + 8, K - k - 8);
            for (int i = 0; i < mr; i++) {
                lo[i * NR2 + j] = _mm256_fmadd_ps(load8(xr, W_FP32, i * K + k, K - k), wl, lo[i * NR2 + j]);
                hi[i * NR2 + j] = _mm256_fmadd_ps(load8(xr, W_FP32, i * K + k + 8, K - k - 8), wh, hi[i * NR2 + j]);
            }
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) y[(m0 + i) * N + n0 + j] = tree16(lo[i * NR2 + j], hi[i * NR2 + j]);
}

#define TILE2(a, b) tile2(x, K, w, w_kind, m0, a, n0, b, N, y)

/* one copy of the loops per weight kind: a constant in the inner loop */
AVX2 static inline __attribute__((always_inline)) void rows_avx2_kind(const float *x, int64_t M, int64_t K,
                                                                      const void *w, int w_kind, int64_t n_lo,
                                                                      int64_t n_hi, int64_t N, float *y) {
    for (int64_t n0 = n_lo; n0 < n_hi; n0 += NR2) {
        const int nr = n_hi - n0 < NR2 ? (int)(n_hi - n0) : NR2;
        for (int64_t m0 = 0; m0 < M; m0 += MR2) {
            const int mr = M - m0 < MR2 ? (int)(M - m0) : MR2;
            switch (mr * 4 + nr) {
            case 11: TILE2(2, 3); break;
            case 10: TILE2(2, 2); break;
            case 9: TILE2(2, 1); break;
            case 7: TILE2(1, 3); break;
            case 6: TILE2(1, 2); break;
            default: TILE2(1, 1);
            }
        }
    }
}

AVX2 static void rows_avx2(const float *x, int64_t M, int64_t K, const void *w, int w_kind,
                           int64_t n_lo, int64_t n_hi, int64_t N, float *y) {
    if (w_kind == W_BF16) rows_avx2_kind(x, M, K, w, W_BF16, n_lo, n_hi, N, y);
    else if (w_kind == W_FP16) rows_avx2_kind(x, M, K, w, W_FP16, n_lo, n_hi, N, y);
    else rows_avx2_kind(x, M, K, w, W_FP32, n_lo, n_hi, N, y);
}
#endif
