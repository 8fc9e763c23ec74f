/* y[M, N] (fp32) = x[M, K] (fp32) . W[N, K]^T, W in fp32, bf16 or fp16: the LM head
 * (and any dense linear that must not depend on its batch); float_linear_bf16
 * takes bf16 rows and gives bf16 (or fp32) outputs, the same sums.
 *
 * Batch-invariant by construction: every output is one dot product summed in
 * one fixed order, whatever M, the tiling or the thread count: 16 lanes, lane
 * l accumulates x[k] * w[k] for k = l (mod 16) in increasing k with fused
 * multiply-adds (K zero-padded to a multiple of 16 in effect), then the lanes
 * are added pairwise l + 8, l + 4, l + 2, l + 1. The AVX-512 path and the
 * AVX2 one (each 16-lane sum as two 8-lane halves: l + 8 is the halves' add)
 * and the scalar one compute exactly that, so they agree bit for bit. bf16
 * rows times bf16 weights on CPUs with AVX512-BF16 take the dot-product path
 * instead (float_linear_dot.h): another fixed order, as batch-invariant.
 *
 * The AVX-512 (F/BW/VL, BF16) and AVX2 (+FMA, F16C) code is compiled by target
 * attributes and chosen at run time; the library is built for a baseline
 * x86-64 CPU.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include "bf16.h"
#include "team.h"

enum { LANES = 16, PANEL_ROWS = 4 };  /* PANEL_ROWS: NR of the SIMD tiles */

enum { W_FP32 = 0, W_BF16 = 1, W_FP16 = 2 };  /* w_kind: the weight dtype */

static inline float weight(const void *w, int kind, int64_t i) {
    return kind == W_FP16 ? half_to_float(((const uint16_t *)w)[i]) : load(w, kind == W_BF16, i);
}

static float lane_tree(float *s) {
    for (int h = LANES / 2; h >= 1; h /= 2)
        for (int l = 0; l < h; l++) s[l] = s[l] + s[l + h];
    return s[0];
}

static void rows_scalar(const float *x, int64_t M, int64_t K, const void *w, int w_kind,
                        int64_t n_lo, int64_t n_hi, int64_t N, float *y) {
    for (int64_t n = n_lo; n < n_hi; n++) {
        for (int64_t m = 0; m < M; m++) {
            float s[LANES] = {0};
            /* the padding lanes too: fma(0, 0, -0) is +0, as in the vector path */
            for (int64_t k = 0; k < (K + LANES - 1) / LANES * LANES; k++)
                s[k % LANES] = k < K ? fmaf(x[m * K + k], weight(w, w_kind, n * K + k), s[k % LANES])
                                     : fmaf(0.f, 0.f, s[k % LANES]);
            y[m * N + n] = lane_tree(s);
        }
    }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#include "lane_mask.h"
#define HAVE_SIMD 1
#define SIMD __attribute__((target("avx512f,avx512bw,avx512vl")))
#define AVX512_FN SIMD
#include "bf16_avx512.h"

static int simd_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
}

SIMD static inline __m512 load_w(const void *w, int w_kind, int64_t i, __mmask16 mask) {
    if (w_kind == W_BF16) return load_f32(w, 1, i, mask);
    if (w_kind == W_FP16) return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, (const uint16_t *)w + i));
    return _mm512_maskz_loadu_ps(mask, (const float *)w + i);
}

/* The lane trees of up to 16 accumulators at once: v[j] -> lane j of the
 * result is lane_tree(v[j]) (same pairs, l + 8, l + 4, l + 2, l + 1, so the
 * same bits), in 15 adds and 30 shuffles instead of 16 separate reductions. */
SIMD static inline __m512 reduce16(const __m512 *v) {
    __m512 s[8], t[4], u[2];
    for (int p = 0; p < 8; p++)  /* l + 8: 128-bit chunks {0,1} + {2,3} of each vector */
        s[p] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0xEE));
    for (int p = 0; p < 4; p++)  /* l + 4: chunks {0,2} + {1,3} */
        t[p] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * p], s[2 * p + 1], 0x88),
                             _mm512_shuffle_f32x4(s[2 * p], s[2 * p + 1], 0xDD));
    for (int p = 0; p < 2; p++)  /* l + 2, within each chunk */
        u[p] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * p], t[2 * p + 1], 0x44),
                             _mm512_shuffle_ps(t[2 * p], t[2 * p + 1], 0xEE));
    /* l + 1; lane 4c + e now holds the sum of vector 4e + c */
    const __m512 f = _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], 0x88), _mm512_shuffle_ps(u[0], u[1], 0xDD));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), f);
}

