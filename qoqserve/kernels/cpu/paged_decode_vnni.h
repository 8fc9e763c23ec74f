/* KV4 scores by integer dot products (AVX-512 VNNI), for paged_decode.c's
 * vector path (included by paged_decode_avx512.h, inside its AVX-512 region;
 * its functions add VNNI to the target and run only after a CPUID check).
 *
 * Why: with the codes converted to fp32, q . k costs D/16 FMAs per row and
 * head plus a horizontal sum, and the K pass was most of the kernel. Here the
 * codes never leave bytes. The query is written as one 22-bit integer per
 * channel, Q = round(q / sq) with sq = max|q| / 2^21, in three signed 8-bit
 * digits, Q = 65536 a + 256 b + c, so that vpdpbusd (codes unsigned, digits
 * signed) sums Q . u exactly in INT32 per digit. The packed rows of 16 tokens
 * are transposed by dwords (4 packed bytes: 8 channels), so each lane is one
 * token and its sum needs no horizontal reduction: one vpdpbusd per digit
 * covers 4 channels of 16 tokens. The score is then
 *   scale * sq * (Q . (u - 8) - (zero - 8) * sum Q),
 * the fp32 path's formula with the centring done exactly in integers; the
 * only rounding beyond fp32's is Q's (2^-22 of max|q| per channel).
 * Every sum is in a fixed order per (sequence, chunk, head): batch- and
 * thread-invariant as the rest of the kernel. */
#ifndef QOQSERVE_PAGED_DECODE_VNNI_H
#define QOQSERVE_PAGED_DECODE_VNNI_H
#define VNNI_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")))

enum { QP_TAIL = 5 };  /* ints after a head's digits: sq, sq * sum Q (float bits), 8 * sum of each digit */

/* ints per query head: 3 digits x 2 nibble halves x D/8 dwords, then the tail */
static inline int64_t qp_stride(int D) { return 6 * (int64_t)(D / 8) + QP_TAIL; }

/* v -> its low signed 8-bit digit per lane: v - digit is a multiple of 256 */
static inline __m512i digit_lo(__m512i v) {
    const __m512i k128 = _mm512_set1_epi32(128);
    return _mm512_sub_epi32(_mm512_xor_si512(_mm512_and_si512(v, _mm512_set1_epi32(255)), k128), k128);
}

/* q [D] (channel order) times qscale -> a head's digits: byte r of dword
 * (digit p, half h, i) is channel 8i + 2r + h, the channel of nibble h of
 * packed byte 4i + r; so half h holds channels h, h + 2, ... in order. Once
 * per (sequence, chunk, head): vector code, or it costs as much as the scores. */
static inline __attribute__((always_inline)) void kv4_query_digits(const float *q, float qscale, const int D,
                                                                   int32_t *out) {
    const int nd = D / 8;
    const __m512 qs = _mm512_set1_ps(qscale);
    __m512 mx = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 16) {
        const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(lane_mask(D - d), q + d), qs);
        mx = _mm512_max_ps(mx, _mm512_abs_ps(x));
    }
    const float m = _mm512_reduce_max_ps(mx), sq = m > 0.f ? m / 2097152.f : 1.f;
    const __m512 inv = _mm512_set1_ps(qscale / sq);
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    __m512i sums[3] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
    int8_t *bytes = (int8_t *)out;
    for (int d = 0; d < D; d += 32) {
        const __m512 x0 = _mm512_maskz_loadu_ps(lane_mask(D - d), q + d);
        const __m512 x1 = _mm512_maskz_loadu_ps(lane_mask(D - d - 16), q + d + 16);
        const __mmask16 valid = lane_mask((D - d) / 2);  /* D is even: as many odd channels as even */
        for (int h = 0; h < 2; h++) {
            const __m512 x = _mm512_permutex2var_ps(x0, h ? odd : even, x1);
            const __m512i Q = _mm512_cvtps_epi32(_mm512_mul_ps(x, inv));  /* |Q| <= 2^21, to nearest */
            const __m512i c = digit_lo(Q), r1 = _mm512_srai_epi32(_mm512_sub_epi32(Q, c), 8), b = digit_lo(r1);
            const __m512i dig[3] = {_mm512_srai_epi32(_mm512_sub_epi32(r1, b), 8), b, c};  /* |a| <= 33 */
            for (int p = 0; p < 3; p++) {
                _mm_mask_storeu_epi8(bytes + (int64_t)(2 * p + h) * nd * 4 + d / 2, valid, _mm512_cvtepi32_epi8(dig[p]));
                sums[p] = _mm512_add_epi32(sums[p], dig[p]);
            }
        }
    }
    int32_t s[3];
    for (int p = 0; p < 3; p++) s[p] = _mm512_reduce_add_epi32(sums[p]);
    const float qsum = sq * (65536.f * (float)s[0] + 256.f * (float)s[1] + (float)s[2]);
    memcpy(out + 6 * nd, &sq, 4);
    memcpy(out + 6 * nd + 1, &qsum, 4);
    for (int p = 0; p < 3; p++) out[6 * nd + 2 + p] = 8 * s[p];
}

