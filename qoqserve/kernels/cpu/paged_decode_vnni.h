/* KV4 scores by integer dot products (AVX-512 VNNI), for paged_decode.c's
 * vector path (included by paged_decode_avx512.h, inside its AVX-512 region;
 * its functions add VNNI to the target and run only after a CPUID check).
 *
 * Why: with the codes converted to fp32, q . k costs D/16 FMAs per row and
 * head plus a horizontal sum, and the K pass was most of the kernel. Here the
 * codes never leave bytes: the query is in integer digits (kv4_digits.h),
 * summed against the codes exactly by vpdpbusd. The packed rows of 16 tokens
 * are transposed by dwords (4 packed bytes: 8 channels), so each lane is one
 * token and its sum needs no horizontal reduction: one vpdpbusd per digit
 * covers 4 channels of 16 tokens; kv4_score makes the scores.
 * Every sum is in a fixed order per (sequence, chunk, head): batch- and
 * thread-invariant as the rest of the kernel. */
#ifndef QOQSERVE_PAGED_DECODE_VNNI_H
#define QOQSERVE_PAGED_DECODE_VNNI_H
#include "kv4_digits.h"
#define VNNI_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")))

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
    const int64_t p0 = chunk_first(j, b, c), p1 = chunk_end(j, b, c);
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
                        const __m512 d = kv4_score(sum, qp + (int64_t)(h * G + g) * stride + 6 * nd, scale, zero);
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