/* float_to_bf16 of n values, 16 at a time (bf16_avx512.h) */
SIMD static void to_bf16_simd(const float *src, uint16_t *dst, int64_t n) {
    for (int64_t i = 0; i < n; i += LANES) {
        const __mmask16 mask = lane_mask(n - i);
        _mm256_mask_storeu_epi16(dst + i, mask, to_bf16(_mm512_maskz_loadu_ps(mask, src + i)));
    }
}

enum { MR = 4, NR = PANEL_ROWS, NR_WIDE = 8 };  /* MR x NR, or 1-2 rows x NR_WIDE: at most 16 sums */

/* an mr x nr tile (mr * nr <= 16); inlined with constant sizes, its
 * accumulators live in registers. wk: the weights' kind, or W_FP32 when w is
 * an fp32 panel already converted (row stride wstride elements). fetch:
 * request the weight rows two tiles ahead (the first row tile of weights
 * read in place: in a step they come from memory) */
SIMD static inline __attribute__((always_inline)) void tile(const float *x, int64_t K, const void *w, int w_kind,
                                                            int64_t wstride, int64_t m0, int mr, int64_t n0,
                                                            int nr, int64_t N, float *y, int fetch) {
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += LANES) {
        const __mmask16 mask = lane_mask(K - k);
        __m512 wv[NR_WIDE], xv[MR];
        if (fetch) {
            const int es = w_kind == W_FP32 ? 4 : 2;
            for (int j = 0; j < nr; j++)
                _mm_prefetch((const char *)w + ((n0 + 2 * nr + j) * wstride + k) * es, _MM_HINT_T0);
        }
        for (int j = 0; j < nr; j++) wv[j] = load_w(w, w_kind, (n0 + j) * wstride + k, mask);
        for (int i = 0; i < mr; i++) xv[i] = _mm512_maskz_loadu_ps(mask, x + (m0 + i) * K + k);
        for (int i = 0; i < mr; i++)
            for (int j = 0; j < nr; j++) acc[i * nr + j] = _mm512_fmadd_ps(xv[i], wv[j], acc[i * nr + j]);
    }
    float out[16];
    _mm512_storeu_ps(out, reduce16(acc));
    for (int i = 0; i < mr; i++) memcpy(y + (m0 + i) * N + n0, out + i * nr, (size_t)nr * sizeof(float));
}

/* NR rows of W (n0..) as fp32, K zero-padded to kp: converted once, then read
 * by every row tile of x */
SIMD static void to_panel(const void *w, int w_kind, int64_t K, int64_t kp, int64_t n0, int nr, float *panel) {
    for (int j = 0; j < nr; j++)
        for (int64_t k = 0; k < kp; k += LANES) {
            _mm512_storeu_ps(panel + j * kp + k, load_w(w, w_kind, (n0 + j) * K + k, lane_mask(K - k)));
        }
}

SIMD static void rows_simd(const float *x, int64_t M, int64_t K, const void *w, int w_kind,
                           int64_t n_lo, int64_t n_hi, int64_t N, float *y, float *panel) {
    if (M <= 2) {  /* decode: a GEMV, more weight rows in flight */
        for (int64_t n0 = n_lo; n0 < n_hi; n0 += NR_WIDE) {
            const int nr = n_hi - n0 < NR_WIDE ? (int)(n_hi - n0) : NR_WIDE;
            if (nr < NR_WIDE) tile(x, K, w, w_kind, K, 0, (int)M, n0, nr, N, y, 1);
            else if (M == 2) tile(x, K, w, w_kind, K, 0, 2, n0, NR_WIDE, N, y, 1);
            else tile(x, K, w, w_kind, K, 0, 1, n0, NR_WIDE, N, y, 1);
        }
        return;
    }
    const int64_t kp = (K + LANES - 1) / LANES * LANES;
    for (int64_t n0 = n_lo; n0 < n_hi; n0 += NR) {
        const int nr = n_hi - n0 < NR ? (int)(n_hi - n0) : NR;
        /* without a panel (fp32 weights) the tiles read W in place */
        const void *wt = w;
        int wk = w_kind;
        int64_t ws = K, wn = n0;
        if (panel) {
            to_panel(w, w_kind, K, kp, n0, nr, panel);
            wt = panel, wk = W_FP32, ws = kp, wn = 0;
        }
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            const int mr = M - m0 < MR ? (int)(M - m0) : MR, fetch = !panel && m0 == 0;
            if (nr < NR) { tile(x, K, wt, wk, ws, m0, mr, wn, nr, N, y + n0 - wn, fetch); continue; }
            switch (mr) {
            case 4: tile(x, K, wt, wk, ws, m0, 4, wn, NR, N, y + n0 - wn, fetch); break;
            case 3: tile(x, K, wt, wk, ws, m0, 3, wn, NR, N, y + n0 - wn, fetch); break;
            case 2: tile(x, K, wt, wk, ws, m0, 2, wn, NR, N, y + n0 - wn, fetch); break;
            default: tile(x, K, wt, wk, ws, m0, 1, wn, NR, N, y + n0 - wn, fetch);
            }
        }
    }
}

