/* dense_attention_f64.c's task for CPUs with AVX2 + FMA but no AVX-512.
 *
 * Same bits as the AVX-512 task: a tile's 8 key lanes are two 4-lane halves,
 * and every lane sees the same operations in the same order (the score's FMA
 * chain over d, the exact max, the same exp polynomial, the per-lane running
 * sums, the P x V FMA chain over keys); the row sums are reduced in the tree
 * _mm512_reduce_add_pd uses (upper half + lower half, twice, then the last
 * pair). scalef has no AVX2 form: p * 2^n is two multiplications by normal
 * powers of two, the first exact, so the one rounding is scalef's.
 */
#define F64_AVX2 __attribute__((target("avx2,fma")))

F64_AVX2 static inline __m256d pow2_pd(__m128i e) {  /* 2^e for -1022 <= e <= 1023 */
    const __m256i biased = _mm256_add_epi64(_mm256_cvtepi32_epi64(e), _mm256_set1_epi64x(1023));
    return _mm256_castsi256_pd(_mm256_slli_epi64(biased, 52));
}

/* exp_pd of the AVX-512 path, 4 lanes */
F64_AVX2 static inline __m256d exp_pd_avx2(__m256d x) {
    x = _mm256_max_pd(x, _mm256_set1_pd(-746.0));
    const __m256d n = _mm256_round_pd(_mm256_mul_pd(x, _mm256_set1_pd(LOG2E)),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256d r = _mm256_fnmadd_pd(n, _mm256_set1_pd(LN2_HI), x);
    r = _mm256_fnmadd_pd(n, _mm256_set1_pd(LN2_LO), r);
    __m256d p = _mm256_set1_pd(INV_FACT[0]);
    for (int i = 1; i < 13; i++) p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(INV_FACT[i]));
    const __m128i ni = _mm256_cvtpd_epi32(n);  /* -1077 <= n <= 0, integral */
    const __m128i n1 = _mm_srai_epi32(ni, 1);
    return _mm256_mul_pd(_mm256_mul_pd(p, pow2_pd(n1)), pow2_pd(_mm_sub_epi32(ni, n1)));
}

F64_AVX2 static inline double max_pd_avx2(__m256d lo, __m256d hi) {
    const __m256d m = _mm256_max_pd(lo, hi);
    const __m128d h = _mm_max_pd(_mm256_castpd256_pd128(m), _mm256_extractf128_pd(m, 1));
    return _mm_cvtsd_f64(_mm_max_sd(h, _mm_unpackhi_pd(h, h)));
}

/* _mm512_reduce_add_pd's order on the 8 lanes lo | hi */
F64_AVX2 static inline double sum_pd_avx2(__m256d lo, __m256d hi) {
    const __m256d s = _mm256_add_pd(hi, lo);
    const __m128d t = _mm_add_pd(_mm256_extractf128_pd(s, 1), _mm256_castpd256_pd128(s));
    return _mm_cvtsd_f64(t) + _mm_cvtsd_f64(_mm_unpackhi_pd(t, t));
}

/* accumulate() of the AVX-512 path: o[4][D] += w[r][k] * v[k], 8 columns at a time */
F64_AVX2 static inline void accumulate_avx2(double *o, const double *w, const double *v, int n, int D) {
    for (int c0 = 0; c0 < D; c0 += 8) {
        __m256d a[4][2];
        for (int r = 0; r < 4; r++)
            for (int u = 0; u < 2; u++) a[r][u] = _mm256_loadu_pd(o + r * D + c0 + 4 * u);
        for (int k = 0; k < n; k++) {
            const __m256d x0 = _mm256_loadu_pd(v + (int64_t)k * D + c0), x1 = _mm256_loadu_pd(v + (int64_t)k * D + c0 + 4);
            for (int r = 0; r < 4; r++) {
                const __m256d wr = _mm256_set1_pd(w[r * KT + k]);
                a[r][0] = _mm256_fmadd_pd(wr, x0, a[r][0]);
                a[r][1] = _mm256_fmadd_pd(wr, x1, a[r][1]);
            }
        }
        for (int r = 0; r < 4; r++)
            for (int u = 0; u < 2; u++) _mm256_storeu_pd(o + r * D + c0 + 4 * u, a[r][u]);
    }
}

