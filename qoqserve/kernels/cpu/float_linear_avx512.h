/* float_linear's AVX-512 path (F/BW/VL): the sums of the scalar loops, 16
 * lanes of fused multiply-adds and their lane tree, for fp32 rows times fp32,
 * bf16 or fp16 weights. Included by float_linear.c inside its x86 block
 * (SIMD, the weight kinds, lane_mask). */
#ifndef QOQSERVE_FLOAT_LINEAR_AVX512_H
#define QOQSERVE_FLOAT_LINEAR_AVX512_H

SIMD static inline __m512 load_w(const void *w, int w_kind, int64_t i, __mmask16 mask) {
    if (w_kind == W_BF16) return load_f32(w, 1, i, mask);
    if (w_kind == W_FP16) return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, (const uint16_t *)w + i));
    return _mm512_maskz_loadu_ps(mask, (const float *)w + i);
}

/* The lane trees of up to 16 accumulators at once: v[j] -> lane j of the
 * result is lane_tree(v[j]) (same pairs, l + 8, l + 4, l + 2, l + 1, so the
 * same bits), in 15 adds and 30 shuffles instead of 16 separate reductions. */
SIMD static inline __m512 reduce16(const __m512 *v) {
    __m512 s[8], t[4], u[2];
    for (int p = 0; p < 8; p++)  /* l + 8: 128-bit chunks {0,1} + {2,3} of each vector */
        s[p] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0xEE));
    for (int p = 0; p < 4; p++)  /* l + 4: chunks {0,2} + {1,3} */
        t[p] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * p], s[2 * p + 1], 0x88),
                             _mm512_shuffle_f32x4(s[2 * p], s[2 * p + 1], 0xDD));
    for (int p = 0; p < 2; p++)  /* l + 2, within each chunk */
        u[p] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * p], t[2 * p + 1], 0x44),
                             _mm512_shuffle_ps(t[2 * p], t[2 * p + 1], 0xEE));
    /* l + 1; lane 4c + e now holds the sum of vector 4e + c */
    const __m512 f = _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], 0x88), _mm512_shuffle_ps(u[0], u[1], 0xDD));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), f);
}

/* float_to_bf16 of n values, 16 at a time (bf16_avx512.h) */
SIMD static void to_bf16_simd(const float *src, uint16_t *dst, int64_t n) {
    for (int64_t i = 0; i < n; i += LANES) {
        const __mmask16 mask = lane_mask(n - i);
        _mm256_mask_storeu_epi16(dst + i, mask, to_bf16(_mm512_maskz_loadu_ps(mask, src + i)));
    }
}

enum { MR = 4, NR = PANEL_ROWS, NR_WIDE = 8 };  /* MR x NR, or 1-2 rows x NR_WIDE: at most 16 sums */

/* an mr x nr tile (mr * nr <= 16); inlined with constant sizes, its
 * accumulators live in registers. wk: the weights' kind, or W_FP32 when w is
 * an fp32 panel already converted (row stride wstride elements). fetch:
 * request the weight rows two tiles ahead (the first row tile of weights
 * read in place: in a step they come from memory) */
SIMD static inline __attribute__((always_inline)) void tile(const float *x, int64_t K, const void *w, int w_kind,
                                                            int64_t wstride, int64_t m0, int mr, int64_t n0,
                                                            int nr, int64_t N, float *y, int fetch) {
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += LANES) {
        const __mmask16 mask = lane_mask(K - k);
        __m512 wv[NR_WIDE], xv[MR];
        if (fetch) {
            const int es = w_kind == W_FP32 ? 4 : 2;
            for (int j = 0; j < nr; j++)
                _mm_prefetch((const char *)w + ((n0 + 2 * nr + j) * wstride + k) * es, _MM_HINT_T0);
        }
        for (int j = 0; j < nr; j++) wv[j] = load_w(w, w_kind, (n0 + j) * wstride + k, mask);
        for (int i = 0; i < mr; i++) xv[i] = _mm512_maskz_loadu_ps(mask, x + (m0 + i) * K + k);
        for (int i = 0; i < mr; i++)
            for (int j = 0; j < nr; j++) acc[i * nr + j] = _mm512_fmadd_ps(xv[i], wv[j], acc[i * nr + j]);
    }
    float out[16];
    _mm512_storeu_ps(out, reduce16(acc));
    for (int i = 0; i < mr; i++) memcpy(y + (m0 + i) * N + n0, out + i * nr, (size_t)nr * sizeof(float));
}

/* NR rows of W (n0..) as fp32, K zero-padded to kp: converted once, then read
 * by every row tile of x */
SIMD static void to_panel(const void *w, int w_kind, int64_t K, int64_t kp, int64_t n0, int nr, float *panel) {
    for (int j = 0; j < nr; j++)
        for (int64_t k = 0; k < kp; k += LANES) {
            _mm512_storeu_ps(panel + j * kp + k, load_w(w, w_kind, (n0 + j) * K + k, lane_mask(K - k)));
        }
}

SIMD static void rows_simd(const float *x, int64_t M, int64_t K, const void *w, int w_kind,
                           int64_t n_lo, int64_t n_hi, int64_t N, float *y, float *panel) {
    if (M <= 2) {  /* decode: a GEMV, more weight rows in flight */
        for (int64_t n0 = n_lo; n0 < n_hi; n0 += NR_WIDE) {
            const int nr = n_hi - n0 < NR_WIDE ? (int)(n_hi - n0) : NR_WIDE;
            if (nr < NR_WIDE) tile(x, K, w, w_kind, K, 0, (int)M, n0, nr, N, y, 1);
            else if (M == 2) tile(x, K, w, w_kind, K, 0, 2, n0, NR_WIDE, N, y, 1);
            else tile(x, K, w, w_kind, K, 0, 1, n0, NR_WIDE, N, y, 1);
        }
        return;
    }
    const int64_t kp = (K + LANES - 1) / LANES * LANES;
    for (int64_t n0 = n_lo; n0 < n_hi; n0 += NR) {
        const int nr = n_hi - n0 < NR ? (int)(n_hi - n0) : NR;
        /* without a panel (fp32 weights) the tiles read W in place */
        const void *wt = w;
        int wk = w_kind;
        int64_t ws = K, wn = n0;
        if (panel) {
            to_panel(w, w_kind, K, kp, n0, nr, panel);
            wt = panel, wk = W_FP32, ws = kp, wn = 0;
        }
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            const int mr = M - m0 < MR ? (int)(M - m0) : MR, fetch = !panel && m0 == 0;
            if (nr < NR) { tile(x, K, wt, wk, ws, m0, mr, wn, nr, N, y + n0 - wn, fetch); continue; }
            switch (mr) {
            case 4: tile(x, K, wt, wk, ws, m0, 4, wn, NR, N, y + n0 - wn, fetch); break;
            case 3: tile(x, K, wt, wk, ws, m0, 3, wn, NR, N, y + n0 - wn, fetch); break;
            case 2: tile(x, K, wt, wk, ws, m0, 2, wn, NR, N, y + n0 - wn, fetch); break;
            default: tile(x, K, wt, wk, ws, m0, 1, wn, NR, N, y + n0 - wn, fetch);
            }
        }
    }
}
#endif