#include "float_linear_dot.h"
#include "float_linear_avx2.h"
#else
#define HAVE_SIMD 0
static int simd_supported(void) { return 0; }
static int avx2_supported(void) { return 0; }
static void rows_simd(const float *x, int64_t M, int64_t K, const void *w, int w_kind,
                      int64_t n_lo, int64_t n_hi, int64_t N, float *y, float *panel) {
    (void)panel;
    rows_scalar(x, M, K, w, w_kind, n_lo, n_hi, N, y);
}
static void rows_avx2(const float *x, int64_t M, int64_t K, const void *w, int w_kind,
                      int64_t n_lo, int64_t n_hi, int64_t N, float *y) {
    rows_scalar(x, M, K, w, w_kind, n_lo, n_hi, N, y);
}
static void to_bf16_simd(const float *src, uint16_t *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = float_to_bf16(src[i]);
}
static int dot_supported(void) { return 0; }
static void rows_dot(const uint16_t *x, int64_t M, int64_t K, const uint16_t *w, int64_t n_lo, int64_t n_hi,
                     int64_t N, float *y) {  /* never called: float_linear_simd() is below 3 here */
    (void)x, (void)M, (void)K, (void)w, (void)n_lo, (void)n_hi, (void)N, (void)y;
}
#endif

/* The vector path this CPU runs: 3 AVX-512 with the bf16 dot products (for
 * bf16 rows times bf16 weights; otherwise as 2), 2 AVX-512, 1 AVX2, 0 none */
int float_linear_simd(void) { return dot_supported() ? 3 : simd_supported() ? 2 : avx2_supported() ? 1 : 0; }

enum { CHUNK = 64 };  /* output columns a thread takes at a time: a multiple of NR */
enum { ROW_BLOCK = 256 };  /* rows of one task of a long call */

static __thread void *tl_rows, *tl_out;  /* bf16 calls: the rows widened, a chunk's fp32 outputs */
static __thread size_t tl_rows_size, tl_out_size;

/* Thread tm.t of tm.T: its share of the output column chunks (the chunking
 * never changes a result, only who computes it). x: fp32 rows, or with `dot`
 * bf16 rows for the dot-product path (bf16 weights). With y_bf16 each chunk's
 * sums go to a per-thread buffer (row stride CHUNK), get the bias and are
 * rounded to bf16 into y, as torch rounds the fp32 result. Nonzero when its
 * buffers could not be had. */
