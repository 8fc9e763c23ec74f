/* exp_f32: e^x in fp32, shared by the kernels that must agree on it bit for
 * bit (silu_mul_row.h and its vector copy in w4a8_gemm_avx512.h) and by the
 * sampler (sample.c). */
#ifndef QOQSERVE_EXP_F32_H
#define QOQSERVE_EXP_F32_H
#include <stdint.h>
#include <string.h>

/* e^x in fp32 to ~1 ulp without libm, branch-free so loops over it
 * vectorize: x = n ln2 + r, |r| <= ln2/2, e^r by its degree-6 Taylor polynomial */
static inline float exp_f32(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  /* round to nearest */
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t e = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &e, 4);
    return p * scale;
}

#endif
