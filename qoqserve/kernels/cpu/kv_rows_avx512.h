/* The AVX-512 row conversion and exp2 shared by the CPU attention kernels
 * (included after kv_rows.h). Compiled for AVX-512 F/BW/VL/DQ by target
 * pragmas whatever -march says; call only after avx512_supported().
 * Defines KV_AVX512 where the compiler can build it and the build is not
 * for a CPU without AVX-512 (QOQ_NO_AVX512, build.py's absent_isa_flags). */
#ifndef QOQSERVE_KV_ROWS_AVX512_H
#define QOQSERVE_KV_ROWS_AVX512_H
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(QOQ_NO_AVX512)
#define KV_AVX512 1
#include <immintrin.h>
#include "lane_mask.h"

/* Everything between KV_AVX512_BEGIN and KV_AVX512_END is compiled for
 * AVX-512 whatever -march says (the kernels' own code uses them too). */
#if defined(__clang__)
#define KV_AVX512_BEGIN \
    _Pragma("clang attribute push(__attribute__((target(\"avx512f,avx512bw,avx512vl,avx512dq,fma,f16c\"))), apply_to = function)")
#define KV_AVX512_END _Pragma("clang attribute pop")
#else
#define KV_AVX512_BEGIN _Pragma("GCC push_options") _Pragma("GCC target(\"avx512f,avx512bw,avx512vl,avx512dq,fma,f16c\")")
#define KV_AVX512_END _Pragma("GCC pop_options")
#endif

KV_AVX512_BEGIN

static int avx512_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

/* 2^x, x <= 0: exact reduction x = n + r (|r| <= 1/2), degree-7 Taylor of
 * e^(r ln 2) (truncation < 6e-9), scalef for 2^n (underflows to 0, no NaN) */
static inline __m512 exp2_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.525273380405984e-05f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.5403530393381608e-04f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3333558146428443e-03f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.618129107628477e-03f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.550410866482158e-02f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.402265069591007e-01f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.931471805599453e-01f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* softcap_log2 (kv_rows.h) of 16 scores in log2 units: cap2 tanh(x / cap2) */
static inline __m512 softcap_ps(__m512 x, float cap2) {
    const __m512 one = _mm512_set1_ps(1.f), k = _mm512_set1_ps(-2.8853900817779268f / cap2);  /* -2 log2 e / cap2 */
    const __m512 e = exp2_ps(_mm512_mul_ps(_mm512_abs_ps(x), k));
    const __m512 t = _mm512_mul_ps(_mm512_set1_ps(cap2), _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e)));
    const __m512 signed_t = _mm512_or_ps(t, _mm512_and_ps(x, _mm512_set1_ps(-0.f)));
    return _mm512_mask_mov_ps(signed_t, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x);  /* NaN stays NaN */
}

/* Planar rows (KV4, bf16) hold channels 32c + 2i in slot 32c + i and 32c + 2i + 1
 * in slot 32c + 16 + i (channel_of): these move 32 channels between the two orders. */
static inline __m512i planar_even(void) {
    return _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
}
static inline __m512i planar_low(void) {
    return _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
}

/* one query row [D] times scale -> dst[np] in slot order, zero past D */
static inline __attribute__((always_inline)) void load_query(const float *src, const int fmt, const int D,
                                                              const int np, const __m512 scale, float *dst) {
    if (!planar(fmt)) {
        for (int c = 0; c < np; c += 16)
            _mm512_store_ps(dst + c, _mm512_mul_ps(_mm512_maskz_loadu_ps(lane_mask(D - c), src + c), scale));
        return;
    }
    const __m512i even = planar_even(), odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    for (int c = 0; c < np; c += 32) {
        const __m512 a = _mm512_mul_ps(_mm512_maskz_loadu_ps(lane_mask(D - c), src + c), scale);
        const __m512 b = _mm512_mul_ps(_mm512_maskz_loadu_ps(lane_mask(D - c - 16), src + c + 16), scale);
        _mm512_store_ps(dst + c, _mm512_permutex2var_ps(a, even, b));
        _mm512_store_ps(dst + c + 16, _mm512_permutex2var_ps(a, odd, b));
    }
}

/* x, or with a divisor (0 + x) / den: merge()'s last step, done on the
 * registers (storing x and loading it back to divide stalled on store
 * forwarding: masked stores then loads of the same lines) */
static inline __attribute__((always_inline)) __m512 output_value(__m512 x, const __m512 *den) {
    return den ? _mm512_div_ps(_mm512_add_ps(_mm512_setzero_ps(), x), *den) : x;
}

/* (src[np] in slot order - offset) * scale -> the D channels of dst, then
 * divided by *den unless den is NULL; by vector permutes (per element, this
 * was a visible share of both kernels) */
