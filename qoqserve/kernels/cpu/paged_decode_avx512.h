/* The AVX-512 path of paged_decode.c (included once by it, after its job type).
 * Compiled for AVX-512 F/BW/VL/DQ by target pragmas whatever -march says,
 * and only called after a run-time CPU check.
 *
 * A row is converted once into fp32 (shared by the G query heads of its KV
 * head): K rows into a buffer of BLOCK rows in L1, V rows into registers
 * where G <= 4 (accumulate_rows), else into the buffer too. KV4 and bf16 rows come out planar
 * per 32 channels (16 even channels, then the 16 odd ones): that is what a
 * nibble mask / a 16-bit shift yields without any shuffle, so q is permuted
 * once per task instead. A KV4 code becomes code - 8 by one vpermps from a
 * constant table (centred: less cancellation against the zero term); scales
 * and zeros are applied to a block's 16 scores / weights at once.
 */
#include "kv_rows_avx512.h"
#ifdef KV_AVX512
#define PD_AVX512 1
#ifndef PD_PF
#define PD_PF 2
#endif

KV_AVX512_BEGIN

/* The fp16 (scale, zero) pairs that end the n rows of a block, ss bytes
 * apart, one token per 32-bit lane (KV8 rows end with the scale alone, read
 * with the two code bytes before it so that no read passes the row's end),
 * by one gather instruction: 16 masked inserts, unrolled with their bounds
 * checks, cost more (docs/benchmarks/cpu_attention.md). */
static inline __attribute__((always_inline)) __m512i block_pairs(const uint8_t *rows, int64_t ss, int n,
                                                                  const int fmt, const int D) {
    const __m512i at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32((int)ss));
    if (fmt == KV_INT4) return _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), lane_mask(n), at, rows + D / 2, 1);
    return _mm512_srli_epi32(_mm512_mask_i32gather_epi32(_mm512_setzero_si512(), lane_mask(n), at, rows + D - 2, 1), 16);
}

/* a block's scales (and KV4 zeros - 8), one token per lane, from its pairs */
static inline __attribute__((always_inline)) void block_meta(__m512i pairs, const int fmt, __m512 *scale,
                                                              __m512 *zero) {
    *scale = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(pairs));
    if (fmt == KV_INT4)
        *zero = _mm512_sub_ps(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(pairs, 16))),
                              _mm512_set1_ps(8.f));
}

/* 4 vectors -> per 128-bit lane: [sum of that lane of a, of b, of c, of d] */
static inline __m512 lane_sums4(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m512 ab = _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xee));
    const __m512 cd = _mm512_add_ps(_mm512_shuffle_ps(c, d, 0x44), _mm512_shuffle_ps(c, d, 0xee));
    return _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x88), _mm512_shuffle_ps(ab, cd, 0xdd));
}

/* q . row_t for the BLOCK rows (stale rows past the block's end give junk
 * lanes): one chain of multiply-adds per row, channel by channel. With D a
 * constant (64, 128: KV_SPECIALIZE) the compiler unrolls the channel loop
 * and interleaves the rows itself; otherwise (any other head_dim) each row's
 * chain waited on itself, so there the 16 chains step together. The same
 * sums in the same order either way. */
