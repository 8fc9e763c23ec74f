/* float_linear's bf16 dot-product path (AVX512-BF16, `vdpbf16ps`): bf16
 * rows times bf16 weights, read as they are (no widening pass, no panel).
 * Included by float_linear.c inside its x86 block (reduce16, tile sizes).
 *
 * One fixed order per output, whatever M, the tiling or the threads: 16
 * lanes, lane l taking the pairs (2l, 2l + 1) of each 32 elements in
 * increasing k, each pair as vdpbf16ps adds it (the odd product, then the
 * even one: each product of two bf16 values is exact in fp32, each add
 * rounded to nearest even), K zero-padded to a multiple of 32; then the
 * lanes added pairwise as the other paths do (reduce16). Not the other
 * paths' bits (they give lane l the single elements k = l mod 16), but as
 * batch-invariant, and at twice their multiply-adds per instruction.
 * vdpbf16ps reads denormal inputs as zero and flushes denormal results
 * (a bf16 model's activations and weights are far from 2^-126).
 */
#ifndef QOQSERVE_FLOAT_LINEAR_DOT_H
#define QOQSERVE_FLOAT_LINEAR_DOT_H

#define DOT __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

static int dot_supported(void) {
    __builtin_cpu_init();
    return simd_supported() && __builtin_cpu_supports("avx512bf16");
}

/* the first n of 32 bf16 elements (n clamped to 0..32) */
static inline __mmask32 pair_mask(int64_t n) {
    return n >= 32 ? (__mmask32)0xffffffffu : n <= 0 ? (__mmask32)0 : (__mmask32)((1u << n) - 1u);
}

/* an mr x nr tile of bf16 rows x bf16 weight rows (mr * nr <= 16), the
 * accumulators in registers once inlined with constant sizes. fetch: request
 * the weight rows two tiles ahead (the first row tile of each column tile:
 * in a step the weights come from memory) */
DOT static inline __attribute__((always_inline)) void dot_tile(const uint16_t *x, int64_t K, const uint16_t *w,
                                                              int64_t m0, int mr, int64_t n0, int nr, int64_t N,
                                                              float *y, int fetch) {
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        const __mmask32 mask = pair_mask(K - k);
        __m512i wv[NR_WIDE], xv[MR];
        if (fetch)
            for (int j = 0; j < nr; j++) _mm_prefetch((const char *)(w + (n0 + 2 * nr + j) * K + k), _MM_HINT_T0);
        for (int j = 0; j < nr; j++) wv[j] = _mm512_maskz_loadu_epi16(mask, w + (n0 + j) * K + k);
        for (int i = 0; i < mr; i++) xv[i] = _mm512_maskz_loadu_epi16(mask, x + (m0 + i) * K + k);
        for (int i = 0; i < mr; i++)
            for (int j = 0; j < nr; j++)
                acc[i * nr + j] = _mm512_dpbf16_ps(acc[i * nr + j], (__m512bh)xv[i], (__m512bh)wv[j]);
    }
    float out[16];
    _mm512_storeu_ps(out, reduce16(acc));
    for (int i = 0; i < mr; i++) memcpy(y + (m0 + i) * N + n0, out + i * nr, (size_t)nr * sizeof(float));
}

/* columns n_lo..n_hi of every row: 1-2 rows as a GEMV (more weight rows in
 * flight); otherwise each NR weight rows, fetched ahead, are read from memory
 * once and then from L1 by every row tile (the rows stay in L2: at most
 * ROW_BLOCK of them) */
DOT static void rows_dot(const uint16_t *x, int64_t M, int64_t K, const uint16_t *w, int64_t n_lo, int64_t n_hi,
                         int64_t N, float *y) {
    if (M <= 2) {
        for (int64_t n0 = n_lo; n0 < n_hi; n0 += NR_WIDE) {
            const int nr = n_hi - n0 < NR_WIDE ? (int)(n_hi - n0) : NR_WIDE;
            if (nr < NR_WIDE) dot_tile(x, K, w, 0, (int)M, n0, nr, N, y, 1);
            else if (M == 2) dot_tile(x, K, w, 0, 2, n0, NR_WIDE, N, y, 1);
            else dot_tile(x, K, w, 0, 1, n0, NR_WIDE, N, y, 1);
        }
        return;
    }
    for (int64_t n0 = n_lo; n0 < n_hi; n0 += NR) {
        const int nr = n_hi - n0 < NR ? (int)(n_hi - n0) : NR;
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            const int mr = M - m0 < MR ? (int)(M - m0) : MR, fetch = m0 == 0;
            if (nr < NR) { dot_tile(x, K, w, m0, mr, n0, nr, N, y, fetch); continue; }
            switch (mr) {
            case 4:
                if (fetch) dot_tile(x, K, w, m0, 4, n0, NR, N, y, 1);
                else dot_tile(x, K, w, m0, 4, n0, NR, N, y, 0);
                break;
            case 3: dot_tile(x, K, w, m0, 3, n0, NR, N, y, fetch); break;
            case 2: dot_tile(x, K, w, m0, 2, n0, NR, N, y, fetch); break;
            default: dot_tile(x, K, w, m0, 1, n0, NR, N, y, fetch);
            }
        }
    }
}
#endif
