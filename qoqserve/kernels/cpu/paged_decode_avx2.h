/* The AVX2 path of paged_decode.c (included once by it, after its job type):
 * paged_decode_avx512.h's three passes at half the width, for CPUs without
 * AVX-512, entered only after a run-time CPU check.
 *
 * A block's 16 scores are two vectors of 8 tokens; each token's q . k is one
 * FMA chain over its row, the 8 chains of a half summed across by one hadd
 * tree (sums8). KV4 codes - 8 and KV8 codes are converted to fp32 once per
 * row and shared by the G query heads of their KV head; scales and zeros
 * apply to a block's scores / weights at once, as on the AVX-512 path.
 */
#include "kv_rows_avx2.h"
#ifdef KV_AVX2
#define PD_AVX2 1
#ifndef PD_PF
#define PD_PF 2
#endif

KV_AVX2_BEGIN

/* the scales (and KV4 zeros - 8) of a block's n rows, one token per lane */
static inline __attribute__((always_inline)) void block_meta_avx2(const uint8_t *rows, int64_t ss, int n,
                                                                   const int fmt, const int D, __m256 scale[2],
                                                                   __m256 zero[2]) {
    int32_t pairs[BLOCK] = {0};  /* KV8 rows end with the scale alone: 2 bytes */
    for (int i = 0; i < n; i++) memcpy(pairs + i, rows + i * ss + (fmt == KV_INT4 ? D / 2 : D), fmt == KV_INT4 ? 4 : 2);
    for (int h = 0; h < 2; h++) {
        const __m256i p = _mm256_loadu_si256((const __m256i *)(pairs + 8 * h));
        const __m256i lo = _mm256_and_si256(p, _mm256_set1_epi32(0xffff)), hi = _mm256_srli_epi32(p, 16);
        /* 8 x 16 bits of each into one __m128i */
        const __m128i l16 = _mm_packus_epi32(_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1));
        const __m128i h16 = _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
        scale[h] = _mm256_cvtph_ps(l16);
        zero[h] = fmt == KV_INT4 ? _mm256_sub_ps(_mm256_cvtph_ps(h16), _mm256_set1_ps(8.f)) : _mm256_setzero_ps();
    }
}

/* q . row_t for the BLOCK rows, 8 per vector (stale rows past the block's end
 * give junk lanes): one chain per row; past the head_dims KV_SPECIALIZE makes
 * constants, the 8 chains of each half step together (as the AVX-512 path's
 * block_scores) */
static inline __attribute__((always_inline)) void block_scores_avx2(const float *q, const float *rows, const int np,
                                                                     const int D, __m256 out[2]) {
    for (int h = 0; h < 2; h++) {
        __m256 d[8];
        const float *r = rows + 8 * h * np;
        if (kv_specialized(D)) {
            for (int i = 0; i < 8; i++) {
                __m256 acc = _mm256_mul_ps(_mm256_load_ps(q), _mm256_load_ps(r + i * np));
                for (int c = 8; c < np; c += 8)
                    acc = _mm256_fmadd_ps(_mm256_load_ps(q + c), _mm256_load_ps(r + i * np + c), acc);
                d[i] = acc;
            }
        } else {
            const __m256 q0 = _mm256_load_ps(q);
            for (int i = 0; i < 8; i++) d[i] = _mm256_mul_ps(q0, _mm256_load_ps(r + i * np));
            for (int c = 8; c < np; c += 8) {
                const __m256 qc = _mm256_load_ps(q + c);
                for (int i = 0; i < 8; i++) d[i] = _mm256_fmadd_ps(qc, _mm256_load_ps(r + i * np + c), d[i]);
            }
        }
        out[h] = sums8(d);
    }
}

/* acc[c0 .. c0 + 8 NV) += sum_{i<n} w[i] * rows[i] over those channels:
 * even and odd rows on separate accumulators; NV a constant, so that they
 * stay in registers */
