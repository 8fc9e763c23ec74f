/* The packed W4A8 GEMM on AVX2 (no AVX-512): w4a8_gemm.c's layout and
 * numbers, for the CPUs most servers and laptops still are. Included by
 * w4a8_gemm.c after its Job, tiled() and scalar code.
 *
 * AVX2 has no VNNI, but vpmaddubsw multiplies unsigned by signed bytes into
 * pairwise int16 sums, exact while they fit: the raw codes u (0..15) times
 * x_q (-127..127) give at most 2 * 15 * 127 per pair, so the two nibbles of a
 * unit (8 k) add in int16 too (<= 7620) before vpmaddwd widens them to int32.
 * Per group and channel the integer s2 * (x_q . u - z * sum(x_q)) joins the
 * accumulator, the same integer as the expanded operand's sum (tile_codes);
 * per channel x_q . u is the accumulator and the epilogue takes the zero
 * point off. A unit's 64 bytes are two 256-bit halves, channels 0..7 and
 * 8..15 of the block; at prompt sizes a half's unpacked codes serve four
 * rows at a time (half_rows); decode-sized calls walk whole tiles, one
 * stream, with more independent sums per row (tile_rows).
 * The activation quantizer and the epilogue are int8_act_avx2.h's. */
#define AVX2 __attribute__((target("avx2,fma")))
#define AVX2_FN AVX2
#include "int8_act_avx2.h"

static int avx2_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") != 0;
}

/* epilogue_scalar for channels n0..n0+7 of row m (those below N stored) */
AVX2 static inline void store8(const Job *j, int64_t m, int64_t n0, __m256i acc) {
    store_epilogue8(acc, j->sa[m], j->s1 + n0, j->zs1 ? j->zs1 + n0 : NULL, j->rowsum ? j->rowsum[m] : 0.f,
                    j->bias ? j->bias + n0 : NULL, (char *)j->y + (m * j->N + n0) * (j->out_bf16 ? 2 : 4),
                    j->out_bf16, j->N - n0);
}

AVX2 static inline int32_t sum_i8_avx2(const int8_t *x, int64_t n) {  /* n a multiple of 8 */
    const __m256i flip = _mm256_set1_epi8((char)0x80), zero = _mm256_setzero_si256();
    __m256i acc = zero;
    int64_t k = 0;
    for (; k + 32 <= n; k += 32)
        acc = _mm256_add_epi64(acc, _mm256_sad_epu8(_mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(x + k)), flip), zero));
    int64_t s = 0, lanes[4];
    _mm256_storeu_si256((__m256i *)lanes, acc);
    for (int l = 0; l < 4; l++) s += lanes[l];
    s -= 128 * k;
    for (; k < n; k++) s += x[k];
    return (int32_t)s;
}

/* Half h (channels 8h..8h+7) of weight block nb for rows m0..m0+mr-1 (mr
 * 1..4: the unpacked codes serve every row). Per group: g = x_q . u, then
 * t += s2 * (g - z * xs), xs the row's group sum (Job.gsum). The int16 sums
 * of up to 4 units (32 k) are added before vpmaddwd widens them: each unit's
 * is at most 7,620, four 30,480, so nothing saturates. */
AVX2 static inline __attribute__((always_inline)) void half_rows(const Job *j, int64_t nb, int h, int64_t m0,
                                                                 const int mr) {
    const int64_t Kp = j->Kp, octets = Kp / 8, grouped = j->gp != NULL;
    const int64_t per_group = grouped ? j->group / 8 : octets, groups = octets / per_group;
    int64_t wstep, gstep = 0;
    const uint8_t *w = tiled(j->w, j, nb, octets, 64, &wstep) + 32 * h;
    const uint8_t *g = grouped ? tiled(j->gp, j, nb, groups, NB, &gstep) + 8 * h : NULL;
    const int8_t *x = j->xq + m0 * Kp;
    const __m256i nib = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    const __m256i one = _mm256_set1_epi32(1), low4 = _mm256_set1_epi32(15);
    __m256i t[4], acc[4];
    for (int i = 0; i < mr; i++) t[i] = _mm256_setzero_si256();
    for (int64_t gi = 0; gi < groups; gi++) {
        for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_si256();
        const int64_t end = (gi + 1) * per_group;
        for (int64_t p0 = gi * per_group; p0 < end; p0 += 4) {
            __m256i s16[4];
            for (int i = 0; i < mr; i++) s16[i] = _mm256_setzero_si256();
            for (int64_t p = p0; p < p0 + 4 && p < end; p++) {
                _mm_prefetch((const char *)w + (p + CODES_AHEAD) * wstep, _MM_HINT_T1);
                const __m256i pk = _mm256_loadu_si256((const __m256i *)(w + p * wstep));
                const __m256i lo = _mm256_and_si256(pk, nib), hi = _mm256_and_si256(_mm256_srli_epi16(pk, 4), nib);
                for (int i = 0; i < mr; i++) {
                    int32_t xa, xb;
                    memcpy(&xa, x + i * Kp + 8 * p, 4);
                    memcpy(&xb, x + i * Kp + 8 * p + 4, 4);
                    s16[i] = _mm256_add_epi16(s16[i], _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(xa)),
                                                                       _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xb))));
                }
            }
            for (int i = 0; i < mr; i++) acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(s16[i], ones));
        }
        if (!grouped) {
            for (int i = 0; i < mr; i++) t[i] = acc[i];
            break;
        }
        const __m256i d = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(g + gi * gstep)));
        const __m256i s2 = _mm256_add_epi32(_mm256_srli_epi32(d, 4), one), z = _mm256_and_si256(d, low4);
        for (int i = 0; i < mr; i++) {
            const __m256i xs = _mm256_set1_epi32(j->gsum[(m0 + i) * groups + gi]);
            t[i] = _mm256_add_epi32(t[i], _mm256_mullo_epi32(s2, _mm256_sub_epi32(acc[i], _mm256_mullo_epi32(z, xs))));
        }
    }
    for (int i = 0; i < mr; i++) store8(j, m0 + i, nb * NB + 8 * h, t[i]);
}

