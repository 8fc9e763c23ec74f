/* The first n of an AVX-512 mask's 16 lanes (n clamped to 0..16): the one
 * helper every kernel's ragged tail uses. Include after <immintrin.h>. */
#ifndef QOQSERVE_LANE_MASK_H
#define QOQSERVE_LANE_MASK_H
#include <stdint.h>

static inline __mmask16 lane_mask(int64_t n) {
    return n >= 16 ? (__mmask16)0xffff : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1u);
}
#endif