static inline __attribute__((always_inline)) __m512 block_scores(const float *q, const float *rows, const int np,
                                                                  const int D) {
    __m512 d[BLOCK], quad[4];
    if (kv_specialized(D)) {
        for (int i = 0; i < BLOCK; i++) {
            const float *r = rows + i * np;
            __m512 acc = _mm512_mul_ps(_mm512_load_ps(q), _mm512_load_ps(r));
            for (int c = 16; c < np; c += 16) acc = _mm512_fmadd_ps(_mm512_load_ps(q + c), _mm512_load_ps(r + c), acc);
            d[i] = acc;
        }
    } else {
        const __m512 q0 = _mm512_load_ps(q);
        for (int i = 0; i < BLOCK; i++) d[i] = _mm512_mul_ps(q0, _mm512_load_ps(rows + i * np));
        for (int c = 16; c < np; c += 16) {
            const __m512 qc = _mm512_load_ps(q + c);
            for (int i = 0; i < BLOCK; i++) d[i] = _mm512_fmadd_ps(qc, _mm512_load_ps(rows + i * np + c), d[i]);
        }
    }
    for (int k = 0; k < 4; k++) quad[k] = lane_sums4(d[4 * k], d[4 * k + 1], d[4 * k + 2], d[4 * k + 3]);
    /* quad[k] lane L holds row 4k..4k+3 sums of 128-bit lane L: add the 4 lanes */
    const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(quad[0], quad[1], 0x44),
                                     _mm512_shuffle_f32x4(quad[0], quad[1], 0xee));
    const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(quad[2], quad[3], 0x44),
                                     _mm512_shuffle_f32x4(quad[2], quad[3], 0xee));
    return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xdd));
}

/* acc[c0 .. c0 + 16 nv) += sum_{i<n} w[i] * rows[i][same]: even and odd rows
 * on separate accumulators (up to 16 registers in flight). nv must be a
 * constant where inlined (as a run-time count the sums lived on the stack:
 * a load and a store per multiply-add; so did those below) */
static inline __attribute__((always_inline)) void accumulate_block(float *acc, const float *w, const float *rows,
                                                                    int n, const int np, int c0, const int nv) {
    __m512 x[8], y[8];
    for (int u = 0; u < nv; u++) {
        x[u] = _mm512_load_ps(acc + c0 + 16 * u);
        y[u] = _mm512_setzero_ps();
    }
    int i = 0;
    for (; i + 1 < n; i += 2) {
        const __m512 w0 = _mm512_set1_ps(w[i]), w1 = _mm512_set1_ps(w[i + 1]);
        const float *r0 = rows + i * np + c0, *r1 = r0 + np;
        for (int u = 0; u < nv; u++) {
            x[u] = _mm512_fmadd_ps(w0, _mm512_load_ps(r0 + 16 * u), x[u]);
            y[u] = _mm512_fmadd_ps(w1, _mm512_load_ps(r1 + 16 * u), y[u]);
        }
    }
    if (i < n) {
        const __m512 w0 = _mm512_set1_ps(w[i]);
        for (int u = 0; u < nv; u++) x[u] = _mm512_fmadd_ps(w0, _mm512_load_ps(rows + i * np + c0 + 16 * u), x[u]);
    }
    for (int u = 0; u < nv; u++) _mm512_store_ps(acc + c0 + 16 * u, _mm512_add_ps(x[u], y[u]));
}

/* acc[np] += sum_{i<n} w[i] * rows[i], 128 slots at a time */
static inline __attribute__((always_inline)) void accumulate(float *acc, const float *w, const float *rows,
                                                              int n, const int np) {
    int c0 = 0;
    for (; c0 + 128 <= np; c0 += 128) accumulate_block(acc, w, rows, n, np, c0, 8);
    switch ((np - c0) / 16) {  /* the last 16 .. 112 slots */
    case 1: accumulate_block(acc, w, rows, n, np, c0, 1); break;
    case 2: accumulate_block(acc, w, rows, n, np, c0, 2); break;
    case 3: accumulate_block(acc, w, rows, n, np, c0, 3); break;
    case 4: accumulate_block(acc, w, rows, n, np, c0, 4); break;
    case 5: accumulate_block(acc, w, rows, n, np, c0, 5); break;
    case 6: accumulate_block(acc, w, rows, n, np, c0, 6); break;
    case 7: accumulate_block(acc, w, rows, n, np, c0, 7); break;
    default: break;
    }
}

/* V rows straight from the pages: acc[G][np] += sum_{i<n} w[g][i] * row_i, for
 * the G query heads of one KV head at once (w rows ws apart). Each row is
 * converted once per 64 slots into registers and serves all G heads from
 * there, instead of being written out as fp32 and read back per head. Per
 * (head, slot) the tokens are summed in order into one accumulator. Slots
 * c0 .. c0 + 16 nv here, nv a constant where inlined. */
