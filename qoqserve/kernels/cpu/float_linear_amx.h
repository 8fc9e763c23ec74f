/* float_linear's AMX-BF16 path (`tdpbf16ps`): bf16 rows times bf16 weights on
 * the tile unit, at every row count. Included by float_linear.c inside its x86
 * block (lane_mask, pair_mask, grow_scratch).
 *
 * The weights stay as the model holds them, [N, K] row-major: 16 weight rows
 * x 32 k (64 bytes a row, the row stride apart) are an A tile as they lie, so
 * nothing is repacked or copied at load. The rows of x are the B operand,
 * which AMX wants as k-pairs x columns: per call, x [M, K] is rewritten once
 * as 1 KB tiles (16 rows m x 16 k-pairs, transposed) before the team starts
 * on the columns; x is small beside the weights. Each accumulator tile is
 * y^T (16 outputs n x 16 rows m) and is transposed back on its way out.
 *
 * One fixed order per output, whatever M, the tiling or the threads: every
 * output starts at zero and takes its k-blocks of 32 in increasing k, each
 * through one tdpbf16ps, whose sum over a block is the hardware's own but
 * the same for every row and column (an output's value depends only on its
 * weight row and its x row). Rows past M are zero columns of the B tiles;
 * weights past N or K come from a zero-padded copy of the block, never read
 * beyond the tensor. Not the dot path's bits (float_linear_dot.h) nor the
 * fp32 paths', but as batch-invariant: a CPU with AMX-BF16 takes this path
 * for every bf16 x bf16 call. tdpbf16ps reads denormal inputs as zero and
 * flushes denormal results, as vdpbf16ps does.
 */
#ifndef QOQSERVE_FLOAT_LINEAR_AMX_H
#define QOQSERVE_FLOAT_LINEAR_AMX_H

#include "amx_tiles.h"

/* a superset of AMX_FN's target, so that amx_begin inlines */
#define AMXB __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16,amx-tile,amx-int8,amx-bf16")))

enum { KBLOCK = 32, TILE_DWORDS = 256 };  /* the k of one A tile row; a 1 KB tile in dwords */

static int amx_bf16_state;  /* 0 unknown, 1 usable, -1 not */

/* the tiles as amx_supported() grants them (AMX-TILE, AMX-INT8 and the
 * process's tile state), AMX-BF16 besides, and the dot path's AVX512-BF16.
 * Asked once: every call checks its path against it, and in a VM each
 * cpuid traps to the hypervisor (measured: a bf16 decode step ~30% slower) */
static int amx_bf16_supported(void) {
    if (!amx_bf16_state) {
        unsigned eax, ebx, ecx, edx;
        const int ok = dot_supported() && amx_supported() && __get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) &&
                       (edx >> 22 & 1);
        __atomic_store_n(&amx_bf16_state, ok ? 1 : -1, __ATOMIC_RELAXED);
    }
    return amx_bf16_state > 0;
}

/* x^T's tiles: m-block mb's k-block kb at xt + (mb * kblocks + kb) * TILE_DWORDS.
 * One row (M = 1) is a B tile of one column as it lies, k-pair p at dword p of
 * the block: its "tiles" are the row, zero-padded to whole k-blocks, and the
 * B and accumulator tiles are configured one column (4 bytes) wide */
static inline int64_t x_tiles_bytes(int64_t M, int64_t K) {
    const int64_t kblocks = (K + KBLOCK - 1) / KBLOCK;
    return M == 1 ? kblocks * KBLOCK * 2 : (M + 15) / 16 * kblocks * TILE_DWORDS * 4;
}

/* the tile shapes for a call of one row (one-column B and accumulator
 * tiles) or of more */
AMXB static void amx_tiles_begin(int one_row) { amx_begin_shaped(one_row ? 4 : 64, one_row ? 4 : 64); }