static inline __attribute__((always_inline)) void store_output(const float *src, const int fmt, const int D,
                                                                const int np, const __m512 offset,
                                                                const __m512 scale, const __m512 *den, float *dst) {
    if (!planar(fmt)) {
        for (int c = 0; c < np; c += 16)
            _mm512_mask_storeu_ps(dst + c, lane_mask(D - c),
                                  output_value(_mm512_mul_ps(_mm512_sub_ps(_mm512_load_ps(src + c), offset), scale), den));
        return;
    }
    const __m512i low = planar_low(), high = _mm512_add_epi32(low, _mm512_set1_epi32(8));
    for (int c = 0; c < np; c += 32) {
        const __m512 e = _mm512_sub_ps(_mm512_load_ps(src + c), offset), o = _mm512_sub_ps(_mm512_load_ps(src + c + 16), offset);
        _mm512_mask_storeu_ps(dst + c, lane_mask(D - c),
                              output_value(_mm512_mul_ps(_mm512_permutex2var_ps(e, low, o), scale), den));
        _mm512_mask_storeu_ps(dst + c + 16, lane_mask(D - c - 16),
                              output_value(_mm512_mul_ps(_mm512_permutex2var_ps(e, high, o), scale), den));
    }
}

/* Slots c0 .. c0 + 16 nv of one row (nv <= 4) as fp32, into registers
 * (masked loads: never past the row): KV4 codes - 8 and KV8 codes as they
 * are (their scale and zero are applied per block by the kernels), dense
 * values as they are; KV4 and bf16 in planar slot order (channel_of) */
static inline __attribute__((always_inline)) void slab_avx512(const uint8_t *r, const int fmt, const int D,
                                                               int c0, const int nv, __m512 *v) {
    if (fmt == KV_INT4) {
        const __m512 tbl = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
        for (int u = 0; u < nv; u += 2) {  /* 16 code bytes: 16 even, then 16 odd channels */
            const int b = (c0 + 16 * u) / 2, left = D / 2 - b;
            const __m512i x = _mm512_cvtepu8_epi32(left >= 16 ? _mm_loadu_si128((const __m128i *)(r + b))
                                                              : _mm_maskz_loadu_epi8(lane_mask(left), r + b));
            v[u] = _mm512_permutexvar_ps(x, tbl);  /* vpermps reads the low 4 bits only */
            v[u + 1] = _mm512_permutexvar_ps(_mm512_srli_epi32(x, 4), tbl);
        }
    } else if (fmt == KV_BF16) {
        for (int u = 0; u < nv; u += 2) {  /* 32 channels: the even ones, then the odd ones */
            const int ch = c0 + 16 * u, left = D - ch;
            const __m512i x = left >= 32 ? _mm512_loadu_si512(r + 2 * ch)
                                         : _mm512_maskz_loadu_epi16((__mmask32)((1ull << left) - 1), r + 2 * ch);
            v[u] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
            v[u + 1] = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xffff0000u)));
        }
    } else {
        for (int u = 0; u < nv; u++) {
            const int ch = c0 + 16 * u, left = D - ch;
            const __mmask16 k = lane_mask(left);
            if (fmt == KV_F16)
                v[u] = _mm512_cvtph_ps(left >= 16 ? _mm256_loadu_si256((const __m256i *)(r + 2 * ch))
                                                  : _mm256_maskz_loadu_epi16(k, r + 2 * ch));
            else if (fmt == KV_INT8)
                v[u] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(left >= 16 ? _mm_loadu_si128((const __m128i *)(r + ch))
                                                                          : _mm_maskz_loadu_epi8(k, r + ch)));
            else
                v[u] = left >= 16 ? _mm512_loadu_ps(r + 4 * ch) : _mm512_maskz_loadu_ps(k, r + 4 * ch);
        }
    }
}

/* slots c0 .. c0 + 16 nv of one row -> dst (nv a constant where inlined: else v lives on the stack) */
static inline __attribute__((always_inline)) void slab_store(const uint8_t *r, const int fmt, const int D, int c0,
                                                              const int nv, float *dst) {
    __m512 v[4];
    slab_avx512(r, fmt, D, c0, nv, v);
    for (int u = 0; u < nv; u++) _mm512_store_ps(dst + c0 + 16 * u, v[u]);
}

/* one row -> dst[padded(fmt, D)] fp32, the slots slab_avx512 makes */
static inline __attribute__((always_inline)) void row_avx512(const uint8_t *r, const int fmt, const int D,
                                                              float *dst) {
    const int np = padded(fmt, D);
    int c0 = 0;
    for (; c0 + 64 <= np; c0 += 64) slab_store(r, fmt, D, c0, 4, dst);
    switch ((np - c0) / 16) {
    case 1: slab_store(r, fmt, D, c0, 1, dst); break;
    case 2: slab_store(r, fmt, D, c0, 2, dst); break;
    case 3: slab_store(r, fmt, D, c0, 3, dst); break;
    default: break;
    }
}

KV_AVX512_END
#endif

#endif
