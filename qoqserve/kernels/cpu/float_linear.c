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
 * and the scalar one compute exactly that, so they agree bit for bit.
 *
 * The AVX-512 (F/BW/VL) and AVX2 (+FMA, F16C) code is compiled by target
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

static int simd_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
}

SIMD static inline __m512 load_w(const void *w, int w_kind, int64_t i, __mmask16 mask) {
    if (w_kind == W_BF16) {
        __m256i h = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)w + i);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
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

enum { MR = 4, NR = PANEL_ROWS, NR_WIDE = 8 };  /* MR x NR, or 1-2 rows x NR_WIDE: at most 16 sums */

/* an mr x nr tile (mr * nr <= 16); inlined with constant sizes, its
 * accumulators live in registers. wk: the weights' kind, or W_FP32 when w is
 * an fp32 panel already converted (row stride wstride elements). */
SIMD static inline __attribute__((always_inline)) void tile(const float *x, int64_t K, const void *w, int w_kind,
                                                            int64_t wstride, int64_t m0, int mr, int64_t n0,
                                                            int nr, int64_t N, float *y) {
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += LANES) {
        const __mmask16 mask = lane_mask(K - k);
        __m512 wv[NR_WIDE], xv[MR];
        if (mr <= 2) {  /* a GEMV streams the weights: fetch two tiles ahead */
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
            if (nr < NR_WIDE) tile(x, K, w, w_kind, K, 0, (int)M, n0, nr, N, y);
            else if (M == 2) tile(x, K, w, w_kind, K, 0, 2, n0, NR_WIDE, N, y);
            else tile(x, K, w, w_kind, K, 0, 1, n0, NR_WIDE, N, y);
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
            const int mr = M - m0 < MR ? (int)(M - m0) : MR;
            if (nr < NR) { tile(x, K, wt, wk, ws, m0, mr, wn, nr, N, y + n0 - wn); continue; }
            switch (mr) {
            case 4: tile(x, K, wt, wk, ws, m0, 4, wn, NR, N, y + n0 - wn); break;
            case 3: tile(x, K, wt, wk, ws, m0, 3, wn, NR, N, y + n0 - wn); break;
            case 2: tile(x, K, wt, wk, ws, m0, 2, wn, NR, N, y + n0 - wn); break;
            default: tile(x, K, wt, wk, ws, m0, 1, wn, NR, N, y + n0 - wn);
            }
        }
    }
}

/* ---------------------------------------------------------------- AVX2 */
#define AVX2 __attribute__((target("avx2,fma,f16c")))

static int avx2_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

/* elements k..k+7 of row r as fp32 (n valid, the rest 0) */
AVX2 static inline __m256 load8(const void *w, int w_kind, int64_t i, int64_t n) {
    if (n < 8) {
        float tmp[8] = {0};
        for (int64_t e = 0; e < n; e++) tmp[e] = weight(w, w_kind, i + e);
        return _mm256_loadu_ps(tmp);
    }
    if (w_kind == W_BF16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    if (w_kind == W_FP16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + i)));
    return _mm256_loadu_ps((const float *)w + i);
}

