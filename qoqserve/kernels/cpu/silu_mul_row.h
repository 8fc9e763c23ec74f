/* SiLU * mul of one row, shared by elementwise.c (the standalone op) and
 * w4a8_gemm.c (fused into down_proj's input quantization), so that the two
 * round alike bit for bit. Include after bf16.h; build with
 * -ffp-contract=off (each product and sum rounds on its own, as torch's). */
#ifndef QOQSERVE_SILU_MUL_ROW_H
#define QOQSERVE_SILU_MUL_ROW_H
#include <stdint.h>
#include <string.h>

#include "exp_f32.h"

/* the value a bf16 tensor would hold (identity for fp32) */
static inline float as_stored(float v, int bf16) { return bf16 ? bf16_to_float(float_to_bf16(v)) : v; }

/* silu(g) * u, silu(g) = g / (1 + e^-g), with the roundings of torch's
 * F.silu(gate) * up in the tensors' dtype: fp32 or bf16 (g and u as bf16
 * holds them; silu rounded, then the product) */
static inline float silu_mul_value(float g, float u, int bf16) {
    if (bf16) return as_stored(as_stored(g / (1.0f + exp_f32(-g)), 1) * u, 1);
    return g / (1.0f + exp_f32(-g)) * u;
}

/* out[i] = silu_mul_value(gate[i], up[i]); gate and up: n elements each.
 * Inlined so each caller's target (AVX-512 or not) vectorizes it. */
static inline __attribute__((always_inline)) void silu_mul_row(const void *gate, const void *up, int bf16,
                                                               int64_t n, float *out) {
    if (bf16) {
        const uint16_t *g = (const uint16_t *)gate, *u = (const uint16_t *)up;
        for (int64_t i = 0; i < n; i++) out[i] = silu_mul_value(bf16_to_float(g[i]), bf16_to_float(u[i]), 1);
        return;
    }
    const float *g = (const float *)gate, *u = (const float *)up;
    for (int64_t i = 0; i < n; i++) out[i] = silu_mul_value(g[i], u[i], 0);
}

#endif
