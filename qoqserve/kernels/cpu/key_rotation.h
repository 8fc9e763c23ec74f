/* The key transform's rotation x = y @ R for qkv_rope (elementwise.c,
 * included once by it): D^2 multiply-adds a head and token, the one dense
 * product among the token ops and most of what qkv_rope costs; D log2 D
 * sums where R is a signed Hadamard matrix (hadamard_heads). */
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

/* x[0:D] = (y[0:D] @ H) * c, H the Sylvester Hadamard matrix (entries +-1)
 * of order D, a power of two <= 512: R = H diag(c) is the shipped
 * checkpoints' signed Hadamard / sqrt(D) (KeyTransform.hadamard_scales), and
 * this is y @ R in D log2 D sums instead of D^2 multiply-adds. log2(D)
 * stages of butterflies (a + b, a - b), stride 1 first, then each output
 * times its c: the same additions in any path, so the vector code below
 * gives these bits. */
static inline void hadamard_any(const float *y, const float *c, float *x, int D) {
    float t[512];
    for (int d = 0; d < D; d++) t[d] = y[d];
    for (int h = 1; h < D; h *= 2)
        for (int i = 0; i < D; i += 2 * h)
            for (int k = i; k < i + h; k++) {
                const float a = t[k], b = t[k + h];
                t[k] = a + b;
                t[k + h] = a - b;
            }
    for (int d = 0; d < D; d++) x[d] = t[d] * c[d];
}

#ifdef __AVX512F__
/* one butterfly stage inside a vector: sw holds each lane's partner; lanes
 * with the stride's bit set take partner - own (a - b), the others own +
 * partner (a + b) */
static inline __m512 butterfly(__m512 v, __m512 sw, __mmask16 upper) {
    return _mm512_mask_sub_ps(_mm512_add_ps(v, sw), upper, sw, v);
}

/* hadamard_any for D = 16 n: strides 1-8 by lane permutes, then across vectors */
static inline __attribute__((always_inline)) void hadamard16(const float *y, const float *c, float *x, const int n) {
    __m512 v[32];
    for (int u = 0; u < n; u++) {
        __m512 a = _mm512_loadu_ps(y + 16 * u);
        a = butterfly(a, _mm512_permute_ps(a, 0xb1), 0xaaaa);                /* lanes 1 0 3 2 */
        a = butterfly(a, _mm512_permute_ps(a, 0x4e), 0xcccc);                /* lanes 2 3 0 1 */
        a = butterfly(a, _mm512_shuffle_f32x4(a, a, 0xb1), 0xf0f0);          /* 128-bit lanes 1 0 3 2 */
        v[u] = butterfly(a, _mm512_shuffle_f32x4(a, a, 0x4e), 0xff00);       /* 256-bit halves swapped */
    }
    for (int h = 1; h < n; h *= 2)
        for (int i = 0; i < n; i += 2 * h)
            for (int k = i; k < i + h; k++) {
                const __m512 a = v[k], b = v[k + h];
                v[k] = _mm512_add_ps(a, b);
                v[k + h] = _mm512_sub_ps(a, b);
            }
    for (int u = 0; u < n; u++) _mm512_storeu_ps(x + 16 * u, _mm512_mul_ps(v[u], _mm512_loadu_ps(c + 16 * u)));
}
#endif

/* x[j] = (y[j] @ H) * c for the nh rows of one group of heads */
static void hadamard_heads(float (*y)[512], const float *c, float *const *x, int nh, int D) {
    for (int j = 0; j < nh; j++) {
#ifdef __AVX512F__
        if (D == 64) { hadamard16(y[j], c, x[j], 4); continue; }
        if (D == 128) { hadamard16(y[j], c, x[j], 8); continue; }
        if (D % 16 == 0) { hadamard16(y[j], c, x[j], D / 16); continue; }
#endif
        hadamard_any(y[j], c, x[j], D);
    }
}

#endif
