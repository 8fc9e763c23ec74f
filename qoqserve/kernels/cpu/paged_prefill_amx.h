/* The AMX path of paged_prefill.c for KV4 pages (included once by it, after
 * paged_prefill_avx512.h; entered only where the CPU has AMX-INT8 and
 * QOQSERVE_CPU_ISA allows it, for head_dim a multiple of 64).
 *
 * Why: the fp32 path is bound by its multiply-adds, 16 per instruction for
 * q . k and as many for p . v, and on long prompts it is most of a prefill.
 * Here both products are tile products of bytes (tdpbsud: 16 x 16 x 64 per
 * instruction) and the codes never leave bytes:
 * - the scores are those of the decode kernel's VNNI path (kv4_digits.h: the
 *   query in three 8-bit digits of a 22-bit integer, exact INT32 sums, the
 *   same float steps: one code for both), so for the same query and key
 *   the two kernels make the same score;
 * - a row's weights over a tile of 64 keys, w = e * scale (e from the online
 *   softmax, scale the V row's), as a 22-bit integer W = round(w / sw) (sw a
 *   power of two, max W in [2^21, 2^22)), in three unsigned bytes, against the codes - 8 as signed
 *   bytes (tdpbusd): sum W (u - 8) is exact in INT32 and rounded once; the
 *   zero term, sum w (zero - 8), is summed apart in fp32 and removed at the
 *   end, as the decode kernel does.
 * The roundings beyond the fp32 path's are those two quantizations (2^-22 of
 * the row's largest query element or weight in the tile). A row's arithmetic depends on its
 * position and the pages only (tiles of 64 keys counted from position 0,
 * digits and scales per row), so chunking, batch and threads change nothing.
 *
 * Tiles: 0-2 the three digits' INT32 sums, 4-6 the three digit rows (A),
 * 7 the codes (B), all 16 rows x 64 bytes. */
#ifdef KV_AVX512
#define PP_AMX 1
#include "amx_tiles.h"

KV_AVX512_BEGIN
#include "kv4_digits.h"

#define PP_AMX_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c,amx-tile,amx-int8")))
enum { AKEYS = 64 };  /* keys per online-softmax step: one tile's depth of weights */
/* Queries from this position on take the tiles, the earlier ones the fp32
 * path: below it the tiles' fixed costs (the codes' transposition per task,
 * the digits) lose to the fp32 multiply-adds (docs/benchmarks.md) */
enum { AMX_MIN_POS = 256 };

/* whether a KV4 job of head_dim D takes the tiles */
static int prefill_amx(int fmt, int D) {
    return fmt == KV_INT4 && D % 64 == 0 && D <= 512 && amx_allowed() && avx512_supported();
}

#include "paged_prefill_amx_rows.h"

/* 16 weights (>= 0) times 1 / sw -> W = round(w / sw) < 2^24, its three
 * bytes (unsigned digits: W = 65536 a + 256 b + c) at dig, dig + ds, dig + 2 ds */
PP_AMX_FN static inline __attribute__((always_inline)) void weight_digits(__m512 w, __m512 inv, int8_t *dig,
                                                                          int64_t ds) {
    const __m512i W = _mm512_cvtps_epi32(_mm512_mul_ps(w, inv));
    _mm_storeu_si128((__m128i *)(dig + 2 * ds), _mm512_cvtepi32_epi8(W));
    _mm_storeu_si128((__m128i *)(dig + ds), _mm512_cvtepi32_epi8(_mm512_srli_epi32(W, 8)));
    _mm_storeu_si128((__m128i *)dig, _mm512_cvtepi32_epi8(_mm512_srli_epi32(W, 16)));
}

/* the three digits' tiles of sums (0-2) -> ints [3][16][16] */
PP_AMX_FN static inline __attribute__((always_inline)) void store_sums(int32_t *at) {
    _tile_stored(0, at, 64);
    _tile_stored(1, at + 256, 64);
    _tile_stored(2, at + 512, 64);
}

/* ints [3][16][16] of the three tiles of sums -> digit p's row i */
static inline __m512i sums_row(const int32_t *ci, int p, int i) { return _mm512_load_si512(ci + 256 * p + 16 * i); }

/* A task's buffers (task_amx_impl lays them out in its scratch) */
typedef struct {
    int32_t *qd;       /* RB rows of the query digits and tail, qs ints apart */
    int32_t *neg;      /* per 16 rows, 3 x 16 x 16: the score sums' start, -8 sum(digit p) */
    float *o, *lz, *m; /* per row: the weighted sum (planar slots), sum and zero term (16 lanes each), max */
    float *meta;       /* 4 x AKEYS: K, V scales and zeros - 8 of the tile */
    float *sc;         /* 16 x AKEYS: a row block's scores */
    int32_t *ci;       /* 4 x 3 x 16 x 16: sums out of the tiles */
    int8_t *wd;        /* 3 x 16 x AKEYS: a row block's weight digits */
    float *wsc;        /* its 16 rows' sw */
    uint8_t *kb, *vb, *packed;
    int64_t qs;
} amx_bufs;

