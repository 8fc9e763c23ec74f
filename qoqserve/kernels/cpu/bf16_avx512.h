/* fp32/bf16 loads as fp32, and fp32 -> bf16, on AVX-512, 16 at a time; the
 * rounding is bf16.h's float_to_bf16 (round to nearest even, NaN kept NaN
 * with its quiet bit set), not vcvtneps2bf16, which flushes denormals. Include after <immintrin.h>; AVX512_FN is the attribute
 * the includer compiles it with (empty when the whole file is built for
 * AVX-512). */
#ifndef QOQSERVE_BF16_AVX512_H
#define QOQSERVE_BF16_AVX512_H

#ifndef AVX512_FN
#define AVX512_FN
#endif

/* 16 fp32 or bf16 values at x + i (lanes outside k zero) as fp32 */
AVX512_FN static inline __m512 load_f32(const void *x, int bf16, int64_t i, __mmask16 k) {
    if (bf16) {
        const __m256i h = _mm256_maskz_loadu_epi16(k, (const uint16_t *)x + i);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_maskz_loadu_ps(k, (const float *)x + i);
}

AVX512_FN static inline __m256i to_bf16(__m512 v) {
    __m512i b = _mm512_castps_si512(v), hi = _mm512_srli_epi32(b, 16);
    __m512i lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(r);
}

/* silu_mul_row.h's as_stored(v, 1) on 16 lanes: the value a bf16 tensor holds */
AVX512_FN static inline __m512 bf16_value(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(v)), 16));
}
#endif
