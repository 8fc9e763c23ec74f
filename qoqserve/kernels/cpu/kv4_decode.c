/* KV4 paged decode attention for CPUs: one query per sequence over its
 * UINT4 pages (layout: qoqserve/layers/kv_cache.py Int4KVCacheLayout), the
 * codes dequantized on the fly, never materialized.
 *
 * Each (sequence, KV head) is computed on its own in a fixed order, so a
 * sequence's result does not depend on what else is in the batch.
 *
 * score_t = scale_t * (q . codes_t - zero_t * sum(q)) * sm_scale   (= q . k_t * sm_scale)
 * out     = sum_t p_t * scale_t * (codes_t - zero_t)                 (= sum_t p_t v_t)
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

static inline void unpack(const uint8_t *r, float *codes, int half) {
    for (int j = 0; j < half; j++) {
        codes[2 * j] = (float)(r[j] & 15);
        codes[2 * j + 1] = (float)(r[j] >> 4);
    }
}

static inline const uint8_t *kv_row(const uint8_t *cache, const int64_t *table, int64_t t, int bs,
                                    int hkv, int row, int kind, int h) {
    int64_t slot = table[t / bs] * bs + t % bs;
    return cache + ((slot * 2 + kind) * hkv + h) * (int64_t)row;
}

/* q, out: float [B, H, D]; cache: uint8 [blocks, bs, 2, Hkv, D/2 + 4];
 * tables: int64 [B, width]; lens: int64 [B]. Returns 0, or -1 if out of memory. */
int kv4_decode_attention(const float *q, const uint8_t *cache, const int64_t *tables,
                         const int64_t *lens, float *out, int B, int H, int Hkv, int D, int bs,
                         int width, float sm_scale, int threads) {
    const int G = H / Hkv, half = D / 2, row = half + 4;
    int64_t max_len = 0;
    for (int b = 0; b < B; b++) max_len = lens[b] > max_len ? lens[b] : max_len;
    int failed = 0;
    #pragma omp parallel num_threads(threads)
    {
    float *scores = malloc(sizeof(float) * (size_t)(max_len > 0 ? max_len : 1) * G);
    float *acc = malloc(sizeof(float) * (size_t)D * G);
    float *codes = malloc(sizeof(float) * (size_t)D);
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
        {
            const float *qh = q + ((int64_t)b * H + (int64_t)h * G) * D;
            float qsum[64];  /* G <= 64 */
            for (int g = 0; g < G; g++) {
                float s = 0.f;
                for (int d = 0; d < D; d++) s += qh[g * D + d];
                qsum[g] = s;
            }
            for (int64_t t = 0; t < L; t++) {
                const uint8_t *r = kv_row(cache, table, t, bs, Hkv, row, 0, h);
                float scale = half_to_float((uint16_t)(r[half] | (r[half + 1] << 8)));
                float zero = half_to_float((uint16_t)(r[half + 2] | (r[half + 3] << 8)));
                unpack(r, codes, half);  /* once per token, shared by the G query heads */
                for (int g = 0; g < G; g++) {
                    const float *qg = qh + g * D;
                    float dot = 0.f;
                    for (int d = 0; d < D; d++) dot += qg[d] * codes[d];
                    scores[g * L + t] = scale * (dot - zero * qsum[g]) * sm_scale;
                }
            }
            for (int g = 0; g < G; g++) {
                float *s = scores + g * L, m = -INFINITY, sum = 0.f;
                for (int64_t t = 0; t < L; t++) m = s[t] > m ? s[t] : m;
                for (int64_t t = 0; t < L; t++) { s[t] = expf(s[t] - m); sum += s[t]; }
                for (int64_t t = 0; t < L; t++) s[t] /= sum;
            }
            memset(acc, 0, sizeof(float) * (size_t)D * G);
            for (int64_t t = 0; t < L; t++) {
                const uint8_t *r = kv_row(cache, table, t, bs, Hkv, row, 1, h);
                float scale = half_to_float((uint16_t)(r[half] | (r[half + 1] << 8)));
                float zero = half_to_float((uint16_t)(r[half + 2] | (r[half + 3] << 8)));
                unpack(r, codes, half);
                for (int g = 0; g < G; g++) {
                    float w = scores[g * L + t] * scale, wz = w * zero, *a = acc + g * D;
                    for (int d = 0; d < D; d++) a[d] += w * codes[d] - wz;
                }
            }
            memcpy(out + ((int64_t)b * H + (int64_t)h * G) * D, acc, sizeof(float) * (size_t)D * G);
        }
    }
    free(scores);
    free(acc);
    free(codes);
    }
    return failed ? -1 : 0;
}
