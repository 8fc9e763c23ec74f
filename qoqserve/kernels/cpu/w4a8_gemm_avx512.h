/* The AVX-512 VNNI and AMX-INT8 loops of w4a8_gemm.c (included once by it,
 * inside its x86 section, after its Job, tiled() and the scalar code), over
 * the layout that file describes: tile_packed unpacks the codes of a row
 * tile's 4 weight blocks in registers (and writes the expanded panel for the
 * later row tiles, which tile_panel reads), tile_codes takes one or two rows
 * on the raw codes; blocks_amx (w4a8_gemm_amx.h) runs the tiles over the expanded panel. */
SIMD static void silu_mul_row_simd(const void *gate, const void *up, int bf16, int64_t n, float *out) {
    silu_mul_row(gate, up, bf16, n, out);
}

SIMD static void add_norm_row_simd(void *h, const void *d, const float *wv, int64_t t, int64_t K, float eps,
                                   int bf16, float *xv, int store) {
    add_norm_row(h, d, wv, t, K, eps, bf16, xv, store);
}

/* epilogue of one row of one weight block from its INT32 accumulator: x_q . w
 * exactly, or (offset) x_q . (w + 128), the unsigned operand of tile_packed */
SIMD static inline void store_exact(const Job *j, int64_t m, int64_t nb, __m512i acc, int offset) {
    const int64_t n0 = nb * NB;
    const __mmask16 k = lane_mask(j->N - n0);
    if (offset) acc = _mm512_sub_epi32(acc, _mm512_set1_epi32(128 * j->qsum[m]));
    char *y = (char *)j->y + (m * j->N + n0) * (j->out_bf16 ? 2 : 4);
    store_epilogue(acc, j->sa[m], j->s1 + n0, j->zs1 ? j->zs1 + n0 : NULL, j->rowsum ? j->rowsum[m] : 0.f,
                   j->bias ? j->bias + n0 : NULL, y, j->out_bf16, k);
}

/* exp_f32 (silu_mul_row.h) on 2 x 16 lanes, the same operations in the same
 * order; two vectors at once, so that one's latency hides the other's */
SIMD static inline void exp16x2(__m512 *x) {
    const __m512 big = _mm512_set1_ps(12582912.0f), lo = _mm512_set1_ps(-87.0f), hi = _mm512_set1_ps(88.0f);
    const float c[6] = {1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f};
    __m512 n[2], r[2], p[2];
    for (int v = 0; v < 2; v++) {
        x[v] = _mm512_mask_mov_ps(x[v], _mm512_cmp_ps_mask(x[v], lo, _CMP_LT_OQ), lo);
        x[v] = _mm512_mask_mov_ps(x[v], _mm512_cmp_ps_mask(x[v], hi, _CMP_GT_OQ), hi);
        n[v] = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(x[v], _mm512_set1_ps(1.44269504088896341f)), big), big);
        r[v] = _mm512_sub_ps(x[v], _mm512_mul_ps(n[v], _mm512_set1_ps(0.693359375f)));
        r[v] = _mm512_sub_ps(r[v], _mm512_mul_ps(n[v], _mm512_set1_ps(-2.12194440e-4f)));
        p[v] = _mm512_set1_ps(1.0f / 720.0f);
    }
    for (int i = 0; i < 6; i++)
        for (int v = 0; v < 2; v++) p[v] = _mm512_add_ps(_mm512_mul_ps(p[v], r[v]), _mm512_set1_ps(c[i]));
    for (int v = 0; v < 2; v++) {
        const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n[v]), _mm512_set1_epi32(127)), 23);
        x[v] = _mm512_mul_ps(p[v], _mm512_castsi512_ps(e));
    }
}

/* Epilogue of one row's silu pairs (y_silu): acc[0], acc[1] the gate and up
 * blocks nb0, nb0 + 1, acc[2], acc[3] those of the next pair (pairs: 1 or 2),
 * as gate_up would hold them, into silu_mul_value (silu_mul_row.h) of each
 * pair at y's channels 16 (nb0 / 2) ..: what silu_mul of the stored pairs gives. */