static inline __attribute__((always_inline)) void accumulate_cols(float *acc, const float *w, const float *rows,
                                                                   int n, const int np, int c0, const int NV) {
    __m256 x[4], y[4];
    for (int u = 0; u < NV; u++) {
        x[u] = _mm256_load_ps(acc + c0 + 8 * u);
        y[u] = _mm256_setzero_ps();
    }
    int i = 0;
    for (; i + 1 < n; i += 2) {
        const __m256 w0 = _mm256_broadcast_ss(w + i), w1 = _mm256_broadcast_ss(w + i + 1);
        const float *r0 = rows + i * np + c0, *r1 = r0 + np;
        for (int u = 0; u < NV; u++) {
            x[u] = _mm256_fmadd_ps(w0, _mm256_load_ps(r0 + 8 * u), x[u]);
            y[u] = _mm256_fmadd_ps(w1, _mm256_load_ps(r1 + 8 * u), y[u]);
        }
    }
    if (i < n) {
        const __m256 w0 = _mm256_broadcast_ss(w + i);
        for (int u = 0; u < NV; u++) x[u] = _mm256_fmadd_ps(w0, _mm256_load_ps(rows + i * np + c0 + 8 * u), x[u]);
    }
    for (int u = 0; u < NV; u++) _mm256_store_ps(acc + c0 + 8 * u, _mm256_add_ps(x[u], y[u]));
}

/* acc[np] += sum_{i<n} w[i] * rows[i], 32 channels at a time (8 registers in flight) */
static inline __attribute__((always_inline)) void accumulate_avx2(float *acc, const float *w, const float *rows,
                                                                   int n, const int np) {
    int c0 = 0;
    for (; c0 + 32 <= np; c0 += 32) accumulate_cols(acc, w, rows, n, np, c0, 4);
    if (c0 < np) accumulate_cols(acc, w, rows, n, np, c0, 2);  /* np is a multiple of 16 */
}

