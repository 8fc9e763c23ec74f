/* Per-token INT8 activation quantization and the fp32/bf16 epilogue on AVX2,
 * shared by the INT8 linear kernels (int8_linear.c, w4a8_gemm_avx2.h): the
 * scalar reference's operations in its order (IEEE division, round to
 * nearest even, the same NaN picks of max/min), 8 lanes at once, so the same
 * bits. Include after <immintrin.h> and bf16.h; AVX2_FN is the attribute the
 * includer compiles these with (empty when the file is built for AVX2). */
#ifndef QOQSERVE_INT8_ACT_AVX2_H
#define QOQSERVE_INT8_ACT_AVX2_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "int8_round.h"

#ifndef AVX2_FN
#define AVX2_FN
#endif

AVX2_FN static inline __m256 load8_f32(const void *x, int bf16, int64_t i, int64_t n) {
    if (n < 8) {
        float tmp[8] = {0};
        for (int64_t e = 0; e < n; e++) tmp[e] = bf16 ? bf16_to_float(((const uint16_t *)x)[i + e]) : ((const float *)x)[i + e];
        return _mm256_loadu_ps(tmp);
    }
    if (bf16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)x + i);
}

/* quantize_row_scalar's numbers; padding lanes are zeros (|0| and 0/s = 0) */
AVX2_FN static void quantize_row_avx2(const void *x, int bf16, int64_t K, int64_t Kp, int8_t *q, float *scale,
                                   int32_t *qsum) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 amax = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8)  /* max(v, a) keeps a on NaN, as the scalar max */
        amax = _mm256_max_ps(_mm256_andnot_ps(sign, load8_f32(x, bf16, k, K - k)), amax);
    float lanes[8], a = 0.f;
    _mm256_storeu_ps(lanes, amax);
    for (int l = 0; l < 8; l++) a = lanes[l] > a ? lanes[l] : a;
    const float s = a > 0.f ? a / 127.f : 1.f;
    const __m256 vs = _mm256_set1_ps(s), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
    __m256i sum = _mm256_setzero_si256();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 r = _mm256_round_ps(_mm256_div_ps(load8_f32(x, bf16, k, 8), vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m256i c = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));  /* NaN -> -127, as the scalar */
        sum = _mm256_add_epi32(sum, c);
        __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
        _mm_storel_epi64((__m128i *)(q + k), _mm_packs_epi16(w16, w16));
    }
    int32_t part[8], total = 0;
    _mm256_storeu_si256((__m256i *)part, sum);
    for (int l = 0; l < 8; l++) total += part[l];
    for (; k < K; k++) {
        const float v = bf16 ? bf16_to_float(((const uint16_t *)x)[k]) : ((const float *)x)[k];
        const float r = int8_round(v, s);
        q[k] = (int8_t)r;
        total += (int32_t)r;
    }
    memset(q + K, 0, (size_t)(Kp - K));
    *scale = s;
    *qsum = total;
}

/* y[0..n) (n clamped to 8) = acc * sa * s1 (- rowsum * zs1) (+ bias), the
 * reference's order; pointers at the first of the 8 channels */
AVX2_FN static inline void store_epilogue8(__m256i acc, float sa, const float *s1, const float *zs1, float rowsum,
                                           const float *bias, void *y, int out_bf16, int64_t n) {
    if (n <= 0) return;
    n = n < 8 ? n : 8;
    float ps1[8] = {0}, pzs1[8] = {0}, pb[8] = {0}, out[8];
    if (n < 8) {  /* the ragged last block: copies, so no load passes N */
        memcpy(ps1, s1, (size_t)n * 4);
        if (zs1) memcpy(pzs1, zs1, (size_t)n * 4);
        if (bias) memcpy(pb, bias, (size_t)n * 4);
        s1 = ps1, zs1 = zs1 ? pzs1 : NULL, bias = bias ? pb : NULL;
    }
    __m256 v = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(acc), _mm256_set1_ps(sa)), _mm256_loadu_ps(s1));
    if (zs1) v = _mm256_sub_ps(v, _mm256_mul_ps(_mm256_set1_ps(rowsum), _mm256_loadu_ps(zs1)));
    if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias));
    if (!out_bf16 && n == 8) {
        _mm256_storeu_ps((float *)y, v);
        return;
    }
    _mm256_storeu_ps(out, v);
    for (int64_t e = 0; e < n; e++) {
        if (out_bf16) ((uint16_t *)y)[e] = float_to_bf16(out[e]);
        else ((float *)y)[e] = out[e];
    }
}
#endif
