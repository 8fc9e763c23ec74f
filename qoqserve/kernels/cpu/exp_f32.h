/* exp_f32: e^x in fp32, shared by the kernels that must agree on it bit for
 * bit (silu_mul_row.h and its vector copy in w4a8_gemm_avx512.h) and by the
 * sampler (sample.c); tanh_f32 from it (GeGLU, soft-capping). */
#ifndef QOQSERVE_EXP_F32_H
#define QOQSERVE_EXP_F32_H
#include <stdint.h>
#include <string.h>

/* e^x in fp32 to ~1 ulp without libm, branch-free so loops over it
 * vectorize: x = n ln2 + r, |r| <= ln2/2, e^r by its degree-6 Taylor
 * polynomial. n by adding and taking off 1.5 * 2^23: not for a library built
 * with -fassociative-math, which may fold the two away. */
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

/* tanh x = sign(x) (1 - 2 / (e^2|x| + 1)) in fp32 by exp_f32, branch-free so
 * that loops over it vectorize (libm's tanhf is a call per value: it was most
 * of a Gemma prefill's MLP time). From |x| as libm and torch do, so that near
 * -1 the result is as exact as near 1 (1 + tanh x, GELU's, then agrees with
 * theirs on small outputs too); within 2.5e-7 of libm's, absolute. NaN stays NaN. */
static inline float tanh_f32(float x) {
    const float a = x < 0.0f ? -x : x, t = 1.0f - 2.0f / (exp_f32(2.0f * a) + 1.0f);
    return x != x ? x : (x < 0.0f ? -t : t);
}

#endif
