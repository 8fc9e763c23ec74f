/* The AVX2 path of int8_linear.c (included once by it, after its Job type,
 * on a CPU without AVX-512 VNNI, built for it by -march=native), and
 * stand-ins for the AMX calls, which never run there.
 * vpmaddubsw multiplies unsigned by signed bytes into pairwise int16 sums.
 * Signed weights (offset 128) go in as |w| against x_q with w's sign
 * (vpsignb): a pair is at most 2 * 128 * 127, exact; per-channel codes
 * (offset 0, 0..15) go in as they are. Both give x_q . w exactly, so no
 * offset share is taken off. A 64-byte unit is two halves of 8 channels. */
#include <immintrin.h>
#include "bf16.h"
#include "int8_act_avx2.h"
#define HAVE_INT8 1  /* int8_linear_available(): the AVX2 path */
#define QUANTIZE_ROW quantize_row_avx2

static inline __m256i bcast4_avx2(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* rows m0..m0+mr-1 against blocks nb..nb+nbk-1 of one tile (mr * nbk <= 4,
 * constants where inlined): x_q . w per channel, then the epilogue. Each
 * step over k loads those blocks' units back to back (for a whole tile, its
 * one stream) and each row's 4 x_q once for all 2*nbk halves. */
static inline __attribute__((always_inline)) void tile_rows(const Job *j, int64_t nb, const int nbk, int64_t m0,
                                                            const int mr) {
    const int64_t quads = j->Kp / 4, t0 = nb / NR * NR, left = (j->N + NB - 1) / NB - t0;
    const int64_t step = (left < NR ? left : NR) * 64;
    const uint8_t *w = j->w + t0 * quads * 64 + (nb - t0) * 64;
    const int8_t *x = j->xq + m0 * j->Kp;
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    const int sign = j->offset == 128, H = 2 * nbk;
    __m256i acc[8];
    for (int c = 0; c < mr * H; c++) acc[c] = _mm256_setzero_si256();
    for (int64_t kq = 0; kq < quads; kq++) {
        __m256i xv[2];
        for (int i = 0; i < mr; i++) xv[i] = bcast4_avx2(x + i * j->Kp + 4 * kq);
        for (int hb = 0; hb < H; hb++) {
            __m256i u = _mm256_loadu_si256((const __m256i *)(w + kq * step + 32 * hb)), ws = u;
            if (sign) {
                ws = _mm256_xor_si256(u, flip);  /* w + 128 -> w */
                u = _mm256_abs_epi8(ws);
            }
            for (int i = 0; i < mr; i++) {
                const __m256i s = sign ? _mm256_sign_epi8(xv[i], ws) : xv[i];
                acc[i * H + hb] = _mm256_add_epi32(acc[i * H + hb], _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), ones));
            }
        }
    }
    const int64_t es = j->out_bf16 ? 2 : 4;
    for (int i = 0; i < mr; i++) {
        const int64_t m = m0 + i;
        const float rs = j->rowsum ? j->rowsum[m] : 0.f;
        for (int hb = 0; hb < H; hb++) {
            const int64_t n0 = nb * NB + 8 * hb;
            if (n0 >= j->N) break;
            store_epilogue8(acc[i * H + hb], j->sa[m], j->s1 + n0, j->zs1 ? j->zs1 + n0 : NULL, rs,
                            j->bias ? j->bias + n0 : NULL, (char *)j->y + (m * j->N + n0) * es, j->out_bf16,
                            j->N - n0);
        }
    }
}

/* the blocks nb0..nb0+nr-1 of one tile (nr 1..4) for every row: rows in
 * pairs over two blocks at a time, an odd last row over the whole tile */
static void run_chunk(const Job *j, int64_t nb0, int64_t nr) {
    int64_t m0 = 0;
    for (; m0 + 2 <= j->M; m0 += 2)
        for (int64_t nb = nb0; nb < nb0 + nr; nb += 2) {
            if (nb0 + nr - nb >= 2) tile_rows(j, nb, 2, m0, 2);
            else tile_rows(j, nb, 1, m0, 2);
        }
    if (m0 < j->M) switch (nr) {
        case 4: tile_rows(j, nb0, 4, m0, 1); break;
        case 3: tile_rows(j, nb0, 3, m0, 1); break;
        case 2: tile_rows(j, nb0, 2, m0, 1); break;
        default: tile_rows(j, nb0, 1, m0, 1); break;
        }
}

static inline int amx_rows(int amx, int64_t M, int64_t Kp) { (void)amx; (void)M; (void)Kp; return 0; }
static inline int amx_allowed(void) { return 0; }
static inline void amx_begin(void) {}
static inline void amx_end(void) {}
static void chunk_amx(const Job *j, int64_t nb0, int nr, int32_t *acc) { (void)j; (void)nb0; (void)nr; (void)acc; }
