/* argmax_row: torch.argmax's answer for one row of fp32 logits (the first
 * NaN, else the first maximum), shared by elementwise.c's greedy tokens and a
 * decode burst's penalized rows (burst_penalties.c). AVX-512: one vectorized
 * pass for the maximum, then the first lane that holds it. */
#ifndef QOQSERVE_ARGMAX_ROW_H
#define QOQSERVE_ARGMAX_ROW_H
#include <math.h>
#include <stdint.h>

#ifdef __AVX512F__
#include <immintrin.h>
#include "lane_mask.h"
/* the first k with mask bit set in the row's chunks (want: NaN or == mx) */
static int64_t first_match(const float *r, int64_t V, float mx, int want_nan) {
    const __m512 target = _mm512_set1_ps(mx);
    for (int64_t k = 0; k < V; k += 16) {
        const __mmask16 in = lane_mask(V - k);
        const __m512 v = _mm512_maskz_loadu_ps(in, r + k);
        const __mmask16 hit = in & (want_nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)
                                             : _mm512_cmp_ps_mask(v, target, _CMP_EQ_OQ));
        if (hit) return k + __builtin_ctz(hit);
    }
    return 0;
}

static int64_t argmax_row(const float *r, int64_t V) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    __m512 m[4] = {ninf, ninf, ninf, ninf};
    __mmask16 nan = 0;
    int64_t k = 0;
    for (; k + 64 <= V; k += 64)
        for (int u = 0; u < 4; u++) {
            const __m512 v = _mm512_loadu_ps(r + k + 16 * u);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            m[u] = _mm512_max_ps(m[u], v);
        }
    for (; k < V; k += 16) {
        const __mmask16 in = lane_mask(V - k);
        const __m512 v = _mm512_mask_loadu_ps(ninf, in, r + k);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        m[0] = _mm512_max_ps(m[0], v);
    }
    const float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m[0], m[1]), _mm512_max_ps(m[2], m[3])));
    return first_match(r, V, mx, nan != 0);
}
#else
static int64_t argmax_row(const float *r, int64_t V) {
    int64_t best = 0;
    for (int64_t i = 0; i < V; i++) {
        if (r[i] != r[i]) return i;
        if (r[i] > r[best]) best = i;
    }
    return best;
}
#endif

#endif
