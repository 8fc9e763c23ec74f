/* One token's K or V row of one head in each page format of
 * qoqserve/layers/kv_cache.py, as the CPU attention kernels read it: KV4
 * (UINT4 codes, two per byte, + fp16 scale and zero), KV8 (INT8 codes + fp16
 * scale), dense fp16/bf16/fp32. The portable conversion; kv_rows_avx512.h has
 * the vector one. */
#ifndef QOQSERVE_KV_ROWS_H
#define QOQSERVE_KV_ROWS_H
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "bf16.h"

enum { KV_INT4 = 0, KV_INT8 = 1, KV_F16 = 2, KV_BF16 = 3, KV_F32 = 4 };

static inline float kv_half(const uint8_t *p) { return half_to_float((uint16_t)(p[0] | (p[1] << 8))); }

/* one row (a token's K or V of one head) -> x[D], dequantized */
static inline void row_scalar(const uint8_t *r, int fmt, int D, float *x) {
    switch (fmt) {
    case KV_INT4: {
        const float s = kv_half(r + D / 2), z = kv_half(r + D / 2 + 2);
        for (int i = 0; i < D / 2; i++) {
            x[2 * i] = ((float)(r[i] & 15) - z) * s;
            x[2 * i + 1] = ((float)(r[i] >> 4) - z) * s;
        }
        break;
    }
    case KV_INT8: {
        const float s = kv_half(r + D);
        for (int d = 0; d < D; d++) x[d] = (float)(int8_t)r[d] * s;
        break;
    }
    case KV_F16:
        for (int d = 0; d < D; d++) x[d] = kv_half(r + 2 * d);
        break;
    case KV_BF16:  /* the top half of an fp32 */
        for (int d = 0; d < D; d++) {
            uint32_t bits = (uint32_t)(r[2 * d] | (r[2 * d + 1] << 8)) << 16;
            memcpy(x + d, &bits, 4);
        }
        break;
    default:
        memcpy(x, r, sizeof(float) * (size_t)D);
    }
}

/* One query row (q, already in log2 units) over n converted rows k[n][D],
 * v[n][D]: its online softmax (running max m, sum l, unnormalized acc[D])
 * moves on by those rows, in one fixed order. */
static inline void softmax_step_scalar(const float *q, const float *k, const float *v, int n, int D, float *m,
                                       float *l, float *acc) {
    float sc[16], mx = -INFINITY;  /* n <= 16: the kernels step 16 rows at a time */
    for (int i = 0; i < n; i++) {
        float dot = 0.f;
        for (int d = 0; d < D; d++) dot += q[d] * k[i * D + d];
        sc[i] = dot;
        mx = dot > mx ? dot : mx;
    }
    if (mx > *m) {  /* rescale what was summed under the old max */
        const float a = exp2f(*m - mx);
        *l *= a;
        for (int d = 0; d < D; d++) acc[d] *= a;
        *m = mx;
    }
    for (int i = 0; i < n; i++) {
        const float e = exp2f(sc[i] - *m);
        *l += e;
        for (int d = 0; d < D; d++) acc[d] += e * v[i * D + d];
    }
}
#endif
