/* AMX for the CPU GEMMs: the run-time check and the tile configuration (also
 * float_linear_amx.h's, with AMX-BF16), and for the INT8 ones (w4a8_gemm.c,
 * int8_linear.c) the 2 x 2 tile pass both share.
 *
 * The unsigned weight operand of vpdpbusd, 16 channels x 4 consecutive k per
 * 64-byte row, is already AMX's B layout; the signed INT8 activations [M, Kp]
 * are the A tiles (16 rows x 64 k), and tdpbsud (signed x unsigned) sums the
 * same exact INT32 as vpdpbusd. Tiles 0-3 hold 2 x 2 accumulators of 16 x 16
 * (rows m0.., m0+16.. x blocks b, b+1), 4-5 the A tiles, 6-7 the B tiles:
 * all eight, the most one configuration has. Kp must be a multiple of 64
 * (one B tile's depth), and the rows of x allocated up to a multiple of 16
 * (a tile loads 16; rows past M are never stored). */
#ifndef QOQ_AMX_TILES_H
#define QOQ_AMX_TILES_H

#include <cpuid.h>
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#include "isa_cap.h"

#define AMX_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8")))
/* from here the tiles (rows padded to 16) beat the VNNI loops: measured 1.2-1.3x
 * at 12 rows, a tie at 8, 0.8-0.9x at 4 (docs/benchmarks/cpu_gemm.md) */
#define AMX_MIN_ROWS 12

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} AmxTileConfig;

static int amx_state;  /* 0 unknown, 1 usable, -1 not */

/* the CPU has AMX-TILE and AMX-INT8, and Linux granted this process the tile
 * data state (it hands it out only on request: ARCH_REQ_XCOMP_PERM, XTILEDATA) */
static int amx_supported(void) {
    if (amx_state) return amx_state > 0;
    unsigned eax, ebx, ecx, edx;
    int ok = __get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) && (edx >> 24 & 1) && (edx >> 25 & 1) &&
             syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    amx_state = ok ? 1 : -1;
    return ok;
}

/* amx_supported() and QOQSERVE_CPU_ISA does not cap the kernels below AMX
 * (isa_cap.h), for kernels that read the cap themselves */
static inline int amx_allowed(void) {
    return isa_cap() >= ISA_AMX && amx_supported();
}

/* whether a call of M rows and Kp-deep rows goes through the tiles */
static inline int amx_rows(int amx, int64_t M, int64_t Kp) {
    return amx && M >= AMX_MIN_ROWS && Kp % 64 == 0;
}

/* every tile 16 rows; accumulators (0-3) acc_bytes wide, A tiles (4-5) 64
 * bytes, B tiles (6-7) b_bytes; per thread, before its first tile op */
AMX_FN static inline void amx_begin_shaped(int acc_bytes, int b_bytes) {
    AmxTileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = t < 4 ? acc_bytes : t < 6 ? 64 : b_bytes;
    }
    /* GCC 12 takes ldtilecfg for a reader of the first bytes only and drops
     * the stores of rows and colsb as dead where this is not inlined: the
     * whole configuration must be in memory first */
    __asm__ __volatile__("" : : "m"(cfg) : "memory");
    _tile_loadconfig(&cfg);
}

/* every tile 16 rows x 64 bytes */
AMX_FN static inline void amx_begin(void) { amx_begin_shaped(64, 64); }

AMX_FN static inline void amx_end(void) { _tile_release(); }

/* tiles 0-3 = x rows (16 or 32) times weight blocks (1 or 2) over Kp:
 * x [rows, Kp] signed with row stride Kp; block b's 64-byte row of k-quad q
 * at w + q * qstride, block b + 1's bstride further on */
AMX_FN static inline __attribute__((always_inline)) void amx_pass(
        const int8_t *x, int64_t Kp, const uint8_t *w, int64_t qstride, int64_t bstride,
        const int one_row_tile, const int one_block) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t k = 0; k < Kp; k += 64) {
        const uint8_t *wk = w + k / 4 * qstride;
        _tile_loadd(4, x + k, Kp);
        _tile_loadd(6, wk, qstride);
        _tile_dpbsud(0, 4, 6);
        if (!one_block) {
            _tile_loadd(7, wk + bstride, qstride);
            _tile_dpbsud(1, 4, 7);
        }
        if (!one_row_tile) {
            _tile_loadd(5, x + 16 * Kp + k, Kp);
            _tile_dpbsud(2, 5, 6);
            if (!one_block) _tile_dpbsud(3, 5, 7);
        }
    }
}

/* STORE(m, b, acc): rows m0.. of accumulator tile t (block b) as zmm of INT32,
 * rows below M only */
#define AMX_ROWS(t, acc, m0, M, b, STORE) do { \
        _tile_stored(t, acc, 64); \
        for (int r_ = 0; r_ < 16 && (m0) + r_ < (M); r_++) STORE((m0) + r_, b, _mm512_load_si512((acc) + 16 * r_)); \
    } while (0)

/* the four accumulator tiles of one amx_pass through STORE */
#define AMX_STORE_PASS(acc, m0, M, b, one_row_tile, one_block, STORE) do { \
        AMX_ROWS(0, acc, m0, M, b, STORE); \
        if (!(one_block)) AMX_ROWS(1, acc, m0, M, (b) + 1, STORE); \
        if (!(one_row_tile)) { \
            AMX_ROWS(2, acc, (m0) + 16, M, b, STORE); \
            if (!(one_block)) AMX_ROWS(3, acc, (m0) + 16, M, (b) + 1, STORE); \
        } \
    } while (0)

/* amx_pass and its stores for each shape of the edge, as constants */
#define AMX_PASS_ANY(x, Kp, w, qstride, bstride, acc, m0, M, b, one_row_tile, one_block, STORE) do { \
        if ((one_row_tile) && (one_block)) amx_pass(x, Kp, w, qstride, bstride, 1, 1); \
        else if (one_row_tile) amx_pass(x, Kp, w, qstride, bstride, 1, 0); \
        else if (one_block) amx_pass(x, Kp, w, qstride, bstride, 0, 1); \
        else amx_pass(x, Kp, w, qstride, bstride, 0, 0); \
        AMX_STORE_PASS(acc, m0, M, b, one_row_tile, one_block, STORE); \
    } while (0)

#endif
