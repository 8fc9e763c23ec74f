/* Scalar fp32 <-> bf16 (and fp16 -> fp32) and element loads shared by the CPU kernels (the
 * rounding every kernel and the torch reference agree on). */
#ifndef QOQSERVE_BF16_H
#define QOQSERVE_BF16_H
#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t float_to_bf16(float f) {  /* round to nearest even; NaN kept NaN */
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

static inline float half_to_float(uint16_t h) {  /* fp16 -> fp32; no F16C assumed */
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    float f;
    if (exp == 0) {  /* zero or subnormal: man * 2^-24 */
        f = (float)man * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    uint32_t bits = sign | ((exp + 112u) << 23) | (man << 13);  /* inf/nan never stored */
    memcpy(&f, &bits, 4);
    return f;
}

static inline float load(const void *x, int bf16, int64_t i) {
    return bf16 ? bf16_to_float(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

#endif