SIMD static void store_silu(const Job *j, int64_t m, int64_t nb0, int pairs, __m512i a0, __m512i a1, __m512i a2,
                            __m512i a3, int offset) {
    const __m512i acc[4] = {a0, a1, a2, a3};
    const __m512i c = _mm512_set1_epi32(offset ? 128 * j->qsum[m] : 0);
    const float rs = j->rowsum ? j->rowsum[m] : 0.f;
    __m512 g[2], u[2], x[2];
    for (int v = 0; v < 2; v++) {
        __m512 y[2];
        for (int h = 0; h < 2; h++) {  /* gate, up */
            const int64_t n0 = (nb0 + 2 * v + h) * NB;
            y[h] = v < pairs ? epilogue_value(_mm512_sub_epi32(acc[2 * v + h], c), j->sa[m], j->s1 + n0,
                                              j->zs1 ? j->zs1 + n0 : NULL, rs, j->bias ? j->bias + n0 : NULL,
                                              0xffff)
                             : _mm512_setzero_ps();
            if (j->out_bf16) y[h] = bf16_value(y[h]);
        }
        g[v] = y[0], u[v] = y[1];
        x[v] = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g[v]), _mm512_set1_epi32(INT32_MIN)));
    }
    exp16x2(x);  /* e^-g */
    for (int v = 0; v < pairs; v++) {
        const __m512 s = _mm512_div_ps(g[v], _mm512_add_ps(_mm512_set1_ps(1.0f), x[v]));
        const __m512 out = j->out_bf16 ? bf16_value(_mm512_mul_ps(bf16_value(s), u[v])) : _mm512_mul_ps(s, u[v]);
        const int64_t at = m * (j->N / 2) + (nb0 / 2 + v) * NB;
        if (j->out_bf16) _mm256_storeu_si256((__m256i *)((uint16_t *)j->y + at), to_bf16(out));
        else _mm512_storeu_ps((float *)j->y + at, out);
    }
}

SIMD static inline __m512i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* The accumulators are named registers, not an array (GCC copies an array of
 * zmm around on every iteration); guards are constants at each call site. */
#define FOR_ROWS(X, b) X(0, b) X(1, b) X(2, b) X(3, b) X(4, b) X(5, b)
#define FOR_TILE(X) FOR_ROWS(X, 0) FOR_ROWS(X, 1) FOR_ROWS(X, 2) FOR_ROWS(X, 3)
#define FOR_BLOCKS(X) X(0) X(1) X(2) X(3)
#define DECLARE(i, b) __m512i a##i##b = _mm512_setzero_si512();
#define STORE(i, b) if (i < mr && b < nr) store_exact(j, m0 + i, nb0 + b, a##i##b, j->gp != NULL);
/* y_silu: blocks (0, 1) and (2, 3) of the tile are (gate, up) pairs */
#define STORE_PAIRS(i, unused) \
    if (i < mr) store_silu(j, m0 + i, nb0, nr / 2, a##i##0, a##i##1, a##i##2, a##i##3, j->gp != NULL);
#define STORE_TILE() if (j->silu) { FOR_ROWS(STORE_PAIRS, 0) } else { FOR_TILE(STORE) }
#define DP(i, b, wv, kk) if (i < mr && b < nr) a##i##b = _mm512_dpbusd_epi32(a##i##b, wv, bcast4(x + i * Kp + (kk)));
#define DP_LO(i, b) DP(i, b, lo##b, 8 * p)
#define DP_HI(i, b) DP(i, b, hi##b, 8 * p + 4)
/* s2 in the low byte of each 16-bit lane, c in every byte, per 32-bit lane (channel) */
#define GROUP_PARAMS(b) __m512i s2w##b = _mm512_setzero_si512(), cw##b = s2w##b; \
    if (grouped && b < nr) { \
        __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(g + gi * gstep + b * NB))); \
        __m512i s2 = _mm512_add_epi32(_mm512_srli_epi32(d, 4), one); \
        __m512i zs2 = _mm512_mullo_epi16(s2, _mm512_and_si512(d, nib)); \
        s2w##b = _mm512_or_si512(s2, _mm512_slli_epi32(s2, 16)); \
        cw##b = _mm512_shuffle_epi8(_mm512_sub_epi32(zs2, c128), rep); \
    }
/* unit (p, b)'s low and high nibbles (codes) into lo##b, hi##b, zero past nr;
 * the line CODES_AHEAD units on requested */
