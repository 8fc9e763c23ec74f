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
 * 8..15 of the block.
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

/* One weight block (16 channels) for rows m0..m0+mr-1 (mr 1 or 2): the two
 * halves' int32 sums per row. Per group: g = x_q . u, then t += s2*(g - z*xs). */
AVX2 static inline __attribute__((always_inline)) void block_rows(const Job *j, int64_t nb, int64_t m0, const int mr) {
    const int64_t Kp = j->Kp, octets = Kp / 8, grouped = j->gp != NULL;
    const int64_t per_group = grouped ? j->group / 8 : octets, groups = octets / per_group;
    int64_t wstep, gstep = 0;
    const uint8_t *w = tiled(j->w, j, nb, octets, 64, &wstep);
    const uint8_t *g = grouped ? tiled(j->gp, j, nb, groups, NB, &gstep) : NULL;
    const int8_t *x0 = j->xq + m0 * Kp, *x1 = x0 + (mr > 1 ? Kp : 0);
    const __m256i nib = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    const __m256i one = _mm256_set1_epi32(1), low4 = _mm256_set1_epi32(15);
    __m256i t00 = _mm256_setzero_si256(), t01 = t00, t10 = t00, t11 = t00;
    for (int64_t gi = 0; gi < groups; gi++) {
        __m256i g00 = _mm256_setzero_si256(), g01 = g00, g10 = g00, g11 = g00;
        for (int64_t p = gi * per_group; p < (gi + 1) * per_group; p++) {
            const uint8_t *unit = w + p * wstep;
            int32_t xa, xb;
            memcpy(&xa, x0 + 8 * p, 4);
            memcpy(&xb, x0 + 8 * p + 4, 4);
            const __m256i xl0 = _mm256_set1_epi32(xa), xh0 = _mm256_set1_epi32(xb);
            __m256i xl1 = xl0, xh1 = xh0;
            if (mr > 1) {
                memcpy(&xa, x1 + 8 * p, 4);
                memcpy(&xb, x1 + 8 * p + 4, 4);
                xl1 = _mm256_set1_epi32(xa), xh1 = _mm256_set1_epi32(xb);
            }
            for (int h = 0; h < 2; h++) {
                const __m256i pk = _mm256_loadu_si256((const __m256i *)(unit + 32 * h));
                const __m256i lo = _mm256_and_si256(pk, nib), hi = _mm256_and_si256(_mm256_srli_epi16(pk, 4), nib);
                const __m256i d0 = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, xl0),
                                                                      _mm256_maddubs_epi16(hi, xh0)), ones);
                if (h == 0) g00 = _mm256_add_epi32(g00, d0); else g01 = _mm256_add_epi32(g01, d0);
                if (mr > 1) {
                    const __m256i d1 = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, xl1),
                                                                          _mm256_maddubs_epi16(hi, xh1)), ones);
                    if (h == 0) g10 = _mm256_add_epi32(g10, d1); else g11 = _mm256_add_epi32(g11, d1);
                }
            }
        }
        if (!grouped) {
            t00 = g00, t01 = g01, t10 = g10, t11 = g11;
            break;
        }
        const uint8_t *gb = g + gi * gstep;
        const __m256i da = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)gb));
        const __m256i db = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(gb + 8)));
        const __m256i sa2 = _mm256_add_epi32(_mm256_srli_epi32(da, 4), one), za = _mm256_and_si256(da, low4);
        const __m256i sb2 = _mm256_add_epi32(_mm256_srli_epi32(db, 4), one), zb = _mm256_and_si256(db, low4);
        const __m256i xs0 = _mm256_set1_epi32(sum_i8_avx2(x0 + gi * j->group, j->group));
        t00 = _mm256_add_epi32(t00, _mm256_mullo_epi32(sa2, _mm256_sub_epi32(g00, _mm256_mullo_epi32(za, xs0))));
        t01 = _mm256_add_epi32(t01, _mm256_mullo_epi32(sb2, _mm256_sub_epi32(g01, _mm256_mullo_epi32(zb, xs0))));
        if (mr > 1) {
            const __m256i xs1 = _mm256_set1_epi32(sum_i8_avx2(x1 + gi * j->group, j->group));
            t10 = _mm256_add_epi32(t10, _mm256_mullo_epi32(sa2, _mm256_sub_epi32(g10, _mm256_mullo_epi32(za, xs1))));
            t11 = _mm256_add_epi32(t11, _mm256_mullo_epi32(sb2, _mm256_sub_epi32(g11, _mm256_mullo_epi32(zb, xs1))));
        }
    }
    store8(j, m0, nb * NB, t00);
    store8(j, m0, nb * NB + 8, t01);
    if (mr > 1) {
        store8(j, m0 + 1, nb * NB, t10);
        store8(j, m0 + 1, nb * NB + 8, t11);
    }
}

AVX2 static void blocks_avx2(const Job *j, int64_t nb_lo, int64_t nb_hi) {
    for (int64_t nb = nb_lo; nb < nb_hi; nb++) {
        int64_t m0 = 0;
        for (; m0 + 2 <= j->M; m0 += 2) block_rows(j, nb, m0, 2);
        if (m0 < j->M) block_rows(j, nb, m0, 1);
    }
}