/* Rows m0..m0+mr-1 against blocks nb..nb+nbk-1 of one tile (mr * nbk <= 4,
 * constants where inlined). Each step over k loads those blocks' 64-byte
 * units back to back (for the whole tile, its one stream: layout in
 * w4a8_gemm.c) and each row's 8 x_q once for all 2*nbk halves; the
 * 2*mr*nbk int16 sums are independent chains. The int16 sums of up to 4
 * units (at most 30,480) are widened and scaled by one vpmaddwd with s2 in
 * both int16 halves of each channel's lane (ones per channel); per group
 * t -= s2 * z * xs. The same INT32 as half_rows'. */
AVX2 static inline __attribute__((always_inline)) void tile_rows(const Job *j, int64_t nb, const int nbk, int64_t m0,
                                                                 const int mr, const int grouped) {
    const int64_t Kp = j->Kp, octets = Kp / 8;
    const int64_t per_group = grouped ? j->group / 8 : octets, groups = octets / per_group;
    const int H = 2 * nbk;
    int64_t wstep, gstep = 0;
    const uint8_t *w = tiled(j->w, j, nb, octets, 64, &wstep);
    const uint8_t *g = grouped ? tiled(j->gp, j, nb, groups, NB, &gstep) : NULL;
    const int8_t *x = j->xq + m0 * Kp;
    const __m256i nib = _mm256_set1_epi8(0x0f), one = _mm256_set1_epi32(1), low4 = _mm256_set1_epi32(15);
    __m256i t[8], s2w[8], s2z[8], s16[8];
    for (int hb = 0; hb < H; hb++) s2w[hb] = _mm256_set1_epi16(1);
    for (int c = 0; c < mr * H; c++) t[c] = _mm256_setzero_si256();
    for (int64_t gi = 0; gi < groups; gi++) {
        if (grouped)
            for (int hb = 0; hb < H; hb++) {
                const __m256i d = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(g + gi * gstep + 8 * hb)));
                const __m256i s2 = _mm256_add_epi32(_mm256_srli_epi32(d, 4), one);
                s2w[hb] = _mm256_or_si256(s2, _mm256_slli_epi32(s2, 16));
                s2z[hb] = _mm256_mullo_epi32(s2, _mm256_and_si256(d, low4));
            }
        const int64_t end = (gi + 1) * per_group;
        for (int64_t p0 = gi * per_group; p0 < end; p0 += 4) {
            for (int c = 0; c < mr * H; c++) s16[c] = _mm256_setzero_si256();
            const int64_t p1 = p0 + 4 < end ? p0 + 4 : end;
            /* unrolled, GCC hoists the units' loads and products past the 16
             * registers and spills the sums */
#pragma GCC unroll 1
            for (int64_t p = p0; p < p1; p++) {
                __m256i va[4], vb[4];
                for (int i = 0; i < mr; i++) {
                    int32_t xa, xb;
                    memcpy(&xa, x + i * Kp + 8 * p, 4);
                    memcpy(&xb, x + i * Kp + 8 * p + 4, 4);
                    va[i] = _mm256_set1_epi32(xa);
                    vb[i] = _mm256_set1_epi32(xb);
                }
                for (int hb = 0; hb < H; hb += 2)  /* one prefetch per 64-byte unit */
                    _mm_prefetch((const char *)w + (p + CODES_AHEAD) * wstep + 32 * hb, _MM_HINT_T1);
                for (int hb = 0; hb < H; hb++) {
                    const __m256i pk = _mm256_loadu_si256((const __m256i *)(w + p * wstep + 32 * hb));
                    const __m256i lo = _mm256_and_si256(pk, nib), hi = _mm256_and_si256(_mm256_srli_epi16(pk, 4), nib);
                    for (int i = 0; i < mr; i++)
                        s16[i * H + hb] = _mm256_add_epi16(s16[i * H + hb],
                                                           _mm256_add_epi16(_mm256_maddubs_epi16(lo, va[i]),
                                                                            _mm256_maddubs_epi16(hi, vb[i])));
                }
            }
            for (int i = 0; i < mr; i++)
                for (int hb = 0; hb < H; hb++)
                    t[i * H + hb] = _mm256_add_epi32(t[i * H + hb], _mm256_madd_epi16(s16[i * H + hb], s2w[hb]));
        }
        if (grouped)
            for (int i = 0; i < mr; i++) {
                const __m256i xs = _mm256_set1_epi32(j->gsum[(m0 + i) * groups + gi]);
                for (int hb = 0; hb < H; hb++)
                    t[i * H + hb] = _mm256_sub_epi32(t[i * H + hb], _mm256_mullo_epi32(s2z[hb], xs));
            }
    }
    for (int i = 0; i < mr; i++)
        for (int hb = 0; hb < H; hb++)
            if (nb * NB + 8 * hb < j->N) store8(j, m0 + i, nb * NB + 8 * hb, t[i * H + hb]);
}

