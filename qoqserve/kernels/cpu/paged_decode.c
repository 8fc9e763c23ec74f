/* Paged decode attention for CPUs: one query per sequence over its pages,
 * for every page format of qoqserve/layers/kv_cache.py: KV4 (UINT4 codes +
 * fp16 scale and zero per row), KV8 (INT8 codes + fp16 scale) and dense
 * fp16/bf16/fp32. Each row is converted once per token (shared by the G query
 * heads of its KV head) and never materialized beyond that; one kernel for all
 * formats, so precisions are compared on equal footing.
 *
 * Each (sequence, KV head) is computed on its own in a fixed order, so a
 * sequence's result does not depend on what else is in the batch.
 *
 * With vals_t the row's codes (or values: scale 1, zero 0) and e_t = exp(score_t - max):
 * score_t = scale_t * (q . vals_t - zero_t * sum(q)) * sm_scale   (= q . k_t * sm_scale)
 * out     = (sum_t e_t scale_t vals_t - sum_t e_t scale_t zero_t) / sum_t e_t   (= sum_t p_t v_t)
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__F16C__)
#include <immintrin.h>
static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }  /* exact, one instruction */
#else
static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    float f;
    if (exp == 0) {                       /* zero or subnormal: man * 2^-24 */
        f = (float)man * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    uint32_t bits = sign | ((exp + 112u) << 23) | (man << 13);  /* inf/nan never stored */
    memcpy(&f, &bits, 4);
    return f;
}
#endif

static inline float meta(const uint8_t *p) { return half_to_float((uint16_t)(p[0] | (p[1] << 8))); }

typedef uint32_t __attribute__((may_alias)) u32_alias;

enum { KV_INT4 = 0, KV_INT8 = 1, KV_F16 = 2, KV_BF16 = 3, KV_F32 = 4 };

/* one row (a token's K or V of one head) -> vals[D], *scale, *zero */
static inline void load_row(const uint8_t *r, int fmt, int D, float *vals, float *scale, float *zero) {
    *scale = 1.f;
    *zero = 0.f;
    switch (fmt) {
    case KV_INT4:  /* planar: even channels, then odd ones (attend() permutes q to match) */
        for (int j = 0; j < D / 2; j++) {
            vals[j] = (float)(r[j] & 15);
            vals[D / 2 + j] = (float)(r[j] >> 4);
        }
        *scale = meta(r + D / 2);
        *zero = meta(r + D / 2 + 2);
        break;
    case KV_INT8:
        for (int d = 0; d < D; d++) vals[d] = (float)(int8_t)r[d];
        *scale = meta(r + D);
        break;
    case KV_F16: {
        const uint16_t *h = (const uint16_t *)r;
        for (int d = 0; d < D; d++) vals[d] = half_to_float(h[d]);
        break;
    }
    case KV_BF16: {  /* bf16 is the top half of an fp32: shifts that vectorize */
        const uint16_t *h = (const uint16_t *)r;
        u32_alias *bits = (u32_alias *)vals;
        for (int d = 0; d < D; d++) bits[d] = (uint32_t)h[d] << 16;
        break;
    }
    default:
        memcpy(vals, r, sizeof(float) * (size_t)D);
    }
}

/* one (sequence, KV head): its G query heads over its L tokens. fmt and D are
 * constants at each call site, so each gets its own unrolled, vectorized loops. */
