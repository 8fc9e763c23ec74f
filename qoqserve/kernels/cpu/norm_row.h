/* One row of the residual add + RMSNorm, shared by elementwise.c (the
 * standalone ops) and w4a8_gemm.c (fused into a linear's input quantization),
 * so that the two round alike bit for bit. Include after bf16.h and
 * silu_mul_row.h (as_stored); build with -ffp-contract=off. */
#ifndef QOQSERVE_NORM_ROW_H
#define QOQSERVE_NORM_ROW_H
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { NORM_LANES = 16 };

/* a row to fp32 / from fp32 (bf16: rounded to nearest even) */
static inline void load_row(const void *x, int bf16, int64_t i, int64_t n, float *out) {
    if (!bf16) { memcpy(out, (const float *)x + i, sizeof(float) * (size_t)n); return; }
    const uint16_t *h = (const uint16_t *)x + i;
    for (int64_t k = 0; k < n; k++) out[k] = bf16_to_float(h[k]);
}

static inline void store_row(const float *v, int64_t n, void *y, int bf16, int64_t i) {
    if (!bf16) { memcpy((float *)y + i, v, sizeof(float) * (size_t)n); return; }
    for (int64_t k = 0; k < n; k++) ((uint16_t *)y)[i + k] = float_to_bf16(v[k]);
}

/* the values a bf16 tensor would hold (no-op for fp32) */
static inline void round_row(float *v, int64_t n, int bf16) {
    if (!bf16) return;
    for (int64_t k = 0; k < n; k++) v[k] = as_stored(v[k], 1);
}

/* sum of squares in a fixed order: 16 lanes (lane l: k = l mod 16), then
 * pairwise l + 8, + 4, + 2, + 1; written so the lanes vectorize */
static inline __attribute__((always_inline)) float sum_squares(const float *v, int64_t n) {
    float s[NORM_LANES] = {0};
    int64_t k = 0;
    for (; k + NORM_LANES <= n; k += NORM_LANES)
        for (int l = 0; l < NORM_LANES; l++) s[l] += v[k + l] * v[k + l];
    for (int l = 0; k + l < n; l++) s[l] += v[k + l] * v[k + l];
    for (int h = NORM_LANES / 2; h >= 1; h /= 2)
        for (int l = 0; l < h; l++) s[l] = s[l] + s[l + h];
    return s[0];
}

/* xv (fp32, the row as stored) -> w * round(x / rms(x)) in place, each value
 * as the activation dtype holds it */
static inline __attribute__((always_inline)) void norm_row(float *xv, const float *wv, int64_t K, float eps, int bf16) {
    const float r = 1.0f / sqrtf(sum_squares(xv, K) / (float)K + eps);
    for (int64_t k = 0; k < K; k++) xv[k] = xv[k] * r;
    round_row(xv, K, bf16);
    for (int64_t k = 0; k < K; k++) xv[k] = wv[k] * xv[k];
    round_row(xv, K, bf16);
}

/* row t of h (T x K, contiguous) + row t of d (d NULL: no add) into xv[K],
 * as h holds it; with store, also written back to h */
static inline __attribute__((always_inline)) void add_row(void *h, const void *d, int64_t t, int64_t K, int bf16,
                                                          float *xv, int store) {
    load_row(h, bf16, t * K, K, xv);
    if (d) {
        for (int64_t k = 0; k < K; k++) xv[k] = xv[k] + load(d, bf16, t * K + k);
        round_row(xv, K, bf16);
        if (store) store_row(xv, K, h, bf16, t * K);
    }
}

/* add_row, then its norm into xv[K]; wv: the norm weight as fp32 */
static inline __attribute__((always_inline)) void add_norm_row(void *h, const void *d, const float *wv, int64_t t, int64_t K, float eps,
                                int bf16, float *xv, int store) {
    add_row(h, d, t, K, bf16, xv, store);
    norm_row(xv, wv, K, eps, bf16);
}
#endif
