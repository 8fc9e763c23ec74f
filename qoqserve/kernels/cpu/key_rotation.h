/* The key transform's rotation x = y @ R for qkv_rope (elementwise.c,
 * included once by it): D^2 multiply-adds a head and token, the one dense
 * product among the token ops and most of what qkv_rope costs. */
#ifndef QOQSERVE_KEY_ROTATION_H
#define QOQSERVE_KEY_ROTATION_H
#include <math.h>

/* x[0:D] = y[0:D] @ R: each output summed over e in order, one fused
 * multiply-add per term, so every path (and any D) gives the same bits;
 * rotate_heads runs it on a group of heads at once (docs/runtime.md). */
static inline void vec_mat_any(const float *y, const float *R, float *x, int D) {
    for (int d = 0; d < D; d++) x[d] = 0.f;
    for (int e = 0; e < D; e++)
        for (int d = 0; d < D; d++) x[d] = fmaf(y[e], R[e * D + d], x[d]);
}

/* heads rotated at once: as many independent chains of multiply-adds, so
 * the loop is not held up by one chain's latency */
enum { ROT_GROUP = 4 };

#ifdef __AVX512F__
#include <immintrin.h>
/* vec_mat_any of nh rows y[j] at once for D = 16 n (nh * n <= 16): the same
 * fused multiply-adds in the same order per output, each row of R loaded once
 * for all nh */
static inline __attribute__((always_inline)) void vec_mat16(float (*y)[512], const float *R, float *const *x,
                                                            const int nh, const int n) {
    __m512 acc[ROT_GROUP][8];
    for (int j = 0; j < nh; j++)
        for (int u = 0; u < n; u++) acc[j][u] = _mm512_setzero_ps();
    for (int e = 0; e < 16 * n; e++) {
        __m512 r[8];
        for (int u = 0; u < n; u++) {
            r[u] = _mm512_loadu_ps(R + e * 16 * n + 16 * u);
            /* held in a register for all nh heads: folded into each FMA as a
             * memory operand, it is loaded nh times and the loads bound the loop */
            __asm__("" : "+v"(r[u]));
        }
        for (int j = 0; j < nh; j++) {
            const __m512 ye = _mm512_set1_ps(y[j][e]);
            for (int u = 0; u < n; u++) acc[j][u] = _mm512_fmadd_ps(ye, r[u], acc[j][u]);
        }
    }
    for (int j = 0; j < nh; j++)
        for (int u = 0; u < n; u++) _mm512_storeu_ps(x[j] + 16 * u, acc[j][u]);
}
#endif

/* x[j] = y[j] @ R for the nh <= ROT_GROUP rows of one group of heads (x[j]: D floats anywhere) */
static void rotate_heads(float (*y)[512], const float *R, float *const *x, int nh, int D) {
#ifdef __AVX512F__
    if (D == 64) {
        switch (nh) {  /* constants, so the accumulators stay in registers */
        case 4: vec_mat16(y, R, x, 4, 4); return;
        case 3: vec_mat16(y, R, x, 3, 4); return;
        case 2: vec_mat16(y, R, x, 2, 4); return;
        default: vec_mat16(y, R, x, 1, 4); return;
        }
    }
    if (D == 128) {
        for (int j = 0; j < nh; j += 2) {
            if (nh - j >= 2) vec_mat16(y + j, R, x + j, 2, 8);
            else vec_mat16(y + j, R, x + j, 1, 8);
        }
        return;
    }
#endif
    for (int j = 0; j < nh; j++) vec_mat_any(y[j], R, x[j], D);
}

#endif
