/* KV4 codes and queries in the form of integer dot products, shared by the
 * decode kernel's VNNI scores (paged_decode_vnni.h) and the prefill kernel's
 * AMX tiles (paged_prefill_amx.h), so that both make a score by the same
 * exact integer sums and the same float steps. Include inside an AVX-512
 * (F/BW/VL/DQ) region, after lane_mask.h.
 *
 * The query is written as one 22-bit integer per channel, Q = round(q / sq)
 * with sq = max|q| / 2^21, in three signed 8-bit digits, Q = 65536 a + 256 b
 * + c, so that a signed x unsigned byte product (vpdpbusd, tdpbsud) sums
 * Q . u exactly in INT32 per digit. A head's digits are laid out so that the
 * packed rows' bytes need no shuffle: half h of a digit holds the channels of
 * nibble h, and its dword i those of packed bytes 4i .. 4i + 3. */
#ifndef QOQSERVE_KV4_DIGITS_H
#define QOQSERVE_KV4_DIGITS_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

enum { QP_TAIL = 5 };  /* ints after a head's digits: sq, sq * sum Q (float bits), 8 * sum of each digit */

/* ints per query head: 3 digits x 2 nibble halves x D/8 dwords, then the tail */
static inline int64_t qp_stride(int D) { return 6 * (int64_t)(D / 8) + QP_TAIL; }

/* v -> its low signed 8-bit digit per lane: v - digit is a multiple of 256 */
static inline __m512i digit_lo(__m512i v) {
    const __m512i k128 = _mm512_set1_epi32(128);
    return _mm512_sub_epi32(_mm512_xor_si512(_mm512_and_si512(v, _mm512_set1_epi32(255)), k128), k128);
}

/* q [D] (channel order) times qscale -> a head's digits: byte r of dword
 * (digit p, half h, i) is channel 8i + 2r + h, the channel of nibble h of
 * packed byte 4i + r; so half h holds channels h, h + 2, ... in order. Once
 * per (sequence, chunk, head): vector code, or it costs as much as the scores. */
static inline __attribute__((always_inline)) void kv4_query_digits(const float *q, float qscale, const int D,
                                                                   int32_t *out) {
    const int nd = D / 8;
    const __m512 qs = _mm512_set1_ps(qscale);
    __m512 mx = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 16) {
        const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(lane_mask(D - d), q + d), qs);
        mx = _mm512_max_ps(mx, _mm512_abs_ps(x));
    }
    const float m = _mm512_reduce_max_ps(mx), sq = m > 0.f ? m / 2097152.f : 1.f;
    const __m512 inv = _mm512_set1_ps(qscale / sq);
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    __m512i sums[3] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
    int8_t *bytes = (int8_t *)out;
    for (int d = 0; d < D; d += 32) {
        const __m512 x0 = _mm512_maskz_loadu_ps(lane_mask(D - d), q + d);
        const __m512 x1 = _mm512_maskz_loadu_ps(lane_mask(D - d - 16), q + d + 16);
        const __mmask16 valid = lane_mask((D - d) / 2);  /* D is even: as many odd channels as even */
        for (int h = 0; h < 2; h++) {
            const __m512 x = _mm512_permutex2var_ps(x0, h ? odd : even, x1);
            const __m512i Q = _mm512_cvtps_epi32(_mm512_mul_ps(x, inv));  /* |Q| <= 2^21, to nearest */
            const __m512i c = digit_lo(Q), r1 = _mm512_srai_epi32(_mm512_sub_epi32(Q, c), 8), b = digit_lo(r1);
            const __m512i dig[3] = {_mm512_srai_epi32(_mm512_sub_epi32(r1, b), 8), b, c};  /* |a| <= 33 */
            for (int p = 0; p < 3; p++) {
                _mm_mask_storeu_epi8(bytes + (int64_t)(2 * p + h) * nd * 4 + d / 2, valid, _mm512_cvtepi32_epi8(dig[p]));
                sums[p] = _mm512_add_epi32(sums[p], dig[p]);
            }
        }
    }
    int32_t s[3];
    for (int p = 0; p < 3; p++) s[p] = _mm512_reduce_add_epi32(sums[p]);
    const float qsum = sq * (65536.f * (float)s[0] + 256.f * (float)s[1] + (float)s[2]);
    memcpy(out + 6 * nd, &sq, 4);
    memcpy(out + 6 * nd + 1, &qsum, 4);
    for (int p = 0; p < 3; p++) out[6 * nd + 2 + p] = 8 * s[p];
}