/* scores of 4 queries (q rows D apart) against one 8-key tile: s[b][half] */
F64_AVX2 static inline void scores_avx2(const double *q, const double *ktile, int D, __m256d s[4][2]) {
    __m256d a[4][2];
    for (int b = 0; b < 4; b++) a[b][0] = a[b][1] = _mm256_setzero_pd();
    for (int d = 0; d < D; d++) {
        const __m256d k0 = _mm256_loadu_pd(ktile + d * KT), k1 = _mm256_loadu_pd(ktile + d * KT + 4);
        for (int b = 0; b < 4; b++) {
            const __m256d qb = _mm256_set1_pd(q[b * D + d]);
            a[b][0] = _mm256_fmadd_pd(qb, k0, a[b][0]);
            a[b][1] = _mm256_fmadd_pd(qb, k1, a[b][1]);
        }
    }
    for (int b = 0; b < 4; b++) s[b][0] = a[b][0], s[b][1] = a[b][1];
}

F64_AVX2 static void task_avx2(const job *j, int h, int64_t i0, double *buf) {
    const int D = j->D, hk = h / (j->H / j->Hkv);
    const int rows = (int)(j->lq - i0 < QB ? j->lq - i0 : QB);
    double *q = buf, *o = q + QB * D, *w = o + QB * D, m[QB];
    __m256d l[QB][2];
    start_task(j, h, i0, rows, q, o, m);
    for (int r = 0; r < QB; r++) l[r][0] = l[r][1] = _mm256_setzero_pd();
    const double *kt = j->kt + (int64_t)hk * j->tiles * D * KT, *vd = j->vd + (int64_t)hk * j->lk * D;
    const int64_t last = i0 + rows - 1 + j->offset;  /* the last key the block sees */
    const __m256d lane_lo = _mm256_setr_pd(0, 1, 2, 3), lane_hi = _mm256_setr_pd(4, 5, 6, 7);
    for (int64_t t = 0; t * KT <= last; t++) {
        const int64_t k0 = t * KT;
        const int n = (int)(last + 1 - k0 < KT ? last + 1 - k0 : KT);
        __m256d sc[QB][2];
        scores_avx2(q, kt + t * D * KT, D, sc);
        scores_avx2(q + 4 * D, kt + t * D * KT, D, sc + 4);
        for (int b = 0; b < QB; b++) {
            const int64_t see = i0 + b + j->offset - k0 + 1;  /* keys of this tile row b sees */
            if (b >= rows || see <= 0) {
                _mm256_storeu_pd(w + b * KT, _mm256_setzero_pd());
                _mm256_storeu_pd(w + b * KT + 4, _mm256_setzero_pd());
                continue;
            }
            const __m256d seen = _mm256_set1_pd((double)(see < KT ? see : KT));
            const __m256d ok_lo = _mm256_cmp_pd(lane_lo, seen, _CMP_LT_OQ), ok_hi = _mm256_cmp_pd(lane_hi, seen, _CMP_LT_OQ);
            const __m256d minus_inf = _mm256_set1_pd(-INFINITY);
            const double mx = max_pd_avx2(_mm256_blendv_pd(minus_inf, sc[b][0], ok_lo),
                                          _mm256_blendv_pd(minus_inf, sc[b][1], ok_hi));
            if (mx > m[b]) {  /* rescale what was summed under the old max */
                const double f = exp(m[b] - mx);
                l[b][0] = _mm256_mul_pd(l[b][0], _mm256_set1_pd(f));
                l[b][1] = _mm256_mul_pd(l[b][1], _mm256_set1_pd(f));
                for (int d = 0; d < D; d++) o[b * D + d] *= f;
                m[b] = mx;
            }
            const __m256d mb = _mm256_set1_pd(m[b]);
            const __m256d e0 = _mm256_and_pd(ok_lo, exp_pd_avx2(_mm256_sub_pd(sc[b][0], mb)));
            const __m256d e1 = _mm256_and_pd(ok_hi, exp_pd_avx2(_mm256_sub_pd(sc[b][1], mb)));
            l[b][0] = _mm256_add_pd(l[b][0], e0);
            l[b][1] = _mm256_add_pd(l[b][1], e1);
            _mm256_storeu_pd(w + b * KT, e0);
            _mm256_storeu_pd(w + b * KT + 4, e1);
        }
        accumulate_avx2(o, w, vd + k0 * D, n, D);
        accumulate_avx2(o + 4 * D, w + 4 * KT, vd + k0 * D, n, D);
    }
    for (int r = 0; r < rows; r++) {
        const double inv = 1.0 / sum_pd_avx2(l[r][0], l[r][1]);
        float *dst = j->out + ((i0 + r) * j->H + h) * D;
        for (int d = 0; d < D; d++) dst[d] = (float)(o[r * D + d] * inv);
    }
}