/* 16 x 16 dwords transposed: o[p] lane j = r[j] lane p */
AMXB static inline void transpose16(const __m512i *r, __m512i *o) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {  /* per 128-bit lane L: rows 2i, 2i+1 of elements 4L.. interleaved */
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {  /* u[4i + e] lane L: rows 4i..4i+3 of element 4L + e */
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int e = 0; e < 4; e++) {  /* o[4L + e]: lane L of u[e], u[4 + e], u[8 + e], u[12 + e] */
        const __m512i a = _mm512_shuffle_i32x4(u[e], u[4 + e], 0x88), b = _mm512_shuffle_i32x4(u[e], u[4 + e], 0xDD);
        const __m512i c = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0x88);
        const __m512i d = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0xDD);
        o[e] = _mm512_shuffle_i32x4(a, c, 0x88);
        o[4 + e] = _mm512_shuffle_i32x4(b, d, 0x88);
        o[8 + e] = _mm512_shuffle_i32x4(a, c, 0xDD);
        o[12 + e] = _mm512_shuffle_i32x4(b, d, 0xDD);
    }
}

/* tiles t of T (tile index = mb * kblocks + kb) of x^T from bf16 x [M, K]:
 * row p of a tile holds k-pair p of the block for its 16 rows m (zero past M
 * and K) */
AMXB static void x_tiles(const uint16_t *x, int64_t M, int64_t K, uint32_t *xt, int t, int T) {
    const int64_t kblocks = (K + KBLOCK - 1) / KBLOCK, tiles = (M + 15) / 16 * kblocks;
    if (M == 1) {
        if (t == 0) {
            memcpy(xt, x, (size_t)K * sizeof(uint16_t));
            memset((uint16_t *)xt + K, 0, (size_t)(kblocks * KBLOCK - K) * sizeof(uint16_t));
        }
        return;
    }
    for (int64_t i = tiles * t / T; i < tiles * (t + 1) / T; i++) {
        const int64_t m0 = i / kblocks * 16, k0 = i % kblocks * KBLOCK;
        const __mmask32 mask = pair_mask(K - k0);
        __m512i r[16], o[16];
        for (int j = 0; j < 16; j++)
            r[j] = m0 + j < M ? _mm512_maskz_loadu_epi16(mask, x + (m0 + j) * K + k0) : _mm512_setzero_si512();
        transpose16(r, o);
        for (int p = 0; p < 16; p++) _mm512_store_si512(xt + i * TILE_DWORDS + p * 16, o[p]);
    }
}

/* weight_block's scratch for the two blocks of a pass */
static inline size_t weight_edge_bytes(int64_t K) {
    return (size_t)(32 * ((K + KBLOCK - 1) / KBLOCK * KBLOCK)) * sizeof(uint16_t);
}

/* The A tiles' source for weight rows n0..n0+15: the weights in place
 * (stride K), or where the block runs past N, or K is not whole k-blocks, a
 * zero-padded copy in `edge` [16, kp] (stride kp) */
AMXB static const uint16_t *weight_block(const uint16_t *w, int64_t K, int64_t N, int64_t n0, uint16_t *edge,
                                         int64_t *stride) {
    const int64_t kp = (K + KBLOCK - 1) / KBLOCK * KBLOCK;
    if (kp == K && n0 + 16 <= N) {
        *stride = K;
        return w + n0 * K;
    }
    memset(edge, 0, (size_t)(16 * kp) * sizeof(uint16_t));
    for (int64_t j = 0; j < 16 && n0 + j < N; j++) memcpy(edge + j * kp, w + (n0 + j) * K, (size_t)K * sizeof(uint16_t));
    *stride = kp;
    return edge;
}

/* tiles 0-3 = weight blocks (1 or 2) x row blocks (1 or 2) over every
 * k-block: tile 0 (a0, b0), 1 (a1, b0), 2 (a0, b1), 3 (a1, b1); b1 is the
 * m-block after b0. A B tile's rows are bstride bytes apart, its k-blocks
 * bstep dwords (x_tiles: 64 and a tile, one row: 4 and 16) */
AMXB static inline __attribute__((always_inline)) void bf16_pass(const uint16_t *a0, int64_t s0,
                                                                const uint16_t *a1, int64_t s1,
                                                                const uint32_t *b0, int64_t bstride,
                                                                int64_t bstep, int64_t kblocks,
                                                                const int two_n, const int two_m) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    const uint32_t *b1 = b0 + kblocks * TILE_DWORDS;
    for (int64_t kb = 0; kb < kblocks; kb++) {
        _tile_loadd(4, a0 + kb * KBLOCK, s0 * 2);
        _tile_loadd(6, b0 + kb * bstep, bstride);
        _tile_dpbf16ps(0, 4, 6);
        if (two_n) {
            _tile_loadd(5, a1 + kb * KBLOCK, s1 * 2);
            _tile_dpbf16ps(1, 5, 6);
        }
        if (two_m) {
            _tile_loadd(7, b1 + kb * TILE_DWORDS, 64);
            _tile_dpbf16ps(2, 4, 7);
            if (two_n) _tile_dpbf16ps(3, 5, 7);
        }
    }
}