static inline __attribute__((always_inline)) void accumulate_rows_block(float *acc, const float *w, int64_t ws,
                                                                         const uint8_t *rows, int64_t ss, int n,
                                                                         const int G, const int fmt, const int D,
                                                                         const int np, int c0, const int nv) {
    __m512 a[4][4];
    for (int g = 0; g < G; g++)
        for (int u = 0; u < nv; u++) a[g][u] = _mm512_load_ps(acc + g * np + c0 + 16 * u);
    for (int i = 0; i < n; i++) {
        __m512 v[4];
        slab_avx512(rows + i * ss, fmt, D, c0, nv, v);
        for (int g = 0; g < G; g++) {
            const __m512 wg = _mm512_set1_ps(w[g * ws + i]);
            for (int u = 0; u < nv; u++) a[g][u] = _mm512_fmadd_ps(wg, v[u], a[g][u]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int u = 0; u < nv; u++) _mm512_store_ps(acc + g * np + c0 + 16 * u, a[g][u]);
}

static inline __attribute__((always_inline)) void accumulate_rows(float *acc, const float *w, int64_t ws,
                                                                   const uint8_t *rows, int64_t ss, int n, const int G,
                                                                   const int fmt, const int D, const int np) {
    int c0 = 0;
    for (; c0 + 64 <= np; c0 += 64) accumulate_rows_block(acc, w, ws, rows, ss, n, G, fmt, D, np, c0, 4);
    switch ((np - c0) / 16) {  /* the last 16, 32 or 48 slots */
    case 1: accumulate_rows_block(acc, w, ws, rows, ss, n, G, fmt, D, np, c0, 1); break;
    case 2: accumulate_rows_block(acc, w, ws, rows, ss, n, G, fmt, D, np, c0, 2); break;
    case 3: accumulate_rows_block(acc, w, ws, rows, ss, n, G, fmt, D, np, c0, 3); break;
    default: break;
    }
}

/* accumulate_rows with the head count as a constant (1..4), so that its
 * accumulators stay in registers */
static inline __attribute__((always_inline)) void accumulate_heads(float *acc, const float *w, int64_t ws,
                                                                    const uint8_t *rows, int64_t ss, int n, int G,
                                                                    const int fmt, const int D, const int np) {
    switch (G) {
    case 1: accumulate_rows(acc, w, ws, rows, ss, n, 1, fmt, D, np); break;
    case 2: accumulate_rows(acc, w, ws, rows, ss, n, 2, fmt, D, np); break;
    case 3: accumulate_rows(acc, w, ws, rows, ss, n, 3, fmt, D, np); break;
    default: accumulate_rows(acc, w, ws, rows, ss, n, 4, fmt, D, np); break;
    }
}

#include "paged_decode_vnni.h"

/* The scales (and KV4 zeros - 8) of the chunk's V rows into vs, vz [KV head][token]:
 * gathered here, apart from the V pass, whose every block would otherwise
 * wait for its gather before its first multiply-add */
static inline __attribute__((always_inline)) void v_meta(const job *j, int b, int c, const int fmt, const int D,
                                                          float *vs, float *vz) {
    const int bs = j->bs, ct = chunk_tokens(j);
    const int64_t L = j->lens[b], *table = j->tables + (int64_t)b * j->width, ss = j->slot_stride;
    const int64_t p0 = chunk_first(j, b, c), p1 = chunk_end(j, b, c);
    for (int64_t p = p0; p < p1; p++) {
        const int ntok = (int)(L - p * bs < bs ? L - p * bs : bs);
        for (int h = j->h_lo; h < j->h_hi; h++)
            for (int t0 = 0; t0 < ntok; t0 += BLOCK) {
                const int n = ntok - t0 < BLOCK ? ntok - t0 : BLOCK, off = (int)(p - p0) * bs + t0;
                const uint8_t *rows = j->v + table[p] * bs * ss + h * j->head_stride + t0 * ss;
                __m512 scale, zero = _mm512_setzero_ps();
                block_meta(block_pairs(rows, ss, n, fmt, D), fmt, &scale, &zero);
                _mm512_mask_storeu_ps(vs + (int64_t)h * ct + off, lane_mask(n), scale);
                _mm512_mask_storeu_ps(vz + (int64_t)h * ct + off, lane_mask(n), zero);
            }
    }
}

/* One (sequence, chunk) in three passes: all scores (K), their softmax, then
 * the weighted sum of V; the chunk's pages stay in L2 between the passes. */
static inline __attribute__((always_inline)) void chunk_impl(const job *j, int b, int c, float *s,
                                                              const int fmt, const int D) {
    const int np = padded(fmt, D), G = j->G, H = j->H, bs = j->bs, ct = chunk_tokens(j);
    const int quant = fmt == KV_INT4 || fmt == KV_INT8;
    float *q = s, *acc = q + (int64_t)H * np, *kr = acc + (int64_t)H * np, *vr = kr + BLOCK * np;
    float *w = vr + BLOCK * np, *sc = w + BLOCK, *zacc = sc + (int64_t)H * ct, *qsum = zacc + (int64_t)H * BLOCK;
    float *vs = qsum + (H + 15) / 16 * 16, *vz = vs + (int64_t)j->Hkv * ct;  /* V rows' scales, zeros - 8 */
    /* KV4 scores by VNNI (paged_decode_vnni.h): the query as integer digits, kept where q goes */
    const int vnni = fmt == KV_INT4 && j->kv4_vnni && kv4_vnni_fits(j, (int64_t)BLOCK * np);
    for (int hq = j->h_lo * G; vnni && hq < j->h_hi * G; hq++)
        kv4_query_digits(j->q + ((int64_t)b * H + hq) * D, j->qscale, D, (int32_t *)q + hq * qp_stride(D));
    for (int hq = j->h_lo * G; !vnni && hq < j->h_hi * G; hq++) {
        const float *src = j->q + ((int64_t)b * H + hq) * D;
        float sum = 0.f;
        for (int i = 0; i < np; i++) {
            const int ch = channel_of(fmt, i);
            q[hq * np + i] = ch < D ? src[ch] * j->qscale : 0.f;  /* zero pads: junk row slots add 0 */
            sum += q[hq * np + i];
        }
        qsum[hq] = sum;
    }
    memset(acc, 0, sizeof(float) * (size_t)H * np);
    const int64_t L = j->lens[b], *table = j->tables + (int64_t)b * j->width, ss = j->slot_stride;
    const int64_t p0 = chunk_first(j, b, c), p1 = chunk_end(j, b, c);
    const int T = (int)((p1 * bs < L ? p1 * bs : L) - p0 * bs);
    if (vnni) kv4_scores_vnni(j, b, c, (const int32_t *)q, (int32_t *)kr, sc);
    for (int pass = 0; pass < 2; pass++) {
        for (int64_t p = vnni && !pass ? p1 : p0; p < p1; p++) {  /* with VNNI the K pass is done */
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
                    const __mmask16 valid = lane_mask(n);
                    float *buf = pass ? vr : kr;
                    /* V rows of up to 4 query heads: from the pages, all heads at once */
                    const int fused_v = pass && G <= 4;
                    for (int i = 0; !fused_v && i < n; i++) row_avx512(rows + (t0 + i) * ss, fmt, D, buf + i * np);
                    __m512 scale = _mm512_set1_ps(1.f), zero = _mm512_setzero_ps();
                    if (quant && !pass) block_meta(block_pairs(rows + t0 * ss, ss, n, fmt, D), fmt, &scale, &zero);
                    if (fused_v) {  /* the weights of all G heads as the softmax left them, one walk over the rows */
                        accumulate_heads(acc + h * G * np, sc + (int64_t)h * G * ct + off, ct, rows + t0 * ss, ss, n, G,
                                         fmt, D, np);
                        continue;
                    }
                    for (int g = 0; g < G; g++) {
                        const int hq = h * G + g;
                        if (!pass) {  /* score = scale * (q . (u - 8) - (zero - 8) * sum q) */
                            __m512 d = block_scores(q + hq * np, kr, np, D);
                            if (quant) d = _mm512_mul_ps(scale, _mm512_fnmadd_ps(zero, _mm512_set1_ps(qsum[hq]), d));
                            _mm512_mask_storeu_ps(sc + hq * ct + off, valid, d);
                            continue;
                        }
                        accumulate(acc + hq * np, sc + hq * ct + off, vr, n, np);
                    }
                }
            }
        }
        if (pass) break;
        finish_scores(j, b, c, sc, ct, T);
        if (quant) v_meta(j, b, c, fmt, D, vs, vz);
        for (int hq = j->h_lo * G; hq < j->h_hi * G; hq++) {  /* softmax of the chunk, unnormalized */
            float *sh = sc + hq * ct;
            const float *hs = vs + (int64_t)(hq / G) * ct, *hz = vz + (int64_t)(hq / G) * ct;
            __m512 mv = _mm512_set1_ps(-INFINITY), lv = _mm512_setzero_ps(), za = _mm512_setzero_ps();
            for (int t = 0; t < T; t += BLOCK)
                mv = _mm512_mask_max_ps(mv, lane_mask(T - t), mv,
                                        _mm512_loadu_ps(sh + t));
            const float mx = _mm512_reduce_max_ps(mv);
            for (int t = 0; t < T; t += BLOCK) {
                const __mmask16 k = lane_mask(T - t);
                const __m512 e = _mm512_maskz_mov_ps(k, exp2_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sh + t),
                                                                              _mm512_set1_ps(mx))));
                lv = _mm512_add_ps(lv, e);
                if (!quant) {
                    _mm512_mask_storeu_ps(sh + t, k, e);
                    continue;
                }
                /* the V pass's weights: the row scale applied here; the zero
                 * part summed apart and removed at the end */
                const __m512 wt = _mm512_mul_ps(e, _mm512_maskz_loadu_ps(k, hs + t));
                if (fmt == KV_INT4) za = _mm512_fmadd_ps(wt, _mm512_maskz_loadu_ps(k, hz + t), za);
                _mm512_mask_storeu_ps(sh + t, k, wt);
            }
            _mm512_store_ps(zacc + hq * BLOCK, za);
            float *pr = partial(j, b, c, hq);
            pr[0] = mx;
            pr[1] = _mm512_reduce_add_ps(lv);
        }
    }
    const int alone = !merged_apart(j, b, 1);  /* then merge()'s arithmetic is done here */
    for (int hq = j->h_lo * G; hq < j->h_hi * G; hq++) {
        float *pr = partial(j, b, c, hq);
        const float z = fmt == KV_INT4 ? _mm512_reduce_add_ps(_mm512_load_ps(zacc + hq * BLOCK)) : 0.f;
        if (!alone) {
            store_output(acc + hq * np, fmt, D, np, _mm512_set1_ps(z), _mm512_set1_ps(1.f), NULL, pr + 2);
            continue;
        }
        /* merge() of one chunk: (0 + pr * exp2(0)) / (0 + l * exp2(0)), the same
         * bits, and zeros where its sum is not positive (NaN scores), as merge();
         * the partial itself is never read */
        const float l = 0.f + pr[1];
        const __m512 den = _mm512_set1_ps(l);
        float *out = j->out + ((int64_t)b * H + hq) * D;
        if (l > 0.f) store_output(acc + hq * np, fmt, D, np, _mm512_set1_ps(z), _mm512_set1_ps(1.f), &den, out);
        else memset(out, 0, sizeof(float) * (size_t)D);
    }
}

#define CHUNK(f, d) chunk_impl(j, b, c, s, f, d)
static void chunk_avx512(const job *j, int b, int c, float *s) { KV_SPECIALIZE(j->fmt, j->D, CHUNK); }
#undef CHUNK

KV_AVX512_END
#endif