/* One (sequence, chunk): all scores (K), their softmax, then the weighted sum of V. */
static inline __attribute__((always_inline)) void chunk_impl_avx2(const job *j, int b, int c, float *s,
                                                                   const int fmt, const int D) {
    const int np = padded(fmt, D), G = j->G, H = j->H, bs = j->bs, ct = chunk_tokens(j);
    const int quant = fmt == KV_INT4 || fmt == KV_INT8;
    float *q = s, *acc = q + (int64_t)H * np, *kr = acc + (int64_t)H * np, *vr = kr + BLOCK * np;
    float *w = vr + BLOCK * np, *sc = w + BLOCK, *zacc = sc + (int64_t)H * ct, *qsum = zacc + (int64_t)H * BLOCK;
    for (int hq = j->h_lo * G; hq < j->h_hi * G; hq++) {
        const float *src = j->q + ((int64_t)b * H + hq) * D;
        float sum = 0.f;
        for (int i = 0; i < np; i++) {
            const int ch = channel_of(fmt, i);
            q[hq * np + i] = ch < D ? src[ch] * j->qscale : 0.f;  /* zero pads: the rows' pad slots add 0 */
            sum += q[hq * np + i];
        }
        qsum[hq] = sum;
    }
    memset(acc, 0, sizeof(float) * (size_t)H * np);
    memset(zacc, 0, sizeof(float) * (size_t)H * BLOCK);
    const int64_t L = j->lens[b], *table = j->tables + (int64_t)b * j->width, ss = j->slot_stride;
    const int64_t p0 = chunk_first(j, b, c), p1 = chunk_end(j, b, c);
    const int T = (int)((p1 * bs < L ? p1 * bs : L) - p0 * bs);
    for (int pass = 0; pass < 2; pass++) {
        for (int64_t p = p0; p < p1; p++) {
            const int64_t base = table[p] * bs * ss;
            const int ntok = (int)(L - p * bs < bs ? L - p * bs : bs);
            if (p + PD_PF < p1) {  /* pages are scattered: no hardware prefetcher guesses the next one */
                const char *next = (const char *)(pass ? j->v : j->k) + table[p + PD_PF] * bs * ss;
                for (int64_t o = 0; o < bs * ss; o += 64) _mm_prefetch(next + o, _MM_HINT_T1);
            }
            for (int h = j->h_lo; h < j->h_hi; h++) {
                const uint8_t *rows = (pass ? j->v : j->k) + base + h * j->head_stride;
                for (int t0 = 0; t0 < ntok; t0 += BLOCK) {
                    const int n = ntok - t0 < BLOCK ? ntok - t0 : BLOCK, off = (int)(p - p0) * bs + t0;
                    const __m256i valid[2] = {lanes8(n), lanes8(n - 8)};
                    float *buf = pass ? vr : kr;
                    for (int i = 0; i < n; i++) row_avx2(rows + (t0 + i) * ss, fmt, D, buf + i * np);
                    __m256 scale[2] = {_mm256_set1_ps(1.f), _mm256_set1_ps(1.f)};
                    __m256 zero[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
                    if (quant) block_meta_avx2(rows + t0 * ss, ss, n, fmt, D, scale, zero);
                    for (int g = 0; g < G; g++) {
                        const int hq = h * G + g;
                        float *sh = sc + hq * ct + off;
                        if (!pass) {  /* score = scale * (q . (u - 8) - (zero - 8) * sum q) */
                            __m256 d[2];
                            block_scores_avx2(q + hq * np, kr, np, D, d);
                            for (int k = 0; k < 2; k++) {
                                if (quant) d[k] = _mm256_mul_ps(scale[k], _mm256_fnmadd_ps(zero[k], _mm256_set1_ps(qsum[hq]), d[k]));
                                _mm256_maskstore_ps(sh + 8 * k, valid[k], d[k]);
                            }
                            continue;
                        }
                        for (int k = 0; k < 2; k++) {
                            __m256 e = _mm256_maskload_ps(sh + 8 * k, valid[k]);
                            if (quant) {  /* the zero part is summed apart and removed at the end */
                                e = _mm256_mul_ps(e, scale[k]);
                                if (fmt == KV_INT4) {
                                    float *z = zacc + hq * BLOCK + 8 * k;
                                    _mm256_store_ps(z, _mm256_fmadd_ps(e, zero[k], _mm256_load_ps(z)));
                                }
                            }
                            _mm256_store_ps(w + 8 * k, e);
                        }
                        accumulate_avx2(acc + hq * np, w, vr, n, np);
                    }
                }
            }
        }
        if (pass) break;
        finish_scores(j, b, c, sc, ct, T);
        for (int hq = j->h_lo * G; hq < j->h_hi * G; hq++) {  /* softmax of the chunk, unnormalized */
            float *sh = sc + hq * ct;
            const __m256 ninf = _mm256_set1_ps(-INFINITY);
            __m256 mv = ninf, lv = _mm256_setzero_ps();
            for (int t = 0; t < T; t += 8) {
                const __m256 k = _mm256_castsi256_ps(lanes8(T - t));
                mv = _mm256_max_ps(mv, _mm256_blendv_ps(ninf, _mm256_maskload_ps(sh + t, _mm256_castps_si256(k)), k));
            }
            const float mx = hmax8(mv);
            for (int t = 0; t < T; t += 8) {
                const __m256i k = lanes8(T - t);
                const __m256 e = _mm256_and_ps(_mm256_castsi256_ps(k),
                                               exp2_avx2(_mm256_sub_ps(_mm256_maskload_ps(sh + t, k), _mm256_set1_ps(mx))));
                _mm256_maskstore_ps(sh + t, k, e);
                lv = _mm256_add_ps(lv, e);
            }
            float *pr = partial(j, b, c, hq);
            pr[0] = mx;
            pr[1] = hsum8(lv);
        }
    }
    const int alone = !merged_apart(j, b, 1);  /* then merge()'s arithmetic is done here */
    for (int hq = j->h_lo * G; hq < j->h_hi * G; hq++) {
        float *pr = partial(j, b, c, hq);
        const float *za = zacc + hq * BLOCK;
        const float z = fmt == KV_INT4 ? hsum8(_mm256_add_ps(_mm256_load_ps(za), _mm256_load_ps(za + 8))) : 0.f;
        store_output_avx2(acc + hq * np, fmt, D, np, _mm256_set1_ps(z), _mm256_set1_ps(1.f), pr + 2);
        if (!alone) continue;
        /* merge() of one chunk: (0 + pr * exp2(0)) / (0 + l * exp2(0)), the same
         * bits, and zeros where its sum is not positive (NaN scores), as merge() */
        const float l = 0.f + pr[1];
        float *out = j->out + ((int64_t)b * H + hq) * D;
        for (int d = 0; d < D; d++) out[d] = l > 0.f ? (0.f + pr[2 + d]) / l : 0.f;
    }
}

#define CHUNK(f, d) chunk_impl_avx2(j, b, c, s, f, d)
static void chunk_avx2(const job *j, int b, int c, float *s) { KV_SPECIALIZE(j->fmt, j->D, CHUNK); }
#undef CHUNK

KV_AVX2_END
#endif