/* A task's buffers for RB rows (a multiple of 16) laid out from buf, each
 * 64-byte aligned where buf is; the floats they take. With buf NULL only the
 * size (amx_scratch_floats), so that the two cannot disagree. */
static int64_t amx_layout(amx_bufs *b, float *buf, int64_t RB, int D) {
    const int64_t qs = qp_stride(D), neg = (RB * qs + 15) / 16 * 16, o = neg + RB * 48, lz = o + RB * D;
    const int64_t m = lz + RB * 32, meta = m + RB, sc = meta + 4 * AKEYS, ci = sc + 16 * AKEYS;
    const int64_t wd = ci + 4 * 768, wsc = wd + 3 * 16 * AKEYS / 4, kb = wsc + 16;
    const int64_t total = kb + 40 * (int64_t)D;  /* K, V tile operands and the packed rows: 64, 64, 32 D bytes */
    if (!buf) return total;
    b->qs = qs;
    b->qd = (int32_t *)buf;
    b->neg = (int32_t *)(buf + neg);
    b->o = buf + o, b->lz = buf + lz, b->m = buf + m, b->meta = buf + meta, b->sc = buf + sc;
    b->ci = (int32_t *)(buf + ci);
    b->wd = (int8_t *)(buf + wd);
    b->wsc = buf + wsc;
    b->kb = (uint8_t *)(buf + kb);
    b->vb = b->kb + 64 * (int64_t)D;
    b->packed = b->vb + 64 * (int64_t)D;
    return total;
}

/* floats of per-thread scratch for task_amx */
static inline int64_t amx_scratch_floats(const pjob *j) {
    return amx_layout(NULL, NULL, ((int64_t)j->qblock * j->G + 15) / 16 * 16, j->D);
}

/* the score sums of rows r0.. x the tile's keys, out of the tiles into b->ci */
PP_AMX_FN static inline __attribute__((always_inline)) void score_tiles(const amx_bufs *b, int r0, int blocks,
                                                                        const int D) {
    const int nd = D / 8;
    const int32_t *a = b->qd + r0 * b->qs, *neg = b->neg + r0 * 48;
    if (D == 64) {
        _tile_loadd(4, a, b->qs * 4);
        _tile_loadd(5, a + 2 * nd, b->qs * 4);
        _tile_loadd(6, a + 4 * nd, b->qs * 4);
    }
    for (int blk = 0; blk < blocks; blk++) {  /* the sums start at -8 sum(digit): Q . (u - 8) */
        _tile_loadd(0, neg, 64);
        _tile_loadd(1, neg + 256, 64);
        _tile_loadd(2, neg + 512, 64);
        for (int st = 0; st < D / 64; st++) {
            if (D != 64) {
                _tile_loadd(4, a + 16 * st, b->qs * 4);
                _tile_loadd(5, a + 2 * nd + 16 * st, b->qs * 4);
                _tile_loadd(6, a + 4 * nd + 16 * st, b->qs * 4);
            }
            _tile_loadd(7, b->kb + ((int64_t)blk * 2 * nd + 16 * st) * 64, 64);
            _tile_dpbsud(0, 4, 7);
            _tile_dpbsud(1, 5, 7);
            _tile_dpbsud(2, 6, 7);
        }
        store_sums(b->ci + 768 * blk);
    }
}

/* o += sw * sum W (u - 8) for rows r0.. (their weight digits and sw), 4 x 16 slots at a time */
PP_AMX_FN static inline __attribute__((always_inline)) void weighted_sum(const amx_bufs *b, int r0, int R,
                                                                         const int D) {
    int32_t *ci = b->ci;
    _tile_loadd(4, b->wd, AKEYS);
    _tile_loadd(5, b->wd + 16 * AKEYS, AKEYS);
    _tile_loadd(6, b->wd + 32 * AKEYS, AKEYS);
    for (int cg0 = 0; cg0 < D / 16; cg0 += 4) {
        const int ng = D / 16 - cg0 < 4 ? D / 16 - cg0 : 4;
        for (int g = 0; g < ng; g++) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_loadd(7, b->vb + (int64_t)(cg0 + g) * (AKEYS / 4) * 64, 64);
            _tile_dpbusd(0, 4, 7);
            _tile_dpbusd(1, 5, 7);
            _tile_dpbusd(2, 6, 7);
            store_sums(ci + 768 * g);
        }
        for (int i = 0; i < 16 && r0 + i < R; i++) {
            if (b->wsc[i] == 0.f) continue;  /* the row does not see the tile, or its weights are 0 */
            const __m512 sw = _mm512_set1_ps(b->wsc[i]);
            for (int g = 0; g < ng; g++) {  /* 65536 a + 256 b + c: the exact sum in INT32, rounded once */
                const int32_t *cb = ci + 768 * g;
                const __m512i S = _mm512_add_epi32(
                    _mm512_add_epi32(_mm512_slli_epi32(sums_row(cb, 0, i), 16), _mm512_slli_epi32(sums_row(cb, 1, i), 8)),
                    sums_row(cb, 2, i));
                float *dst = b->o + (int64_t)(r0 + i) * D + 16 * (cg0 + g);
                _mm512_store_ps(dst, _mm512_fmadd_ps(sw, _mm512_cvtepi32_ps(S), _mm512_load_ps(dst)));
            }
        }
    }
}