static int float_part(const void *x, int dot, int64_t M, int64_t K, const void *w, int w_kind, int64_t N,
                      const float *bias, void *y, int y_bf16, int simd, team_t tm) {
    const int64_t chunks = (N + CHUNK - 1) / CHUNK;
    /* bf16/fp16 weights read by more than two row tiles are converted once per
     * NR rows into a per-thread fp32 panel instead of once per row tile */
    const int use_panel = !dot && simd >= 2 && w_kind != W_FP32 && M > 8;
    const int64_t kp = (K + LANES - 1) / LANES * LANES;
    float *panel = use_panel ? malloc((size_t)(PANEL_ROWS * kp) * sizeof(float)) : NULL;
    float *out = y_bf16 ? grow_scratch(&tl_out, &tl_out_size, sizeof(float) * (size_t)(M * CHUNK)) : NULL;
    if ((use_panel && !panel) || (y_bf16 && !out)) {
        free(panel);
        return 1;
    }
    /* tasks: column chunks, each cut into row blocks of long calls, so that
     * prompt-sized calls of few chunks split evenly; consecutive tasks share
     * a chunk, whose weights then stay in L2 */
    const int64_t blocks = (M + ROW_BLOCK - 1) / ROW_BLOCK, tasks = chunks * blocks;
    const size_t x_row = (size_t)K * (dot ? sizeof(uint16_t) : sizeof(float));
    for (int64_t task = tasks * tm.t / tm.T; task < tasks * (tm.t + 1) / tm.T; task++) {
        const int64_t c = task / blocks, m0 = task % blocks * ROW_BLOCK;
        const int64_t rows = M - m0 < ROW_BLOCK ? M - m0 : ROW_BLOCK;
        const int64_t lo = c * CHUNK, hi = lo + CHUNK < N ? lo + CHUNK : N, ys = y_bf16 ? CHUNK : N;
        /* column n of row m (from m0) at yc[m * ys + n] */
        float *yc = (y_bf16 ? out - lo : (float *)y) + m0 * ys;
        const void *xb = (const char *)x + (size_t)m0 * x_row;
        if (dot) rows_dot(xb, rows, K, w, lo, hi, ys, yc);
        else if (simd >= 2) rows_simd(xb, rows, K, w, w_kind, lo, hi, ys, yc, panel);
        else if (simd == 1) rows_avx2(xb, rows, K, w, w_kind, lo, hi, ys, yc);
        else rows_scalar(xb, rows, K, w, w_kind, lo, hi, ys, yc);
        if (bias)
            for (int64_t m = 0; m < rows; m++)
                for (int64_t n = lo; n < hi; n++) yc[m * ys + n] += bias[n];
        for (int64_t m = 0; y_bf16 && m < rows; m++) {
            uint16_t *row = (uint16_t *)y + (m0 + m) * N;
            if (simd >= 2) to_bf16_simd(yc + m * ys + lo, row + lo, hi - lo);
            else
                for (int64_t n = lo; n < hi; n++) row[n] = float_to_bf16(yc[m * ys + n]);
        }
    }
    free(panel);
    return 0;
}

/* y = x W^T (+ bias, fp32 [N] or NULL) on vector path `simd` (as
 * float_linear_simd; 0 the scalar loops). Returns 0, or -2 when simd asks for
 * a path this CPU lacks, -3 when a panel could not be allocated. */
int float_linear(const float *x, int64_t M, int64_t K, const void *w, int w_kind, int64_t N,
                 const float *bias, float *y, int simd, int threads) {
    if (simd > float_linear_simd()) return -2;
    if (M <= 0 || N <= 0) return 0;
    int failed = 0;
    TEAM_RUN(threads, M * N * K > (1 << 16),
             if (float_part(x, 0, M, K, w, w_kind, N, bias, y, 0, simd, tm)) team_fail(&failed));
    return failed ? -3 : 0;
}

static void *volatile team_rows;  /* thread 0's widened rows, in a running team (team.h) */

/* float_linear of bf16 rows x [M, K], widened exactly to fp32 first (each
 * thread its share, then the team meets): the same sums as for those fp32
 * rows; on path 3 with bf16 weights, the dot-product path's sums of the rows
 * as they are (float_linear_dot.h). y [M, N] is bf16 (y_bf16: each output
 * rounded to nearest even after the bias, as torch's .to(bfloat16) of the
 * fp32 result) or fp32. What a bf16 model's linears and LM head call, so that
 * no conversion runs outside the kernel (a captured step replays kernels
 * only). Returns as float_linear. */
int float_linear_bf16(const uint16_t *x, int64_t M, int64_t K, const void *w, int w_kind, int64_t N,
                      const float *bias, void *y, int y_bf16, int simd, int threads) {
    if (simd > float_linear_simd()) return -2;
    if (M <= 0 || N <= 0) return 0;
    int failed = 0;
    if (simd == 3 && w_kind == W_BF16) {
        TEAM_RUN(threads, M * N * K > (1 << 16),
                 if (float_part(x, 1, M, K, w, w_kind, N, bias, y, y_bf16, simd, tm)) team_fail(&failed));
        return failed ? -3 : 0;
    }
    const size_t row_bytes = sizeof(float) * (size_t)(M * K);
    /* in a running team thread 0 makes the rows buffer inside the part */
    float *made = team_joined() ? NULL : grow_scratch(&tl_rows, &tl_rows_size, row_bytes);
    if (!team_joined() && !made) return -3;
    TEAM_RUN(threads, M * N * K > (1 << 16), {
        float *xf = team_buffer(tm, made, &team_rows, &tl_rows, &tl_rows_size, row_bytes);
        for (int64_t i = M * K * tm.t / tm.T; xf && i < M * K * (tm.t + 1) / tm.T; i++) xf[i] = bf16_to_float(x[i]);
        TEAM_SYNC(tm);
        if (!xf || float_part(xf, 0, M, K, w, w_kind, N, bias, y, y_bf16, simd, tm))
            team_fail(&failed);
    });
    return failed ? -3 : 0;
}
