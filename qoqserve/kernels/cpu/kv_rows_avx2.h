/* The AVX2 row conversion, exp2 and output order shared by the CPU attention
 * kernels' AVX2 paths (included after kv_rows.h): kv_rows_avx512.h at half
 * the width, for CPUs without AVX-512 (AMD Zen 2/3, Intel client chips).
 * Compiled for AVX2 + FMA + F16C by target pragmas whatever -march says; call
 * only after avx2_supported(). Rows come out in the AVX-512 path's slot order
 * (channel_of): 16 packed KV4 bytes or 32 bf16 of a 32-channel group split
 * into their even and odd channels by a nibble mask / a 16-bit shift.
 * AVX2 has no masked byte loads, so a row's ragged tail is copied into a
 * zeroed buffer first (never a read past the row). Defines KV_AVX2 where the
 * compiler can build it. */
#ifndef QOQSERVE_KV_ROWS_AVX2_H
#define QOQSERVE_KV_ROWS_AVX2_H
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KV_AVX2 1
#include <immintrin.h>

#if defined(__clang__)
#define KV_AVX2_BEGIN \
    _Pragma("clang attribute push(__attribute__((target(\"avx2,fma,f16c\"))), apply_to = function)")
#define KV_AVX2_END _Pragma("clang attribute pop")
#else
#define KV_AVX2_BEGIN _Pragma("GCC push_options") _Pragma("GCC target(\"avx2,fma,f16c\")")
#define KV_AVX2_END _Pragma("GCC pop_options")
#endif

KV_AVX2_BEGIN

static int avx2_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

/* the first n of 8 lanes (n clamped to 0..8), for maskload / maskstore / blendv */
static inline __m256i lanes8(int64_t n) {
    const int c = n <= 0 ? 0 : n >= 8 ? 8 : (int)n;
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(c), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* sum and max of the 8 lanes, in one fixed tree */
static inline float hsum8(__m256 x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline float hmax8(__m256 x) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

/* lane i: the sum of the 8 lanes of a[i] */
static inline __m256 sums8(const __m256 *a) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* 2^x, x <= 0: the AVX-512 path's exp2_ps (same reduction and polynomial);
 * 2^n as exponent bits, n >= -126 so always a normal number */
static inline __m256 exp2_avx2(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-126.f));  /* NaN and -inf too: max returns the second operand */
    const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 r = _mm256_sub_ps(x, n);
    __m256 p = _mm256_set1_ps(1.525273380405984e-05f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.5403530393381608e-04f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3333558146428443e-03f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(9.618129107628477e-03f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.550410866482158e-02f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(2.402265069591007e-01f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(6.931471805599453e-01f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* softcap_log2 (kv_rows.h) of 8 scores in log2 units: cap2 tanh(x / cap2) */
static inline __m256 softcap_avx2(__m256 x, float cap2) {
    const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
    const __m256 k = _mm256_set1_ps(-2.8853900817779268f / cap2);  /* -2 log2 e / cap2 */
    const __m256 e = exp2_avx2(_mm256_mul_ps(_mm256_andnot_ps(sign, x), k));
    const __m256 t = _mm256_mul_ps(_mm256_set1_ps(cap2), _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e)));
    const __m256 signed_t = _mm256_or_ps(t, _mm256_and_ps(x, sign));
    return _mm256_blendv_ps(signed_t, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));  /* NaN stays NaN */
}

/* 16 bytes from p, of which n (< 16) exist: the rest zero */
static inline __m128i tail_bytes(const uint8_t *p, int n) {
    uint8_t tmp[16] = {0};
    memcpy(tmp, p, (size_t)(n > 0 ? n : 0));
    return _mm_loadu_si128((const __m128i *)tmp);
}

/* one row -> dst[padded(fmt, D)] fp32, zero (KV4: code 0) past D: KV4 codes
 * - 8 and KV8 codes as they are (their scale and zero are applied by the
 * kernel), dense values as they are */
static inline __attribute__((always_inline)) void row_avx2(const uint8_t *r, const int fmt, const int D,
                                                            float *dst) {
    const int np = padded(fmt, D);
    if (fmt == KV_INT4) {
        const __m256i low = _mm256_set1_epi32(15), eight = _mm256_set1_epi32(8);
        for (int c = 0; 32 * c < np; c++) {
            const int n = D / 2 - 16 * c;
            const __m128i x = n >= 16 ? _mm_loadu_si128((const __m128i *)(r + 16 * c)) : tail_bytes(r + 16 * c, n);
            const __m256i w0 = _mm256_cvtepu8_epi32(x), w1 = _mm256_cvtepu8_epi32(_mm_srli_si128(x, 8));
            float *o = dst + 32 * c;
            _mm256_store_ps(o, _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(w0, low), eight)));
            _mm256_store_ps(o + 8, _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(w1, low), eight)));
            _mm256_store_ps(o + 16, _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(w0, 4), eight)));
            _mm256_store_ps(o + 24, _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(w1, 4), eight)));
        }
    } else if (fmt == KV_BF16) {
        const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
        for (int c = 0; 32 * c < np; c++) {
            const int n = D - 32 * c;  /* channels left */
            __m256i x0, x1;
            if (n >= 32) {
                x0 = _mm256_loadu_si256((const __m256i *)(r + 64 * c));
                x1 = _mm256_loadu_si256((const __m256i *)(r + 64 * c + 32));
            } else {
                uint8_t tmp[64] = {0};
                memcpy(tmp, r + 64 * c, (size_t)2 * (n > 0 ? n : 0));
                x0 = _mm256_loadu_si256((const __m256i *)tmp);
                x1 = _mm256_loadu_si256((const __m256i *)(tmp + 32));
            }
            float *o = dst + 32 * c;
            _mm256_store_ps(o, _mm256_castsi256_ps(_mm256_slli_epi32(x0, 16)));
            _mm256_store_ps(o + 8, _mm256_castsi256_ps(_mm256_slli_epi32(x1, 16)));
            _mm256_store_ps(o + 16, _mm256_castsi256_ps(_mm256_and_si256(x0, high)));
            _mm256_store_ps(o + 24, _mm256_castsi256_ps(_mm256_and_si256(x1, high)));
        }
    } else {
        for (int c = 0; c < np; c += 8) {
            const int n = D - c;
            __m256 x;
            if (fmt == KV_F16)
                x = _mm256_cvtph_ps(n >= 8 ? _mm_loadu_si128((const __m128i *)(r + 2 * c)) : tail_bytes(r + 2 * c, 2 * n));
            else if (fmt == KV_INT8)
                x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(n >= 8 ? _mm_loadl_epi64((const __m128i *)(r + c))
                                                                   : tail_bytes(r + c, n)));
            else
                x = n >= 8 ? _mm256_loadu_ps((const float *)r + c) : _mm256_maskload_ps((const float *)r + c, lanes8(n));
            _mm256_store_ps(dst + c, x);
        }
    }
}