#define CODES(b) __m512i lo##b = _mm512_setzero_si512(), hi##b = lo##b; \
    if (b < nr) { \
        _mm_prefetch((const char *)w + (p + CODES_AHEAD) * wstep + b * 64, _MM_HINT_T1); \
        __m512i pk = _mm512_loadu_si512(w + p * wstep + b * 64); \
        lo##b = _mm512_and_si512(pk, nib); \
        hi##b = _mm512_and_si512(_mm512_srli_epi16(pk, 4), nib); \
    }
#define UNPACK(b) CODES(b) \
    if (b < nr) { \
        if (grouped) { \
            lo##b = _mm512_sub_epi8(_mm512_mullo_epi16(lo##b, s2w##b), cw##b); \
            hi##b = _mm512_sub_epi8(_mm512_mullo_epi16(hi##b, s2w##b), cw##b); \
        } \
        if (panel) { \
            _mm512_store_si512(panel + b * pblock + p * 128, lo##b); \
            _mm512_store_si512(panel + b * pblock + p * 128 + 64, hi##b); \
        } \
    }
#define BLOCK(b) UNPACK(b) FOR_ROWS(DP_LO, b) FOR_ROWS(DP_HI, b)

/* rows m0..m0+mr of blocks nb0..nb0+nr from the packed codes; with a panel,
 * also writes the expanded operand there for the later row tiles */
SIMD static inline __attribute__((always_inline)) void tile_packed(
        const Job *j, int64_t m0, int64_t nb0, const int mr, const int nr, const int grouped,
        uint8_t *panel) {
    FOR_TILE(DECLARE)
    const int64_t Kp = j->Kp, octets = Kp / 8, pblock = Kp * NB;
    const int64_t per_group = grouped ? j->group / 8 : octets, groups = grouped ? Kp / j->group : 1;
    int64_t wstep, gstep = 0;
    const uint8_t *w = tiled(j->w, j, nb0, octets, 64, &wstep);
    const uint8_t *g = grouped ? tiled(j->gp, j, nb0, groups, NB, &gstep) : NULL;
    (void)g;
    const int8_t *x = j->xq + m0 * Kp;
    const __m512i nib = _mm512_set1_epi8(0x0f);
    const __m512i rep = _mm512_set4_epi32(0x0c0c0c0c, 0x08080808, 0x04040404, 0x00000000);
    const __m512i one = _mm512_set1_epi32(1), c128 = _mm512_set1_epi32(128);
    (void)rep; (void)one; (void)c128;
    for (int64_t gi = 0; gi < groups; gi++) {
        FOR_BLOCKS(GROUP_PARAMS)
        for (int64_t p = gi * per_group; p < (gi + 1) * per_group; p++) {
            FOR_BLOCKS(BLOCK)
        }
    }
    STORE_TILE()
}

#define WLOAD(b) __m512i w##b = _mm512_setzero_si512(); if (b < nr) w##b = _mm512_load_si512(panel + b * pblock + q * 64);
#define DP_PANEL(i, b) DP(i, b, w##b, 4 * q)

/* rows m0..m0+mr from the expanded panel: int8_linear.c's tile */
SIMD static inline __attribute__((always_inline)) void tile_panel(
        const Job *j, int64_t m0, int64_t nb0, const int mr, const int nr, const uint8_t *panel) {
    FOR_TILE(DECLARE)
    const int64_t Kp = j->Kp, pblock = Kp * NB;
    const int8_t *x = j->xq + m0 * Kp;
    for (int64_t q = 0; q < Kp / 4; q++) {
        FOR_BLOCKS(WLOAD)
        FOR_TILE(DP_PANEL)
    }
    STORE_TILE()
}

#define CASE_P(a, b) case (a) * 8 + (b): \
    if (j->gp) tile_packed(j, m0, nb0, a, b, 1, panel); else tile_packed(j, m0, nb0, a, b, 0, panel); break;
#define CASE_R(a, b) case (a) * 8 + (b): tile_panel(j, m0, nb0, a, b, panel); break;
#define ROW(C, a) C(a, 1) C(a, 2) C(a, 3) C(a, 4)

/* Sum of the INT8 values x[0..n) (n a multiple of 8), by sums of absolute
 * differences of x + 128 against zero */
SIMD static inline int32_t sum_i8(const int8_t *x, int64_t n) {
    const __m512i flip = _mm512_set1_epi8((char)0x80), zero = _mm512_setzero_si512();
    __m512i acc = zero;
    int64_t k = 0;
    for (; k + 64 <= n; k += 64)
        acc = _mm512_add_epi64(acc, _mm512_sad_epu8(_mm512_xor_si512(_mm512_loadu_si512(x + k), flip), zero));
    if (k < n) {
        const __mmask64 m = ((__mmask64)1 << (n - k)) - 1;
        const __m512i v = _mm512_maskz_mov_epi8(m, _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, x + k), flip));
        acc = _mm512_add_epi64(acc, _mm512_sad_epu8(v, zero));
    }
    return (int32_t)(_mm512_reduce_add_epi64(acc) - 128 * n);
}

