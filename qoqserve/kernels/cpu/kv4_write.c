/* KV4 page write for CPUs: quantize each new token's K and V per head
 * (asymmetric UINT4, fp16 scale and zero) and store the rows into their page
 * slots, in one call per layer instead of ~40 small torch ops.
 *
 * Byte-identical to qoq_ref.quantize_kv4 + pack_uint4 + the Int4 layout's
 * write: fp32 min/max, scale = fp16(max((hi - lo) / 15, amax * 2^-14)) (2^-24
 * if that is 0), zero = fp16(-lo / scale), code = round_half_even(x / scale +
 * zero) clamped to 0..15, low nibble = even channel; the row ends with the
 * scale's and the zero's fp16 bytes. Compiled without FMA contraction, as the
 * reference rounds the division and the addition separately.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "team.h"
#ifdef __AVX512F__
#include <immintrin.h>
#include "lane_mask.h"
#include "bf16_avx512.h"
#endif

enum { CHUNK = 256 };  /* values widened at a time: any head_dim, in L1 */

/* min and max of the D values as loops in order find them: NaNs skipped, and
 * on a tie the earlier value kept, which only a zero's sign can tell (the
 * min's sign reaches the stored zero point: -lo / scale) */
static void row_min_max(const void *x, int bf16, int64_t base, int D, float *lo, float *hi) {
    float l = INFINITY, h = -INFINITY;
#ifdef __AVX512F__
    __m512 lv = _mm512_set1_ps(INFINITY), hv = _mm512_set1_ps(-INFINITY);
    for (int d = 0; d < D; d += 16) {  /* per lane in order: vminps(v, lo) is v < lo ? v : lo */
        const __mmask16 k = lane_mask(D - d);
        const __m512 v = load_f32(x, bf16, base + d, k);
        lv = _mm512_mask_min_ps(lv, k, v, lv);
        hv = _mm512_mask_max_ps(hv, k, v, hv);
    }
    l = _mm512_reduce_min_ps(lv), h = _mm512_reduce_max_ps(hv);
    if (l == 0.f)  /* -0 or +0: the first zero's, as the in-order loop keeps it */
        for (int d = 0; d < D; d++)
            if (load(x, bf16, base + d) == 0.f) { l = load(x, bf16, base + d); break; }
#else
    for (int d = 0; d < D; d++) {
        const float v = load(x, bf16, base + d);
        l = v < l ? v : l;
        h = v > h ? v : h;
    }
#endif
    *lo = l, *hi = h;
}

#ifdef __AVX512F__
/* codes of D values (D even) into D/2 bytes: the loop below per value (x / s
 * + z rounded half to even, clamped to 0..15; NaN gives 0, as the integer
 * conversion there does), 32 values a step; two codes to a byte, low nibble
 * first: code 2i + 1 shifted down from its 64-bit lane's high half */
static void codes_avx512(const void *x, int bf16, int64_t base, int D, float s, float z, uint8_t *row) {
    const __m512 vs = _mm512_set1_ps(s), vz = _mm512_set1_ps(z), top = _mm512_set1_ps(15.f);
    for (int d = 0; d < D; d += 32) {
        __m128i half[2];
        for (int h = 0; h < 2; h++) {
            const __m512 v = load_f32(x, bf16, base + d + 16 * h, lane_mask(D - d - 16 * h));
            __m512 q = _mm512_roundscale_ps(_mm512_add_ps(_mm512_div_ps(v, vs), vz),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            q = _mm512_min_ps(_mm512_max_ps(q, _mm512_setzero_ps()), top);  /* NaN: max gives 0 */
            const __m512i c = _mm512_cvtps_epi32(q);
            half[h] = _mm512_cvtepi64_epi8(_mm512_or_si512(c, _mm512_srli_epi64(c, 28)));
        }
        _mm_mask_storeu_epi8(row + d / 2, (__mmask16)lane_mask((D - d) / 2), _mm_unpacklo_epi64(half[0], half[1]));
    }
}
#endif

/* one head of one token: D values -> D/2 code bytes + fp16 scale + fp16 zero.
 * The codes come from codes_avx512, elsewhere from plain loops over a widened
 * chunk, so that they vectorize (the same IEEE operations per value as one
 * at a time); the min/max are row_min_max's */
static void quantize_row(const void *x, int bf16, int64_t base, int D, uint8_t *row) {
    float lo, hi;
    row_min_max(x, bf16, base, D, &lo, &hi);
    float amax = fabsf(lo) > fabsf(hi) ? fabsf(lo) : fabsf(hi);
    float range = (hi - lo) / 15.f, floor_ = amax * 0x1p-14f;
    _Float16 scale = (_Float16)(range > floor_ ? range : floor_);
    if (!(scale > 0)) scale = (_Float16)0x1p-24f;
    const float s = (float)scale;
    _Float16 zero = (_Float16)(-lo / s);
    const float z = (float)zero;
#ifdef __AVX512F__
    codes_avx512(x, bf16, base, D, s, z, row);
#else
    for (int d0 = 0; d0 < D; d0 += CHUNK) {
        const int n = D - d0 < CHUNK ? D - d0 : CHUNK;  /* even: D is */
        float v[CHUNK];
        uint8_t c[CHUNK];
        for (int d = 0; d < n; d++) v[d] = load(x, bf16, base + d0 + d);
        for (int d = 0; d < n; d++) {
            float q = nearbyintf(v[d] / s + z);
            q = q < 0.f ? 0.f : (q > 15.f ? 15.f : q);
            c[d] = (uint8_t)(int)q;
        }
        for (int d = 0; d < n; d += 2) row[(d0 + d) / 2] = (uint8_t)(c[d] | (c[d + 1] << 4));
    }
#endif
    memcpy(row + D / 2, &scale, 2);
    memcpy(row + D / 2 + 2, &zero, 2);
}

/* k, v: [T, Hkv, D] fp32 or bf16, contiguous; cache: uint8 [slots, 2, Hkv, D/2 + 4];
 * slots: int64 [T] */
void kv4_write(const void *k, const void *v, int bf16, const int64_t *slots, int64_t T, int Hkv,
               int D, uint8_t *cache, int threads) {
    const int64_t row = D / 2 + 4, n = T * Hkv;
    TEAM_RUN(threads, n >= 32, for (int64_t i = n * tm.t / tm.T; i < n * (tm.t + 1) / tm.T; i++) {
        const int64_t t = i / Hkv, h = i % Hkv;
        uint8_t *dst = cache + slots[t] * 2 * Hkv * row + h * row;
        quantize_row(k, bf16, i * D, D, dst);
        quantize_row(v, bf16, i * D, D, dst + Hkv * row);
    });
}

/* Dense pages: copy each token's K and V rows ([Hkv * D] elements of
 * `row_bytes` bytes) to their slot in the K and V row views (slot i at byte
 * offset i * slot_bytes of k_rows / v_rows). */
void kv_copy_rows(const uint8_t *k, const uint8_t *v, int64_t row_bytes, const int64_t *slots, int64_t T,
                  uint8_t *k_rows, uint8_t *v_rows, int64_t slot_bytes) {
    for (int64_t t = 0; t < T; t++) {
        memcpy(k_rows + slots[t] * slot_bytes, k + t * row_bytes, (size_t)row_bytes);
        memcpy(v_rows + slots[t] * slot_bytes, v + t * row_bytes, (size_t)row_bytes);
    }
}
