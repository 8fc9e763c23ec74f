/* The AMX prefill's operands from the pages (included by paged_prefill_amx.h,
 * inside its AVX-512 region, after its constants): a tile of AKEYS keys' K and V
 * codes in the layouts the tile products take, and their scales and zeros. */
#ifndef QOQSERVE_PAGED_PREFILL_AMX_ROWS_H
#define QOQSERVE_PAGED_PREFILL_AMX_ROWS_H

/* n <= AKEYS rows of (s, h) from position k0: the K codes as the B tiles of
 * the scores (per 16 keys: dword x of the digits' order, x < D / 8 the low
 * nibbles of packed dword x, else the high ones of dword x - D / 8, 64 bytes
 * a row), the V codes as those of the weighted sum (per 16 slots of the
 * planar order, 16 rows of 4 keys: slot i's 4 codes in dword i), and both
 * rows' scales and zeros - 8; keys past n are zero codes and zero scales. */
PP_AMX_FN static inline __attribute__((always_inline)) void amx_tile_rows(const pjob *j, int s, int64_t k0, int n,
                                                                          int h, const int D, uint8_t *kb,
                                                                          uint8_t *vb, uint8_t *packed, float *meta) {
    const int nd = D / 8, half = D / 2;
    float *ks = meta, *kz = ks + AKEYS, *vs = kz + AKEYS, *vz = vs + AKEYS;
    for (int pass = 0; pass < 2; pass++) {
        const uint8_t *pages = pass ? j->v : j->k;
        for (int i = 0; i < AKEYS; i++) {  /* the rows' codes back to back, zeros past n */
            uint8_t *dst = packed + (int64_t)i * half;
            float *sc = pass ? vs : ks, *zr = pass ? vz : kz;
            if (i >= n) {
                memset(dst, 0, (size_t)half);
                sc[i] = zr[i] = 0.f;
                continue;
            }
            const uint8_t *r = pages + row_at(j, s, k0 + i, h);
            memcpy(dst, r, (size_t)half);
            sc[i] = half_at(r + half);
            zr[i] = half_at(r + half + 2) - 8.f;
        }
        if (!pass) {
            for (int blk = 0; blk < AKEYS / 16; blk++)
                for (int seg = 0; seg < (nd + 7) / 8; seg++) {
                    const int nw = nd - 8 * seg < 8 ? nd - 8 * seg : 8;
                    __m512i lo[8], hi[8];
                    transpose_codes(packed + (int64_t)16 * blk * half, half, 16, seg, nw, lo, hi);
                    uint8_t *t = kb + (int64_t)blk * 2 * nd * 64;
                    for (int i = 0; i < nw; i++) {
                        _mm512_store_si512(t + (int64_t)(8 * seg + i) * 64, lo[i]);
                        _mm512_store_si512(t + (int64_t)(nd + 8 * seg + i) * 64, hi[i]);
                    }
                }
            continue;
        }
        const __m128i nib = _mm_set1_epi8(0x0f), eight = _mm_set1_epi8(8);
        for (int quad = 0; quad < AKEYS / 4; quad++)
            for (int bb = 0; bb < half / 16; bb++) {  /* 16 packed bytes: slots 32 bb .. 32 bb + 31 */
                __m128i x[2][4];
                for (int k = 0; k < 4; k++) {
                    const __m128i c = _mm_loadu_si128((const __m128i *)(packed + (int64_t)(4 * quad + k) * half + 16 * bb));
                    x[0][k] = _mm_sub_epi8(_mm_and_si128(c, nib), eight);
                    x[1][k] = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(c, 4), nib), eight);
                }
                for (int hh = 0; hh < 2; hh++) {
                    const __m128i ab0 = _mm_unpacklo_epi8(x[hh][0], x[hh][1]), ab1 = _mm_unpackhi_epi8(x[hh][0], x[hh][1]);
                    const __m128i cd0 = _mm_unpacklo_epi8(x[hh][2], x[hh][3]), cd1 = _mm_unpackhi_epi8(x[hh][2], x[hh][3]);
                    __m128i *row = (__m128i *)(vb + ((int64_t)(2 * bb + hh) * (AKEYS / 4) + quad) * 64);
                    _mm_store_si128(row, _mm_unpacklo_epi16(ab0, cd0));
                    _mm_store_si128(row + 1, _mm_unpackhi_epi16(ab0, cd0));
                    _mm_store_si128(row + 2, _mm_unpacklo_epi16(ab1, cd1));
                    _mm_store_si128(row + 3, _mm_unpackhi_epi16(ab1, cd1));
                }
            }
    }
}

#endif