/* 16 packed rows (n valid), dwords 8s.. of each (nw <= 8 of them) -> lo[i], hi[i]:
 * the codes of dword 8s + i, one token per 32-bit lane, low / high nibbles */
VNNI_FN static inline __attribute__((always_inline)) void transpose_codes(const uint8_t *rows, int64_t ss, int n,
                                                                          int s, const int nw, __m512i *lo,
                                                                          __m512i *hi) {
    const __mmask8 dm = (__mmask8)((1u << nw) - 1u);
    __m512i z[8], t[8], u[8];
    for (int r = 0; r < 8; r++) {  /* rows r and r + 8 side by side; rows past n read as zero codes */
        const uint8_t *a = rows + (int64_t)r * ss + 32 * s, *b = a + 8 * ss;
        const __m256i x = r >= n ? _mm256_setzero_si256()
                          : nw == 8 ? _mm256_loadu_si256((const __m256i *)a) : _mm256_maskz_loadu_epi32(dm, a);
        const __m256i y = r + 8 >= n ? _mm256_setzero_si256()
                          : nw == 8 ? _mm256_loadu_si256((const __m256i *)b) : _mm256_maskz_loadu_epi32(dm, b);
        z[r] = _mm512_inserti64x4(_mm512_castsi256_si512(x), y, 1);
    }
    for (int k = 0; k < 4; k++) {
        t[2 * k] = _mm512_unpacklo_epi32(z[2 * k], z[2 * k + 1]);
        t[2 * k + 1] = _mm512_unpackhi_epi32(z[2 * k], z[2 * k + 1]);
    }
    for (int g = 0; g < 2; g++) {  /* u[4g + k]: rows 4g.. (and 8 + 4g..) of dwords k and k + 4 */
        u[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
        u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
    }
    const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), second = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    const __m512i nib = _mm512_set1_epi8(0x0f);
    for (int k = 0; k < 4; k++) {
        const __m512i o[2] = {_mm512_permutex2var_epi64(u[k], first, u[4 + k]),
                              _mm512_permutex2var_epi64(u[k], second, u[4 + k])};
        for (int e = 0; e < 2; e++) {
            if (k + 4 * e >= nw) continue;
            lo[k + 4 * e] = _mm512_and_si512(o[e], nib);
            hi[k + 4 * e] = _mm512_and_si512(_mm512_srli_epi16(o[e], 4), nib);
        }
    }
}

static inline __m512i bcast_i32(const int32_t *p) { return _mm512_set1_epi32(*p); }

/* The chunk's scores into sc (as the fp32 K pass writes them). qp: the
 * digits of the H query heads (kv4_query_digits, qp_stride apart); part:
 * G x 3 x 16 ints of scratch, used when D > 64 (rows in several segments). */
