/* The AMX-INT8 loop of w4a8_gemm.c (included once, at the end of
 * w4a8_gemm_avx512.h, whose panel, run_packed and epilogues it uses).
 * Many rows (prefill, large batches): the layout tile's expanded operand is
 * written to the panel (tile_packed with no rows), which is AMX's B layout,
 * and amx_tiles.h's passes run over it: 32 rows x 32 channels each. */
#include "amx_tiles.h"

#define STORE_AMX(m, b, acc) store_exact(j, m, nb0 + (b), acc, j->gp != NULL)

/* y_silu: a pass's two blocks are one (gate, up) pair (nb even: threads and
 * tiles split N by pairs); its rows from accumulator tiles g (gate) and u,
 * rows m0.. of them, through store_silu as the VNNI loops' epilogue */
#define AMX_SILU_ROWS(g, u, m0) do { \
        _tile_stored(g, acc, 64); \
        _tile_stored(u, acc + 256, 64); \
        for (int r_ = 0; r_ < 16 && (m0) + r_ < j->M; r_++) \
            store_silu(j, (m0) + r_, nb, 1, _mm512_load_si512(acc + 16 * r_), _mm512_load_si512(acc + 256 + 16 * r_), \
                       zero, zero, j->gp != NULL); \
    } while (0)

AMX_FN static void blocks_amx(const Job *j, int64_t nb_lo, int64_t nb_hi, uint8_t *panel) {
    const int64_t Kp = j->Kp, pblock = Kp * NB;
    int32_t acc[512] __attribute__((aligned(64)));
    const __m512i zero = _mm512_setzero_si512();
    amx_begin();
    for (int64_t nb0 = nb_lo, end; nb0 < nb_hi; nb0 = end) {
        end = (nb0 / NR + 1) * NR < nb_hi ? (nb0 / NR + 1) * NR : nb_hi;
        const int nr = (int)(end - nb0);
        run_packed(j, 0, nb0, 0, nr, panel);
        for (int b = 0; b < nr; b += 2)
            for (int64_t m0 = 0; m0 < j->M; m0 += 32) {
                const int one_row_tile = j->M - m0 <= 16;
                if (!j->silu) {
                    AMX_PASS_ANY(j->xq + m0 * Kp, Kp, panel + b * pblock, 64, pblock, acc, m0, j->M, b,
                                 one_row_tile, b + 1 == nr, STORE_AMX);
                    continue;
                }
                const int64_t nb = nb0 + b;
                if (one_row_tile) amx_pass(j->xq + m0 * Kp, Kp, panel + b * pblock, 64, pblock, 1, 0);
                else amx_pass(j->xq + m0 * Kp, Kp, panel + b * pblock, 64, pblock, 0, 0);
                AMX_SILU_ROWS(0, 1, m0);
                if (!one_row_tile) AMX_SILU_ROWS(2, 3, m0 + 16);
            }
    }
    amx_end();
}
#undef AMX_SILU_ROWS
