/* Per-token INT8 activation quantization and the epilogue on AVX-512 (its
 * fp32/bf16 loads: bf16_avx512.h), shared by the INT8 linear kernels (int8_linear.c, w4a8_gemm.c):
 * one copy of the numerics both must match bit for bit. Include after
 * <immintrin.h>; AVX512_FN is the attribute the includer compiles these with
 * (empty when the whole file is built for AVX-512, a target attribute when
 * the file picks the ISA at run time). */
#ifndef QOQSERVE_INT8_ACT_AVX512_H
#define QOQSERVE_INT8_ACT_AVX512_H
#include <stdint.h>
#include <string.h>

#include "lane_mask.h"

#ifndef AVX512_FN
#define AVX512_FN
#endif
#include "bf16_avx512.h"

/* round(x / s) as the reference's division rounds it, by a multiply: x * (1/s)
 * lies within |x/s| 2^-22 (< 4e-5 here, |x/s| <= 127) of the rounded quotient,
 * so both round to the same integer unless they sit that close to a half; a
 * vector with a lane within 2^-10 of one takes the division (rare). Only for
 * a normal s >= 2^-120 (inv finite); the caller divides otherwise. */
AVX512_FN static inline __m512 round_quotient(__m512 v, __m512 vs, __m512 inv) {
    const int near = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const __m512 y = _mm512_mul_ps(v, inv), r = _mm512_roundscale_ps(y, near);
    const __m512 off = _mm512_abs_ps(_mm512_sub_ps(y, r));  /* NaN: compares false, and NaN either way */
    if (_mm512_cmp_ps_mask(off, _mm512_set1_ps(0.5f - 0x1p-10f), _CMP_GT_OQ))
        return _mm512_roundscale_ps(_mm512_div_ps(v, vs), near);
    return r;
}

/* one row: int8 codes (zero-padded to Kp), scale amax/127, sum of the codes */
AVX512_FN static void quantize_row_avx512(const void *x, int bf16, int64_t K, int64_t Kp, int8_t *q,
                                           float *scale, int32_t *qsum) {
    /* NaN inputs are skipped, as in the scalar max; four chains in registers, one max */
    __m512 m0 = _mm512_setzero_ps(), m1 = m0, m2 = m0, m3 = m0;
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
        m0 = _mm512_max_ps(_mm512_abs_ps(load_f32(x, bf16, k, 0xffff)), m0);
        m1 = _mm512_max_ps(_mm512_abs_ps(load_f32(x, bf16, k + 16, 0xffff)), m1);
        m2 = _mm512_max_ps(_mm512_abs_ps(load_f32(x, bf16, k + 32, 0xffff)), m2);
        m3 = _mm512_max_ps(_mm512_abs_ps(load_f32(x, bf16, k + 48, 0xffff)), m3);
    }
    for (; k < K; k += 16) m0 = _mm512_max_ps(_mm512_abs_ps(load_f32(x, bf16, k, lane_mask(K - k))), m0);
    float a = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m0, m1), _mm512_max_ps(m2, m3)));
    float s = a > 0.f ? a / 127.f : 1.f;
    const int by_inverse = s >= 0x1p-120f && s <= 0x1p120f;
    __m512 vs = _mm512_set1_ps(s), inv = _mm512_set1_ps(1.f / s), lo = _mm512_set1_ps(-127.f),
           hi = _mm512_set1_ps(127.f);
    __m512i sum = _mm512_setzero_si512();
    for (k = 0; k < K; k += 16) {
        __mmask16 m = lane_mask(K - k);
        const __m512 v = load_f32(x, bf16, k, m);
        __m512 r = by_inverse ? round_quotient(v, vs, inv)
                              : _mm512_roundscale_ps(_mm512_div_ps(v, vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m512i c = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r, lo), hi));
        sum = _mm512_add_epi32(sum, c);
        _mm_mask_storeu_epi8(q + k, m, _mm512_cvtsepi32_epi8(c));
    }
    memset(q + K, 0, (size_t)(Kp - K));
    *scale = s;
    *qsum = _mm512_reduce_add_epi32(sum);
}

/* The epilogue of 16 output channels of one row (pointers at those channels):
 * acc * s_a * s1 (- rowsum * z*s1) (+ bias), in the reference's order. */
AVX512_FN static inline __m512 epilogue_value(__m512i acc, float sa, const float *s1, const float *zs1,
                                              float rowsum, const float *bias, __mmask16 k) {
    __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(acc), _mm512_set1_ps(sa)),
                             _mm512_maskz_loadu_ps(k, s1));
    if (zs1) v = _mm512_sub_ps(v, _mm512_mul_ps(_mm512_set1_ps(rowsum), _mm512_maskz_loadu_ps(k, zs1)));
    if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(k, bias));
    return v;
}

/* epilogue_value stored to y as fp32 or bf16 */
AVX512_FN static inline void store_epilogue(__m512i acc, float sa, const float *s1, const float *zs1,
                                            float rowsum, const float *bias, void *y, int out_bf16,
                                            __mmask16 k) {
    const __m512 v = epilogue_value(acc, sa, s1, zs1, rowsum, bias, k);
    if (out_bf16) _mm256_mask_storeu_epi16((uint16_t *)y, k, to_bf16(v));
    else _mm512_mask_storeu_ps((float *)y, k, v);
}

#endif