static inline __attribute__((always_inline)) void attend(
    const float *qh, const uint8_t *k, const uint8_t *v, int64_t slot_stride, int64_t head_off,
    const int fmt, const int64_t *table, int64_t L, int G, const int D, int bs, float sm_scale,
    float *restrict scores, float *restrict acc, float *restrict codes, float *restrict outh) {
    if (fmt == KV_INT4) {  /* q in the planar channel order of unpacked KV4 rows */
        float *qp = acc;   /* acc is free until the V pass */
        for (int g = 0; g < G; g++)
            for (int j = 0; j < D / 2; j++) {
                qp[g * D + j] = qh[g * D + 2 * j];
                qp[g * D + D / 2 + j] = qh[g * D + 2 * j + 1];
            }
        memcpy(codes + D, qp, sizeof(float) * (size_t)D * G);
        qh = codes + D;
    }
    float qsum[64];  /* G <= 64 */
    for (int g = 0; g < G; g++) {
        float s = 0.f;
        for (int d = 0; d < D; d++) s += qh[g * D + d];
        qsum[g] = s;
    }
    for (int64_t t0 = 0; t0 < L; t0 += bs) {  /* page by page: no division per token */
        const uint8_t *page = k + table[t0 / bs] * bs * slot_stride + head_off;
        for (int64_t t = t0; t < t0 + bs && t < L; t++) {
        float scale, zero;
        load_row(page + (t - t0) * slot_stride, fmt, D, codes, &scale, &zero);  /* once per token, for G heads */
        for (int g = 0; g < G; g++) {
            const float *qg = qh + g * D;
            float dot = 0.f;
            for (int d = 0; d < D; d++) dot += qg[d] * codes[d];
            scores[g * L + t] = scale * (dot - zero * qsum[g]) * sm_scale;
        }
    }}
    /* unnormalized softmax; the V pass divides once at the end */
    float sums[64], zsums[64];
    for (int g = 0; g < G; g++) {
        float *s = scores + g * L, m = -INFINITY, sum = 0.f;
        for (int64_t t = 0; t < L; t++) m = s[t] > m ? s[t] : m;
        for (int64_t t = 0; t < L; t++) { s[t] = expf(s[t] - m); sum += s[t]; }
        sums[g] = sum;
        zsums[g] = 0.f;
    }
    memset(acc, 0, sizeof(float) * (size_t)D * G);
    for (int64_t t0 = 0; t0 < L; t0 += bs) {  /* page by page: no division per token */
        const uint8_t *page = v + table[t0 / bs] * bs * slot_stride + head_off;
        for (int64_t t = t0; t < t0 + bs && t < L; t++) {
        float scale, zero;
        load_row(page + (t - t0) * slot_stride, fmt, D, codes, &scale, &zero);
        for (int g = 0; g < G; g++) {  /* sum_t w_t (vals_t - z_t): the z part kept apart */
            float w = scores[g * L + t] * scale, *a = acc + g * D;
            zsums[g] += w * zero;
            for (int d = 0; d < D; d++) a[d] += w * codes[d];
        }
    }}
    for (int g = 0; g < G; g++)
        for (int d = 0; d < D; d++) acc[g * D + d] = (acc[g * D + d] - zsums[g]) / sums[g];
    if (fmt == KV_INT4) {  /* back to channel order */
        for (int g = 0; g < G; g++)
            for (int j = 0; j < D / 2; j++) {
                outh[g * D + 2 * j] = acc[g * D + j];
                outh[g * D + 2 * j + 1] = acc[g * D + D / 2 + j];
            }
    } else {
        memcpy(outh, acc, sizeof(float) * (size_t)D * G);
    }
}

/* q, out: float [B, H, D]. The row of (slot, head) for K starts at
 * k + slot * slot_stride + head * head_stride bytes, for V at v + the same;
 * slot = table[t / bs] * bs + t % bs. tables: int64 [B, width]; lens: int64 [B].
 * Returns 0, or -1 if out of memory. */
int paged_decode_attention(const float *q, const uint8_t *k, const uint8_t *v, int64_t slot_stride,
                           int64_t head_stride, int fmt, const int64_t *tables, const int64_t *lens,
                           float *out, int B, int H, int Hkv, int D, int bs, int width,
                           float sm_scale, int threads) {
    const int G = H / Hkv;
    int64_t max_len = 0;
    for (int b = 0; b < B; b++) max_len = lens[b] > max_len ? lens[b] : max_len;
    int failed = 0;
    #pragma omp parallel num_threads(threads)
    {
    float *scores = malloc(sizeof(float) * (size_t)(max_len > 0 ? max_len : 1) * G);
    float *acc = malloc(sizeof(float) * (size_t)D * G);
    float *codes = malloc(sizeof(float) * (size_t)D * (G + 1));  /* a row, then permuted q */
    if (!scores || !acc || !codes) {
        #pragma omp atomic write
        failed = 1;
    }
    /* each (sequence, KV head) is one task, computed whole by one thread */
    #pragma omp for schedule(dynamic, 1)
    for (int task = 0; task < B * Hkv; task++) {
        if (!scores || !acc || !codes) continue;
        const int b = task / Hkv, h = task % Hkv;
        const int64_t L = lens[b], *table = tables + (int64_t)b * width;
        const float *qh = q + ((int64_t)b * H + (int64_t)h * G) * D;
        float *outh = out + ((int64_t)b * H + (int64_t)h * G) * D;
        const int64_t ho = h * head_stride;
#define ATTEND(f, d) attend(qh, k, v, slot_stride, ho, f, table, L, G, d, bs, sm_scale, scores, acc, codes, outh)
#define FORMATS(d)                                  \
        switch (fmt) {                              \
        case KV_INT4: ATTEND(KV_INT4, d); break;    \
        case KV_INT8: ATTEND(KV_INT8, d); break;    \
        case KV_F16: ATTEND(KV_F16, d); break;      \
        case KV_BF16: ATTEND(KV_BF16, d); break;    \
        default: ATTEND(KV_F32, d);                 \
        }
        if (D == 64) FORMATS(64)
        else if (D == 128) FORMATS(128)
        else FORMATS(D)
#undef FORMATS
#undef ATTEND
    }
    free(scores);
    free(acc);
    free(codes);
    }
    return failed ? -1 : 0;
}
