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

/* The portable path's task functions, built twice on x86-64: for the
 * baseline CPU and for x86-64-v3 (AVX2 + FMA, where its loops vectorize 8
 * wide), the loader picking one for the CPU it runs on. CPUs with AVX-512
 * take the intrinsics path instead. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PORTABLE_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define PORTABLE_CLONES
#endif

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

/* 2^x for x <= 0, kv_rows_avx512.h's exp2_ps in plain C, so that the
 * compiler vectorizes it where a loop calls it (libm's exp2f is a call per
 * value): x = n + r exactly (|r| <= 1/2), the same degree-7 Taylor of
 * e^(r ln 2), 2^n as exponent bits; below 2^-126 it stays at 2^-126 * p. */
static inline float exp2_poly(float x) {
    x = x > -126.f ? x : -126.f;  /* NaN and -inf too */
    const float n = nearbyintf(x), r = x - n;
    float p = 1.525273380405984e-05f;
    p = p * r + 1.5403530393381608e-04f;
    p = p * r + 1.3333558146428443e-03f;
    p = p * r + 9.618129107628477e-03f;
    p = p * r + 5.550410866482158e-02f;
    p = p * r + 2.402265069591007e-01f;
    p = p * r + 6.931471805599453e-01f;
    p = p * r + 1.f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

/* Logit soft-capping (Gemma 2) of a score x in log2 units: cap2 tanh(x / cap2),
 * cap2 the cap times log2 e, which is cap tanh(s / cap) of the natural score s
 * in log2 units. tanh y = (1 - e^-2|y|) / (1 + e^-2|y|) with y's sign, by
 * exp2_poly so that a loop over scores vectorizes (libm's tanhf is a call per
 * score); the vector paths compute the same (softcap_ps, softcap_avx2). Not
 * exp_f32.h's tanh_f32: its rounding trick does not survive the
 * -fassociative-math these kernels are built with. The error is absolute,
 * under 1e-7 cap2, which is what the softmax sees. NaN stays NaN. */
static inline float softcap_log2(float x, float cap2) {
    const float e = exp2_poly(-2.8853900817779268f * fabsf(x) / cap2);  /* 2 log2 e */
    const float t = cap2 * ((1.f - e) / (1.f + e));
    return x != x ? x : (x < 0.f ? -t : t);
}

/* One query row (q, already in log2 units) over n converted rows k[n][D],
 * v[n][D]: its online softmax (running max m, sum l, unnormalized acc[D])
 * moves on by those rows, in one fixed order. cap2 > 0: the scores
 * soft-capped first (softcap_log2). */
static inline void softmax_step_scalar(const float *q, const float *k, const float *v, int n, int D, float *m,
                                       float *l, float *acc, float cap2) {
    float sc[16], e[16], mx = -INFINITY;  /* n <= 16: the kernels step 16 rows at a time */
    for (int i = 0; i < n; i++) {
        float dot = 0.f;
        for (int d = 0; d < D; d++) dot += q[d] * k[i * D + d];
        if (cap2 > 0.f) dot = softcap_log2(dot, cap2);
        sc[i] = dot;
        mx = dot > mx ? dot : mx;
    }
    if (mx > *m) {  /* rescale what was summed under the old max */
        const float a = exp2_poly(*m - mx);
        *l *= a;
        for (int d = 0; d < D; d++) acc[d] *= a;
        *m = mx;
    }
    for (int i = 0; i < n; i++) e[i] = exp2_poly(sc[i] - *m);  /* one vector loop */
    for (int i = 0; i < n; i++) {
        *l += e[i];
        for (int d = 0; d < D; d++) acc[d] += e[i] * v[i * D + d];
    }
}

/* ---- what the vector paths (kv_rows_avx512.h, kv_rows_avx2.h) share ---- */

/* KV4 and bf16 rows are converted planar per 32 channels: slot 32c + i holds
 * channel 32c + 2i and slot 32c + 16 + i channel 32c + 2i + 1 (i < 16), which
 * a nibble mask / a 16-bit shift yields without any shuffle at either width */
static inline int planar(int fmt) { return fmt == KV_INT4 || fmt == KV_BF16; }
static inline int padded(int fmt, int D) { return planar(fmt) ? (D + 31) / 32 * 32 : (D + 15) / 16 * 16; }
/* the channel held by slot i of a dequantized row */
static inline int channel_of(int fmt, int i) {
    if (!planar(fmt)) return i;
    const int r = i % 32;
    return i - r + (r < 16 ? 2 * r : 2 * (r - 16) + 1);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
/* an fp16 of a row by F16C: inlined into either vector path (both have it) */
__attribute__((target("f16c"))) static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}
#endif

/* fn(fmt, d) with the format and head_dim as constants: head_dim 64 and 128
 * fully unrolled, any other the same code with loops */
#define KV_SWITCH_FORMAT(fmt, d, fn)                  \
    switch (fmt) {                                    \
    case KV_INT4: fn(KV_INT4, d); break;              \
    case KV_INT8: fn(KV_INT8, d); break;              \
    case KV_F16: fn(KV_F16, d); break;                \
    case KV_BF16: fn(KV_BF16, d); break;              \
    default: fn(KV_F32, d);                           \
    }
/* whether KV_SPECIALIZE makes head_dim D a constant (its loops then unrolled) */
static inline int kv_specialized(int D) { return D == 64 || D == 128; }
#define KV_SPECIALIZE(fmt, D, fn)                                \
    do {                                                         \
        if ((D) == 64) { KV_SWITCH_FORMAT(fmt, 64, fn) }         \
        else if ((D) == 128) { KV_SWITCH_FORMAT(fmt, 128, fn) }  \
        else { KV_SWITCH_FORMAT(fmt, D, fn) }                    \
    } while (0)


#endif