/* rows r0..'s scores from the sums, their online softmax, their weights as
 * digits (the rows from position p0, G to a position, the tile's n keys from k0) */
PP_AMX_FN static inline __attribute__((always_inline)) void softmax_rows(const pjob *j, const amx_bufs *b, int r0,
                                                                         int R, int blocks, int64_t p0, int64_t k0,
                                                                         int n, int G, const int D) {
    const int nd = D / 8;
    for (int blk = 0; blk < blocks; blk++) {
        const __m512 scale = _mm512_load_ps(b->meta + 16 * blk), zero = _mm512_load_ps(b->meta + AKEYS + 16 * blk);
        const int32_t *cb = b->ci + 768 * blk;
        for (int i = 0; i < 16 && r0 + i < R; i++) {
            const __m512i sum[3] = {sums_row(cb, 0, i), sums_row(cb, 1, i), sums_row(cb, 2, i)};
            __m512 sc = kv4_score_centred(sum, b->qd + (r0 + i) * b->qs + 6 * nd, scale, zero);
            if (j->cap2 > 0.f) sc = softcap_ps(sc, j->cap2);
            _mm512_store_ps(b->sc + i * AKEYS + 16 * blk, sc);
        }
    }
    int8_t *wd = b->wd;
    for (int i = 0; i < 16; i++) {
        const int r = r0 + i;
        const int64_t p = p0 + r / G;
        const int nv = r < R ? (int)(p - k0 + 1 < n ? p - k0 + 1 : n) : 0, lo = (int)keys_before_window(j, p, k0);
        if (nv <= lo) {  /* a row that does not see this tile (or no row): weights 0 */
            for (int q = 0; q < 3; q++) memset(wd + q * 16 * AKEYS + i * AKEYS, 0, AKEYS);
            b->wsc[i] = 0.f;
            continue;
        }
        const float *row = b->sc + i * AKEYS;
        float *orow = b->o + (int64_t)r * D, *lrow = b->lz + (int64_t)r * 32;
        __mmask16 valid[AKEYS / 16], above = 0;
        const __m512 mo = _mm512_set1_ps(b->m[r]);
        for (int u = 0; u < AKEYS / 16; u++) {
            valid[u] = lane_mask(nv - 16 * u) & (__mmask16)~lane_mask(lo - 16 * u);
            above |= _mm512_mask_cmp_ps_mask(valid[u], _mm512_load_ps(row + 16 * u), mo, _CMP_GT_OQ);
        }
        if (above) {  /* rare after the first tiles: a new max, and what was summed under the old one rescaled */
            __m512 mv = _mm512_set1_ps(-INFINITY);
            for (int u = 0; u < AKEYS / 16; u++) mv = _mm512_mask_max_ps(mv, valid[u], mv, _mm512_load_ps(row + 16 * u));
            const float mx = _mm512_reduce_max_ps(mv);
            const __m512 f = _mm512_set1_ps(exp2f(b->m[r] - mx));
            for (int c = 0; c < D; c += 16) _mm512_store_ps(orow + c, _mm512_mul_ps(_mm512_load_ps(orow + c), f));
            for (int c = 0; c < 32; c += 16) _mm512_store_ps(lrow + c, _mm512_mul_ps(_mm512_load_ps(lrow + c), f));
            b->m[r] = mx;
        }
        const __m512 mr = _mm512_set1_ps(b->m[r]);
        __m512 lv = _mm512_load_ps(lrow), zv = _mm512_load_ps(lrow + 16), wv[AKEYS / 16], wmax = _mm512_setzero_ps();
        for (int u = 0; u < AKEYS / 16; u++) {
            const __m512 e = _mm512_maskz_mov_ps(valid[u], exp2_ps(_mm512_sub_ps(_mm512_load_ps(row + 16 * u), mr)));
            wv[u] = _mm512_mul_ps(e, _mm512_load_ps(b->meta + 2 * AKEYS + 16 * u));
            lv = _mm512_add_ps(lv, e);
            zv = _mm512_fmadd_ps(wv[u], _mm512_load_ps(b->meta + 3 * AKEYS + 16 * u), zv);
            wmax = _mm512_max_ps(wmax, wv[u]);
        }
        _mm512_store_ps(lrow, lv);
        _mm512_store_ps(lrow + 16, zv);
        /* W = w / sw rounded, sw the power of two with max w / sw in [2^21, 2^22):
         * |sum W (u - 8)| < 2^31 over 64 keys, and w / sw is exact */
        const float wm = _mm512_reduce_max_ps(wmax);
        uint32_t bits;
        memcpy(&bits, &wm, 4);
        const int ex = (int)(bits >> 23) - 127;  /* wm in [2^ex, 2^(ex + 1)): normal, or 0 */
        const uint32_t ib = (uint32_t)(127 + 21 - ex) << 23, sb = (uint32_t)(127 + ex - 21) << 23;
        float fi, fs;
        memcpy(&fi, &ib, 4);
        memcpy(&fs, &sb, 4);
        const __m512 inv = _mm512_set1_ps(wm > 1e-30f ? fi : 0.f);
        b->wsc[i] = wm > 1e-30f ? fs : 0.f;
        for (int u = 0; u < AKEYS / 16; u++) weight_digits(wv[u], inv, wd + i * AKEYS + 16 * u, 16 * AKEYS);
    }
}