/* an accumulator tile's y^T block (outputs n0.., rows m0..), stored in buf,
 * into y's rows below `rows` and columns below n_hi */
AMXB static void put_block(const float *buf, int64_t m0, int64_t rows, int64_t n0, int64_t n_hi, int64_t N,
                           float *y) {
    const __mmask16 mask = lane_mask(n_hi - n0);
    if (rows - m0 <= 2) {  /* decode: gather the one or two columns instead of the whole transpose */
        const __m512i column = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208,
                                                 224, 240);
        for (int j = 0; m0 + j < rows; j++)
            _mm512_mask_storeu_ps(y + (m0 + j) * N + n0, mask, _mm512_i32gather_ps(column, buf + j, 4));
        return;
    }
    __m512i r[16], o[16];
    for (int j = 0; j < 16; j++) r[j] = _mm512_load_si512(buf + 16 * j);
    transpose16(r, o);
    for (int j = 0; j < 16 && m0 + j < rows; j++)
        _mm512_mask_storeu_ps(y + (m0 + j) * N + n0, mask, _mm512_castsi512_ps(o[j]));
}

#define AMXB_PUT(tile, m0, n0) do { \
        _tile_stored(tile, buf, one_row ? 4 : 64); \
        if (one_row) _mm512_mask_storeu_ps(y + (n0), lane_mask(n_hi - (n0)), _mm512_load_ps(buf)); \
        else put_block(buf, m0, rows, n0, n_hi, N, y); \
    } while (0)

/* columns n_lo..n_hi of `rows` rows whose x^T tiles start at xt (one_row:
 * the one row of a call of one), from weights w [N_w, K]; y row stride N.
 * edge: 2 x [16, kp] bf16 of scratch for weight_block. Between the thread's
 * amx_tiles_begin(one_row) and amx_end */
AMXB static void rows_amx(const uint32_t *xt, int one_row, int64_t rows, int64_t K, const uint16_t *w,
                          int64_t N_w, int64_t n_lo, int64_t n_hi, int64_t N, float *y, uint16_t *edge) {
    const int64_t kblocks = (K + KBLOCK - 1) / KBLOCK, kp = kblocks * KBLOCK;
    _Alignas(64) float buf[TILE_DWORDS];
    /* up to 16 rows each weight is read once: one weight block a pass, whose
     * 16 rows stream from memory better than 32 (docs/benchmarks.md) */
    const int64_t nstep = rows > 16 ? 32 : 16;
    for (int64_t n0 = n_lo; n0 < n_hi; n0 += nstep) {
        const int two_n = nstep == 32 && n0 + 16 < n_hi;
        int64_t s0, s1 = 0;
        const uint16_t *a0 = weight_block(w, K, N_w, n0, edge, &s0);
        const uint16_t *a1 = two_n ? weight_block(w, K, N_w, n0 + 16, edge + 16 * kp, &s1) : a0;
        for (int64_t m0 = 0; m0 < rows; m0 += 32) {
            const int two_m = m0 + 16 < rows;
            const uint32_t *b0 = xt + m0 / 16 * kblocks * TILE_DWORDS;
            if (one_row) bf16_pass(a0, s0, a1, s1, xt, 4, KBLOCK / 2, kblocks, 0, 0);
            else if (two_n && two_m) bf16_pass(a0, s0, a1, s1, b0, 64, TILE_DWORDS, kblocks, 1, 1);
            else if (two_n) bf16_pass(a0, s0, a1, s1, b0, 64, TILE_DWORDS, kblocks, 1, 0);
            else if (two_m) bf16_pass(a0, s0, a1, s1, b0, 64, TILE_DWORDS, kblocks, 0, 1);
            else bf16_pass(a0, s0, a1, s1, b0, 64, TILE_DWORDS, kblocks, 0, 0);
            AMXB_PUT(0, m0, n0);
            if (two_n) AMXB_PUT(1, m0, n0 + 16);
            if (two_m) AMXB_PUT(2, m0 + 16, n0);
            if (two_n && two_m) AMXB_PUT(3, m0 + 16, n0 + 16);
        }
    }
}
#endif