/* 16 packed rows (n valid), dwords 8s.. of each (nw <= 8 of them) -> lo[i], hi[i]:
 * the codes of dword 8s + i, one token per 32-bit lane, low / high nibbles */
static inline __attribute__((always_inline)) void transpose_codes(const uint8_t *rows, int64_t ss, int n,
                                                                  int s, const int nw, __m512i *lo, __m512i *hi) {
    const __mmask8 dm = (__mmask8)((1u << nw) - 1u);
    __m512i z[8], t[8], u[8];
    for (int r = 0; r < 8; r++) {  /* rows r and r + 8 side by side; rows past n read as zero codes */
        const uint8_t *a = rows + (int64_t)r * ss + 32 * s, *b = a + 8 * ss;
        const __m256i x = r >= n ? _mm256_setzero_si256()
                          : nw == 8 ? _mm256_loadu_si256((const __m256i *)a) : _mm256_maskz_loadu_epi32(dm, a);
        const __m256i y = r + 8 >= n ? _mm256_setzero_si256()
                          : nw == 8 ? _mm256_loadu_si256((const __m256i *)b) : _mm256_maskz_loadu_epi32(dm, b);
        z[r] = _mm512_inserti64x4(_mm512_castsi256_si512(x), y, 1);
    }
    for (int k = 0; k < 4; k++) {
        t[2 * k] = _mm512_unpacklo_epi32(z[2 * k], z[2 * k + 1]);
        t[2 * k + 1] = _mm512_unpackhi_epi32(z[2 * k], z[2 * k + 1]);
    }
    for (int g = 0; g < 2; g++) {  /* u[4g + k]: rows 4g.. (and 8 + 4g..) of dwords k and k + 4 */
        u[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
        u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
    }
    const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), second = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    const __m512i nib = _mm512_set1_epi8(0x0f);
    for (int k = 0; k < 4; k++) {
        const __m512i o[2] = {_mm512_permutex2var_epi64(u[k], first, u[4 + k]),
                              _mm512_permutex2var_epi64(u[k], second, u[4 + k])};
        for (int e = 0; e < 2; e++) {
            if (k + 4 * e >= nw) continue;
            lo[k + 4 * e] = _mm512_and_si512(o[e], nib);
            hi[k + 4 * e] = _mm512_and_si512(_mm512_srli_epi16(o[e], 4), nib);
        }
    }
}

/* 16 keys' scores from a head's three INT32 digit sums Q_p . (u - 8) (one key
 * per lane), its digits' tail (kv4_query_digits), the keys' scales and zeros - 8:
 *   scale * sq * (Q . (u - 8) - (zero - 8) * sum Q),
 * the fp32 path's formula with the centring done exactly in integers; the
 * only rounding beyond fp32's is Q's (2^-22 of max|q| per channel). */
static inline __attribute__((always_inline)) __m512 kv4_score_centred(const __m512i sum[3], const int32_t *tail,
                                                                       __m512 scale, __m512 zero) {
    float sq, qsum;
    memcpy(&sq, tail, 4);
    memcpy(&qsum, tail + 1, 4);
    __m512 P = _mm512_cvtepi32_ps(sum[2]);
    P = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[1]), _mm512_set1_ps(256.f), P);
    P = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[0]), _mm512_set1_ps(65536.f), P);
    return _mm512_mul_ps(scale, _mm512_fnmadd_ps(zero, _mm512_set1_ps(qsum), _mm512_mul_ps(_mm512_set1_ps(sq), P)));
}

/* the same from the sums Q_p . u, centred here (tail[2 + p] = 8 sum(digit p)) */
static inline __attribute__((always_inline)) __m512 kv4_score(const __m512i sum[3], const int32_t *tail,
                                                               __m512 scale, __m512 zero) {
    const __m512i c[3] = {_mm512_sub_epi32(sum[0], _mm512_set1_epi32(tail[2])),
                          _mm512_sub_epi32(sum[1], _mm512_set1_epi32(tail[3])),
                          _mm512_sub_epi32(sum[2], _mm512_set1_epi32(tail[4]))};
    return kv4_score_centred(c, tail, scale, zero);
}

#endif