/* lane_tree of the 16 lanes (lo = 0..7, hi = 8..15): l + 8, l + 4, l + 2, l + 1 */
AVX2 static inline float tree16(__m256 lo, __m256 hi) {
    const __m256 s8 = _mm256_add_ps(lo, hi);
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

enum { MR2 = 2, NR2 = 3 };  /* 2 x 3 sums of two halves: 12 of the 16 ymm */

AVX2 static inline __attribute__((always_inline)) void tile2(const float *x, int64_t K, const void *w, int w_kind,
                                                             int64_t m0, int mr, int64_t n0, int nr, int64_t N,
                                                             float *y) {
    __m256 lo[MR2 * NR2], hi[MR2 * NR2];
    for (int i = 0; i < MR2 * NR2; i++) lo[i] = hi[i] = _mm256_setzero_ps();
    const float *xr = x + m0 * K;
    int64_t k = 0;
    for (; k + LANES <= K; k += LANES) {  /* whole 16-lane steps: plain loads */
        __m256 xl[MR2], xh[MR2];
        for (int i = 0; i < mr; i++) {
            xl[i] = _mm256_loadu_ps(xr + i * K + k);
            xh[i] = _mm256_loadu_ps(xr + i * K + k + 8);
        }
        for (int j = 0; j < nr; j++) {
            const __m256 wl = load8(w, w_kind, (n0 + j) * K + k, 8), wh = load8(w, w_kind, (n0 + j) * K + k + 8, 8);
            for (int i = 0; i < mr; i++) {
                lo[i * NR2 + j] = _mm256_fmadd_ps(xl[i], wl, lo[i * NR2 + j]);
                hi[i * NR2 + j] = _mm256_fmadd_ps(xh[i], wh, hi[i * NR2 + j]);
            }
        }
    }
    if (k < K) {  /* the ragged last step, zero-padded as the other paths */
        for (int j = 0; j < nr; j++) {
            const __m256 wl = load8(w, w_kind, (n0 + j) * K + k, K - k);
            const __m256 wh = load8(w, w_kind, (n0 + j) * K + k + 8, K - k - 8);
            for (int i = 0; i < mr; i++) {
                lo[i * NR2 + j] = _mm256_fmadd_ps(load8(xr, W_FP32, i * K + k, K - k), wl, lo[i * NR2 + j]);
                hi[i * NR2 + j] = _mm256_fmadd_ps(load8(xr, W_FP32, i * K + k + 8, K - k - 8), wh, hi[i * NR2 + j]);
            }
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) y[(m0 + i) * N + n0 + j] = tree16(lo[i * NR2 + j], hi[i * NR2 + j]);
}

#define TILE2(a, b) tile2(x, K, w, w_kind, m0, a, n0, b, N, y)

AVX2 static void rows_avx2(const float *x, int64_t M, int64_t K, const void *w, int w_kind,
                           int64_t n_lo, int64_t n_hi, int64_t N, float *y) {
    for (int64_t n0 = n_lo; n0 < n_hi; n0 += NR2) {
        const int nr = n_hi - n0 < NR2 ? (int)(n_hi - n0) : NR2;
        for (int64_t m0 = 0; m0 < M; m0 += MR2) {
            const int mr = M - m0 < MR2 ? (int)(M - m0) : MR2;
            switch (mr * 4 + nr) {
            case 11: TILE2(2, 3); break;
            case 10: TILE2(2, 2); break;
            case 9: TILE2(2, 1); break;
            case 7: TILE2(1, 3); break;
            case 6: TILE2(1, 2); break;
            default: TILE2(1, 1);
            }
        }
    }
}
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
#endif

/* The vector path this CPU runs: 2 AVX-512, 1 AVX2, 0 none */
int float_linear_simd(void) { return simd_supported() ? 2 : avx2_supported() ? 1 : 0; }

enum { CHUNK = 64 };  /* output columns a thread takes at a time: a multiple of NR */

static __thread void *tl_rows, *tl_out;  /* bf16 calls: the rows widened, a chunk's fp32 outputs */
static __thread size_t tl_rows_size, tl_out_size;

/* Thread tm.t of tm.T: its share of the output column chunks (the chunking
 * never changes a result, only who computes it). With y_bf16 each chunk's
 * sums go to a per-thread buffer (row stride CHUNK), get the bias and are
 * rounded to bf16 into y, as torch rounds the fp32 result. Nonzero when its
 * buffers could not be had. */
static int float_part(const float *x, int64_t M, int64_t K, const void *w, int w_kind, int64_t N,
                      const float *bias, void *y, int y_bf16, int simd, int use_panel, int64_t kp, team_t tm) {
    const int64_t chunks = (N + CHUNK - 1) / CHUNK;
    float *panel = use_panel ? malloc((size_t)(PANEL_ROWS * kp) * sizeof(float)) : NULL;
    float *out = y_bf16 ? grow_scratch(&tl_out, &tl_out_size, sizeof(float) * (size_t)(M * CHUNK)) : NULL;
    if ((use_panel && !panel) || (y_bf16 && !out)) {
        free(panel);
        return 1;
    }
    for (int64_t c = chunks * tm.t / tm.T; c < chunks * (tm.t + 1) / tm.T; c++) {
        const int64_t lo = c * CHUNK, hi = lo + CHUNK < N ? lo + CHUNK : N, ys = y_bf16 ? CHUNK : N;
        float *yc = y_bf16 ? out - lo : (float *)y;  /* column n of row m at yc[m * ys + n] */
        if (simd == 2) rows_simd(x, M, K, w, w_kind, lo, hi, ys, yc, panel);
        else if (simd == 1) rows_avx2(x, M, K, w, w_kind, lo, hi, ys, yc);
        else rows_scalar(x, M, K, w, w_kind, lo, hi, ys, yc);
        if (bias)
            for (int64_t m = 0; m < M; m++)
                for (int64_t n = lo; n < hi; n++) yc[m * ys + n] += bias[n];
        for (int64_t m = 0; y_bf16 && m < M; m++)
            for (int64_t n = lo; n < hi; n++) ((uint16_t *)y)[m * N + n] = float_to_bf16(yc[m * ys + n]);
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
    /* bf16/fp16 weights read by more than two row tiles are converted once per
     * NR rows into a per-thread fp32 panel instead of once per row tile */
    const int use_panel = simd == 2 && w_kind != W_FP32 && M > 8;
    const int64_t kp = (K + LANES - 1) / LANES * LANES;
    int failed = 0;
    TEAM_RUN(threads, M * N * K > (1 << 16),
             if (float_part(x, M, K, w, w_kind, N, bias, y, 0, simd, use_panel, kp, tm)) team_fail(&failed));
    return failed ? -3 : 0;
}

static void *volatile team_rows;  /* thread 0's widened rows, in a running team (team.h) */

/* float_linear of bf16 rows x [M, K], widened exactly to fp32 first (each
 * thread its share, then the team meets): the same sums as for those fp32
 * rows. y [M, N] is bf16 (y_bf16: each output rounded to nearest even after
 * the bias, as torch's .to(bfloat16) of the fp32 result) or fp32. What a bf16
 * model's linears and LM head call, so that no conversion runs outside the
 * kernel (a captured step replays kernels only). Returns as float_linear. */
int float_linear_bf16(const uint16_t *x, int64_t M, int64_t K, const void *w, int w_kind, int64_t N,
                      const float *bias, void *y, int y_bf16, int simd, int threads) {
    if (simd > float_linear_simd()) return -2;
    if (M <= 0 || N <= 0) return 0;
    const int use_panel = simd == 2 && w_kind != W_FP32 && M > 8;
    const int64_t kp = (K + LANES - 1) / LANES * LANES;
    const size_t row_bytes = sizeof(float) * (size_t)(M * K);
    /* in a running team thread 0 makes the rows buffer inside the part */
    float *made = team_joined() ? NULL : grow_scratch(&tl_rows, &tl_rows_size, row_bytes);
    if (!team_joined() && !made) return -3;
    int failed = 0;
    TEAM_RUN(threads, M * N * K > (1 << 16), {
        float *xf = team_buffer(tm, made, &team_rows, &tl_rows, &tl_rows_size, row_bytes);
        for (int64_t i = M * K * tm.t / tm.T; xf && i < M * K * (tm.t + 1) / tm.T; i++) xf[i] = bf16_to_float(x[i]);
        TEAM_SYNC(tm);
        if (!xf || float_part(xf, M, K, w, w_kind, N, bias, y, y_bf16, simd, use_panel, kp, tm))
            team_fail(&failed);
    });
    return failed ? -3 : 0;
}