VNNI_FN static inline __attribute__((always_inline)) void kv4_scores_impl(const job *j, int b, int c,
                                                                          const int32_t *qp, int32_t *part,
                                                                          float *sc, const int D) {
    const int nd = D / 8, nseg = (nd + 7) / 8, G = j->G, bs = j->bs, ct = chunk_tokens(j);
    const int64_t stride = qp_stride(D), ss = j->slot_stride;
    const int64_t L = j->lens[b], *table = j->tables + (int64_t)b * j->width;
    const int64_t p0 = chunk_first(j, c), p1 = chunk_end(j, b, c);
    for (int64_t p = p0; p < p1; p++) {
        const int64_t base = table[p] * bs * ss;
        const int ntok = (int)(L - p * bs < bs ? L - p * bs : bs);
        if (p + PD_PF < p1) {
            const char *next = (const char *)j->k + table[p + PD_PF] * bs * ss;
            for (int64_t o = 0; o < bs * ss; o += 64) _mm_prefetch(next + o, _MM_HINT_T1);
        }
        for (int h = j->h_lo; h < j->h_hi; h++) {
            const uint8_t *rows = j->k + base + h * j->head_stride;
            for (int t0 = 0; t0 < ntok; t0 += BLOCK) {
                const int n = ntok - t0 < BLOCK ? ntok - t0 : BLOCK, off = (int)(p - p0) * bs + t0;
                const uint8_t *blk = rows + t0 * ss;
                __m512 scale, zero;
                block_meta(block_pairs(blk, ss, n, KV_INT4, D), KV_INT4, &scale, &zero);
                for (int s = 0; s < nseg; s++) {
                    const int nw = nd - 8 * s < 8 ? nd - 8 * s : 8;
                    __m512i lo[8], hi[8];
                    transpose_codes(blk, ss, n, s, nw, lo, hi);
                    for (int g = 0; g < G; g++) {
                        const int32_t *qd = qp + (int64_t)(h * G + g) * stride + 8 * s;
                        __m512i acc[6];
                        for (int e = 0; e < 6; e++) acc[e] = _mm512_setzero_si512();
                        for (int i = 0; i < nw; i++)
                            for (int dg = 0; dg < 3; dg++) {
                                acc[2 * dg] = _mm512_dpbusd_epi32(acc[2 * dg], lo[i], bcast_i32(qd + (2 * dg) * nd + i));
                                acc[2 * dg + 1] = _mm512_dpbusd_epi32(acc[2 * dg + 1], hi[i], bcast_i32(qd + (2 * dg + 1) * nd + i));
                            }
                        int32_t *pg = part + (int64_t)g * 48;
                        __m512i sum[3];  /* per digit, over the segments so far */
                        for (int dg = 0; dg < 3; dg++) {
                            sum[dg] = _mm512_add_epi32(acc[2 * dg], acc[2 * dg + 1]);
                            if (s > 0) sum[dg] = _mm512_add_epi32(sum[dg], _mm512_loadu_si512(pg + 16 * dg));
                            if (s + 1 < nseg) _mm512_storeu_si512(pg + 16 * dg, sum[dg]);
                        }
                        if (s + 1 < nseg) continue;
                        const int32_t *tail = qp + (int64_t)(h * G + g) * stride + 6 * nd;
                        float sq, qsum;
                        memcpy(&sq, tail, 4);
                        memcpy(&qsum, tail + 1, 4);
                        __m512 P = _mm512_cvtepi32_ps(_mm512_sub_epi32(sum[2], _mm512_set1_epi32(tail[4])));
                        P = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sum[1], _mm512_set1_epi32(tail[3]))),
                                            _mm512_set1_ps(256.f), P);
                        P = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sum[0], _mm512_set1_epi32(tail[2]))),
                                            _mm512_set1_ps(65536.f), P);
                        const __m512 d = _mm512_mul_ps(scale, _mm512_fnmadd_ps(zero, _mm512_set1_ps(qsum),
                                                                               _mm512_mul_ps(_mm512_set1_ps(sq), P)));
                        _mm512_mask_storeu_ps(sc + (int64_t)(h * G + g) * ct + off, lane_mask(n), d);
                    }
                }
            }
        }
    }
}

#define KV4_SCORES(d) kv4_scores_impl(j, b, c, qp, part, sc, d)
VNNI_FN static void kv4_scores_vnni(const job *j, int b, int c, const int32_t *qp, int32_t *part, float *sc) {
    if (j->D == 64) KV4_SCORES(64);
    else if (j->D == 128) KV4_SCORES(128);
    else KV4_SCORES(j->D);
}
#undef KV4_SCORES

/* whether this job's KV4 scores can take kv4_scores_vnni: a head's row is whole
 * dwords, and the per-head sums of several segments fit the scratch given */
static inline int kv4_vnni_fits(const job *j, int64_t part_ints) {
    return j->D % 8 == 0 && j->D >= 16 && (j->D <= 64 || 48 * (int64_t)j->G <= part_ints);
}

static int vnni_supported(void) {
    __builtin_cpu_init();
    return avx512_supported() && __builtin_cpu_supports("avx512vnni");
}
#endif