/* (src[np] in slot order - offset) * scale -> the D channels of dst: a planar
 * group's even and odd slots interleaved back by unpack + lane permutes */
static inline __attribute__((always_inline)) void store_output_avx2(const float *src, const int fmt, const int D,
                                                                    const int np, const __m256 offset,
                                                                    const __m256 scale, float *dst) {
    if (!planar(fmt)) {
        for (int c = 0; c < D; c += 8) {
            const __m256 y = _mm256_mul_ps(_mm256_sub_ps(_mm256_load_ps(src + c), offset), scale);
            if (D - c >= 8) _mm256_storeu_ps(dst + c, y);
            else _mm256_maskstore_ps(dst + c, lanes8(D - c), y);
        }
        return;
    }
    for (int c = 0; c < np; c += 32) {
        for (int half = 0; half < 2; half++) {  /* channels c + 16 half .. + 15 */
            const __m256 e = _mm256_sub_ps(_mm256_load_ps(src + c + 8 * half), offset);
            const __m256 o = _mm256_sub_ps(_mm256_load_ps(src + c + 16 + 8 * half), offset);
            const __m256 lo = _mm256_unpacklo_ps(e, o), hi = _mm256_unpackhi_ps(e, o);
            const __m256 y[2] = {_mm256_mul_ps(_mm256_permute2f128_ps(lo, hi, 0x20), scale),
                                 _mm256_mul_ps(_mm256_permute2f128_ps(lo, hi, 0x31), scale)};
            for (int k = 0; k < 2; k++) {
                const int at = c + 16 * half + 8 * k;
                if (D - at >= 8) _mm256_storeu_ps(dst + at, y[k]);
                else if (D - at > 0) _mm256_maskstore_ps(dst + at, lanes8(D - at), y[k]);
            }
        }
    }
}

KV_AVX2_END
#endif
#endif