/* One or two rows, grouped layouts: the codes u go into vpdpbusd as they are,
 * P = x_q . u per group, and each group adds s2 * (P - z * sum(x_q)) to the
 * accumulator: the same integer as tile_packed's sum of s2*(u - z)*x_q, with
 * half the multiplies per code (no per-code s2*(u - z) expansion). */
#define FOR_ROWS2(X, b) X(0, b) X(1, b)
#define FOR_TILE2(X) FOR_ROWS2(X, 0) FOR_ROWS2(X, 1) FOR_ROWS2(X, 2) FOR_ROWS2(X, 3)
#define DECLARE_G(i, b) __m512i t##i##b = _mm512_setzero_si512(), g##i##b;
#define ZERO_G(i, b) g##i##b = _mm512_setzero_si512();
#define DPC(i, b, wv, kk) if (i < mr && b < nr) g##i##b = _mm512_dpbusd_epi32(g##i##b, wv, bcast4(x + i * Kp + (kk)));
#define DPC_LO(i, b) DPC(i, b, lo##b, 8 * p)
#define DPC_HI(i, b) DPC(i, b, hi##b, 8 * p + 4)
#define BLOCK_C(b) CODES(b) FOR_ROWS2(DPC_LO, b) FOR_ROWS2(DPC_HI, b)
#define SCALE_G(i, b) if (i < mr && b < nr) { \
        __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(g + gi * gstep + b * NB))); \
        __m512i s2 = _mm512_add_epi32(_mm512_srli_epi32(d, 4), one), z = _mm512_and_si512(d, low4); \
        t##i##b = _mm512_add_epi32(t##i##b, _mm512_mullo_epi32(s2, _mm512_sub_epi32(g##i##b, _mm512_mullo_epi32(z, xs##i)))); \
    }
#define STORE_T(i, b) if (i < mr && b < nr) store_exact(j, m0 + i, nb0 + b, t##i##b, 0);
#define STORE_T_PAIRS(i, unused) if (i < mr) store_silu(j, m0 + i, nb0, nr / 2, t##i##0, t##i##1, t##i##2, t##i##3, 0);

SIMD static inline __attribute__((always_inline)) void tile_codes(const Job *j, int64_t m0, int64_t nb0,
                                                                  const int mr, const int nr) {
    FOR_TILE2(DECLARE_G)
    const int64_t Kp = j->Kp, octets = Kp / 8;
    const int64_t per_group = j->group / 8, groups = Kp / j->group;
    int64_t wstep, gstep;
    const uint8_t *w = tiled(j->w, j, nb0, octets, 64, &wstep), *g = tiled(j->gp, j, nb0, groups, NB, &gstep);
    const int8_t *x = j->xq + m0 * Kp;
    const __m512i nib = _mm512_set1_epi8(0x0f), one = _mm512_set1_epi32(1), low4 = _mm512_set1_epi32(15);
    for (int64_t gi = 0; gi < groups; gi++) {
        FOR_TILE2(ZERO_G)
        const __m512i xs0 = _mm512_set1_epi32(sum_i8(x + gi * j->group, j->group));
        const __m512i xs1 = mr > 1 ? _mm512_set1_epi32(sum_i8(x + Kp + gi * j->group, j->group)) : xs0;
        for (int64_t p = gi * per_group; p < (gi + 1) * per_group; p++) {
            FOR_BLOCKS(BLOCK_C)
        }
        FOR_TILE2(SCALE_G)
    }
    if (j->silu) { FOR_ROWS2(STORE_T_PAIRS, 0) } else { FOR_TILE2(STORE_T) }
}