PP_AMX_FN static inline __attribute__((always_inline)) void task_amx_impl(const pjob *j, int s, int h, int t0, int t1,
                                                                          float *buf, const int D) {
    const int G = j->G, R = (t1 - t0) * G, RB = (R + 15) / 16 * 16, nd = D / 8;
    amx_bufs b;
    amx_layout(&b, buf, RB, D);
    const int64_t base = j->q_starts[s], pos0 = j->first_pos[s] + t0, last = j->first_pos[s] + t1 - 1;
    for (int r = 0; r < RB; r++) {
        int32_t *qr = b.qd + r * b.qs;
        if (r < R) kv4_query_digits(j->q + ((base + t0 + r / G) * j->H + h * G + r % G) * D, j->qscale, D, qr);
        else memset(qr, 0, sizeof(int32_t) * (size_t)b.qs);
        for (int p = 0; p < 3; p++)
            _mm512_store_si512(b.neg + (r / 16) * 768 + 256 * p + 16 * (r % 16), _mm512_set1_epi32(-qr[6 * nd + 2 + p]));
        b.m[r] = -INFINITY;
    }
    memset(b.o, 0, sizeof(float) * (size_t)RB * D);
    memset(b.lz, 0, sizeof(float) * (size_t)RB * 32);
    amx_begin();
    for (int64_t k0 = first_tile(j, pos0, AKEYS); k0 <= last; k0 += AKEYS) {
        const int n = (int)(last + 1 - k0 < AKEYS ? last + 1 - k0 : AKEYS), blocks = (n + 15) / 16;
        amx_tile_rows(j, s, k0, n, h, D, b.kb, b.vb, b.packed, b.meta);
        const int first = (int)(k0 > pos0 ? k0 - pos0 : 0) * G;  /* the first row that sees this tile */
        for (int r0 = first / 16 * 16; r0 < R; r0 += 16) {
            score_tiles(&b, r0, blocks, D);
            softmax_rows(j, &b, r0, R, blocks, pos0, k0, n, G, D);
            weighted_sum(&b, r0, R, D);
        }
    }
    amx_end();
    for (int r = 0; r < R; r++) {
        float *dst = j->out + ((base + t0 + r / G) * j->H + h * G + r % G) * D;
        const float l = _mm512_reduce_add_ps(_mm512_load_ps(b.lz + (int64_t)r * 32));
        const float z = _mm512_reduce_add_ps(_mm512_load_ps(b.lz + (int64_t)r * 32 + 16));
        store_output(b.o + (int64_t)r * D, KV_INT4, D, D, _mm512_set1_ps(z), _mm512_set1_ps(1.f / l), NULL, dst);
    }
}

PP_AMX_FN static void task_amx(const pjob *j, int s, int h, int t0, int t1, float *buf) {
    if (j->D == 64) task_amx_impl(j, s, h, t0, t1, buf, 64);
    else if (j->D == 128) task_amx_impl(j, s, h, t0, t1, buf, 128);
    else task_amx_impl(j, s, h, t0, t1, buf, j->D);
}
KV_AVX512_END
#endif