/* one row, the blocks nb..nb+nbk-1 of a tile (nbk 1..4) */
AVX2 static void tile_row_any(const Job *j, int64_t nb, int nbk, int64_t m) {
    const int grouped = j->gp != NULL;
    switch (nbk * 2 + grouped) {
    case 2: tile_rows(j, nb, 1, m, 1, 0); break;
    case 3: tile_rows(j, nb, 1, m, 1, 1); break;
    case 4: tile_rows(j, nb, 2, m, 1, 0); break;
    case 5: tile_rows(j, nb, 2, m, 1, 1); break;
    case 6: tile_rows(j, nb, 3, m, 1, 0); break;
    case 7: tile_rows(j, nb, 3, m, 1, 1); break;
    case 8: tile_rows(j, nb, 4, m, 1, 0); break;
    default: tile_rows(j, nb, 4, m, 1, 1); break;
    }
}

/* two rows, blocks nb..nb+nbk-1 (nbk 1..2) */
AVX2 static void pair_rows_any(const Job *j, int64_t nb, int nbk, int64_t m0) {
    const int grouped = j->gp != NULL;
    switch (nbk * 2 + grouped) {
    case 2: tile_rows(j, nb, 1, m0, 2, 0); break;
    case 3: tile_rows(j, nb, 1, m0, 2, 1); break;
    case 4: tile_rows(j, nb, 2, m0, 2, 0); break;
    default: tile_rows(j, nb, 2, m0, 2, 1); break;
    }
}

/* Up to this many rows (decode batches) the calls walk whole tiles, rows in
 * pairs; more rows take half_rows' four-row blocks, which reuse each unpacked
 * half-unit four times: four rows of tile_rows need more registers than
 * there are and ran slower (docs/runtime.md, the AVX2 table). */
#define TILE_ROWS_MAX 8

#ifndef X_BLOCK_BYTES
#define X_BLOCK_BYTES 131072
#endif

/* Rows in blocks whose x_q stays in L1 (X_BLOCK_BYTES) while every weight
 * block of the range passes over them: without it each half-block streamed
 * all of x from L3 again (prompt-sized M). */
AVX2 static void blocks_avx2(const Job *j, int64_t nb_lo, int64_t nb_hi) {
    if (j->M <= TILE_ROWS_MAX) {  /* decode: whole tiles, rows in pairs, an odd last row alone */
        for (int64_t nb = nb_lo; nb < nb_hi;) {
            const int64_t tile_end = nb / NR * NR + NR, end = tile_end < nb_hi ? tile_end : nb_hi;
            int64_t m = 0;
            for (; m + 2 <= j->M; m += 2)
                for (int64_t b = nb; b < end; b += 2) pair_rows_any(j, b, (int)(end - b < 2 ? end - b : 2), m);
            if (m < j->M) tile_row_any(j, nb, (int)(end - nb), m);
            nb = end;
        }
        return;
    }
    int64_t rows = X_BLOCK_BYTES / j->Kp / 4 * 4;
    rows = rows < 4 ? 4 : rows;
    for (int64_t r0 = 0; r0 < j->M; r0 += rows) {
        const int64_t r1 = r0 + rows < j->M ? r0 + rows : j->M;
        for (int64_t nb = nb_lo; nb < nb_hi; nb++)
            for (int h = 0; h < 2; h++) {
                if (nb * NB + 8 * h >= j->N) break;  /* a half wholly past N */
                int64_t m0 = r0;
                for (; m0 + 4 <= r1; m0 += 4) half_rows(j, nb, h, m0, 4);
                switch (r1 - m0) {
                case 3: half_rows(j, nb, h, m0, 3); break;
                case 2: half_rows(j, nb, h, m0, 2); break;
                case 1: half_rows(j, nb, h, m0, 1); break;
                default: break;
                }
            }
    }
}