#define CASE_C(a, b) case (a) * 8 + (b): tile_codes(j, m0, nb0, a, b); break;

SIMD static void run_codes(const Job *j, int64_t m0, int64_t nb0, int mr, int nr) {
    switch (mr * 8 + nr) { ROW(CASE_C, 1) ROW(CASE_C, 2) }
}

/* mr = 0: no rows, only the panel written (the AMX path's expansion) */
SIMD static void run_packed(const Job *j, int64_t m0, int64_t nb0, int mr, int nr, uint8_t *panel) {
    switch (mr * 8 + nr) {
        ROW(CASE_P, 0) ROW(CASE_P, 1) ROW(CASE_P, 2) ROW(CASE_P, 3) ROW(CASE_P, 4) ROW(CASE_P, 5) ROW(CASE_P, 6)
    }
}

SIMD static void run_panel(const Job *j, int64_t m0, int64_t nb0, int mr, int nr, const uint8_t *panel) {
    switch (mr * 8 + nr) { ROW(CASE_R, 1) ROW(CASE_R, 2) ROW(CASE_R, 3) ROW(CASE_R, 4) ROW(CASE_R, 5) ROW(CASE_R, 6) }
}

/* share `part` of `parts` of the n 64-byte lines at p into L2 */
SIMD static inline void prefetch_share(const uint8_t *p, int64_t n, int64_t part, int64_t parts) {
    for (int64_t i = n * part / parts; i < n * (part + 1) / parts; i++)
        _mm_prefetch((const char *)p + 64 * i, _MM_HINT_T1);
}

SIMD static void blocks_simd(const Job *j, int64_t nb_lo, int64_t nb_hi, uint8_t *panel) {
    const int64_t octets = j->Kp / 8, groups = j->gp ? j->Kp / j->group : 0;
    for (int64_t nb0 = nb_lo, end; nb0 < nb_hi; nb0 = end) {
        end = (nb0 / NR + 1) * NR < nb_hi ? (nb0 / NR + 1) * NR : nb_hi;  /* within one layout tile */
        const int nr = (int)(end - nb0);
        /* Past one tile, the first row tile (the one that unpacks the codes)
         * takes PACKED_MR rows and the later ones the rest, as evenly as MR
         * allows (28 rows: 6 6 6 5 5, not 6 6 6 6 4). */
        const int64_t first = j->M > MR ? PACKED_MR : j->M, later = (j->M - first + MR - 1) / MR;
        const int64_t tiles = 1 + later, base = later ? (j->M - first) / later : 0;
        const int64_t extra = later ? (j->M - first) % later : 0;
        /* The first row tile reads the codes from memory as fast as its few rows
         * use them, the later ones only the panel: so, while those run, the
         * next layout tile's codes and group bytes come into L2, a share per
         * row tile, and its first row tile finds them there. */
        const uint8_t *next_w = NULL, *next_g = NULL;
        int64_t w_lines = 0, g_lines = 0;
        if (tiles > 1 && end < nb_hi) {
            int64_t wstep, gstep;
            next_w = tiled(j->w, j, end, octets, 64, &wstep);
            w_lines = octets * wstep / 64;
            if (j->gp) {
                next_g = tiled(j->gp, j, end, groups, NB, &gstep);
                g_lines = (groups * gstep + 63) / 64;
            }
        }
        int64_t m0 = 0;
        for (int64_t t = 0; t < tiles; t++) {
            const int mr = (int)(t == 0 ? first : base + (t - 1 < extra));
            if (t > 0 && next_w) {
                prefetch_share(next_w, w_lines, t - 1, tiles - 1);
                if (next_g) prefetch_share(next_g, g_lines, t - 1, tiles - 1);
            }
            if (tiles == 1 && mr <= 2 && j->gp) run_codes(j, 0, nb0, mr, nr);
            else if (t == 0) run_packed(j, 0, nb0, mr, nr, tiles > 1 ? panel : NULL);
            else run_panel(j, m0, nb0, mr, nr, panel);
            m0 += mr;
        }
    }
}

#include "w4a8_gemm_amx.h"  /* the AMX-INT8 path over the same panel and epilogues */
