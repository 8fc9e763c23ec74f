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
 * instead (float_linear_dot.h), and on CPUs with AMX-BF16 the tiles
 * (float_linear_amx.h): each another fixed order, as batch-invariant.
 *
 * The AVX-512 (F/BW/VL, BF16), AMX and AVX2 (+FMA, F16C) code is compiled by
 * target attributes and chosen at run time; the library is built for a
 * baseline x86-64 CPU.
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

#include "float_linear_avx512.h"
#include "float_linear_dot.h"
#include "float_linear_amx.h"
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
static int amx_bf16_supported(void) { return 0; }
static int64_t x_tiles_bytes(int64_t M, int64_t K) { return M * K; }
static size_t weight_edge_bytes(int64_t K) { return (size_t)K; }
static void x_tiles(const uint16_t *x, int64_t M, int64_t K, uint32_t *xt, int t, int T) {
    (void)x, (void)M, (void)K, (void)xt, (void)t, (void)T;
}
static void rows_amx(const uint32_t *xt, int one_row, int64_t rows, int64_t K, const uint16_t *w, int64_t N_w,
                     int64_t n_lo, int64_t n_hi, int64_t N, float *y, uint16_t *edge) {  /* never called */
    (void)xt, (void)one_row, (void)rows, (void)K, (void)w, (void)N_w, (void)n_lo, (void)n_hi, (void)N, (void)y, (void)edge;
}
static void amx_tiles_begin(int one_row) { (void)one_row; }
static void amx_end(void) {}
static void rows_dot(const uint16_t *x, int64_t M, int64_t K, const uint16_t *w, int64_t n_lo, int64_t n_hi,
                     int64_t N, float *y) {  /* never called: float_linear_simd() is below 3 here */
    (void)x, (void)M, (void)K, (void)w, (void)n_lo, (void)n_hi, (void)N, (void)y;
}
#endif

/* The vector path this CPU runs: 4 the AMX-BF16 tiles and 3 AVX-512 with the
 * bf16 dot products (for bf16 rows times bf16 weights; otherwise as 2), 2
 * AVX-512, 1 AVX2, 0 none */
int float_linear_simd(void) {
    return amx_bf16_supported() ? 4 : dot_supported() ? 3 : simd_supported() ? 2 : avx2_supported() ? 1 : 0;
}

enum { ROWS_FP32, ROWS_DOT, ROWS_TILES };  /* what float_part's x holds: fp32 rows, bf16 rows, x^T tiles */

enum { CHUNK = 64 };  /* output columns a thread takes at a time: a multiple of NR */
enum { ROW_BLOCK = 256 };  /* rows of one task of a long call */

static __thread void *tl_rows, *tl_out, *tl_edge;  /* bf16 calls: the rows widened or as x^T tiles, a
                                                   * chunk's fp32 outputs, the tiles' edge weights */
static __thread size_t tl_rows_size, tl_out_size, tl_edge_size;
static __thread void *tl_tiles;  /* a call of one row tile: this thread's copy of its x^T tiles */
static __thread size_t tl_tiles_size;

/* Thread tm.t of tm.T: its share of the output column chunks (the chunking
 * never changes a result, only who computes it). x as `rows` says: fp32 rows,
 * bf16 rows for the dot-product path, or x^T tiles (x_tiles) for the AMX path
 * (both bf16 weights). With y_bf16 each chunk's sums go to a per-thread
 * buffer (row stride CHUNK), get the bias and are rounded to bf16 into y, as
 * torch rounds the fp32 result. Nonzero when its buffers could not be had. */
static int float_part(const void *x, int rows_are, int64_t M, int64_t K, const void *w, int w_kind, int64_t N,
                      const float *bias, void *y, int y_bf16, int simd, team_t tm) {
    const int64_t chunks = (N + CHUNK - 1) / CHUNK;
    /* bf16/fp16 weights read by more than two row tiles are converted once per
     * NR rows into a per-thread fp32 panel instead of once per row tile */
    const int use_panel = rows_are == ROWS_FP32 && simd >= 2 && w_kind != W_FP32 && M > 8;
    const int64_t kp = (K + LANES - 1) / LANES * LANES;
    float *panel = use_panel ? malloc((size_t)(PANEL_ROWS * kp) * sizeof(float)) : NULL;
    float *out = y_bf16 ? grow_scratch(&tl_out, &tl_out_size, sizeof(float) * (size_t)(M * CHUNK)) : NULL;
    uint16_t *edge = rows_are == ROWS_TILES
                         ? grow_scratch(&tl_edge, &tl_edge_size, weight_edge_bytes(K)) : NULL;
    if ((use_panel && !panel) || (y_bf16 && !out) || (rows_are == ROWS_TILES && !edge)) {
        free(panel);
        return 1;
    }
    /* tasks: column chunks, each cut into row blocks of long calls, so that
     * prompt-sized calls of few chunks split evenly; consecutive tasks share
     * a chunk, whose weights then stay in L2 */
    const int64_t blocks = (M + ROW_BLOCK - 1) / ROW_BLOCK, tasks = chunks * blocks;
    /* a row block's rows: K elements a row, or (tiles) 16 rows' tiles a 16th */
    const size_t x_row = rows_are == ROWS_TILES ? (size_t)x_tiles_bytes(16, K) / 16
                         : (size_t)K * (rows_are == ROWS_DOT ? sizeof(uint16_t) : sizeof(float));
    if (rows_are == ROWS_TILES) amx_tiles_begin(M == 1);
    for (int64_t task = tasks * tm.t / tm.T; task < tasks * (tm.t + 1) / tm.T; task++) {
        const int64_t c = task / blocks, m0 = task % blocks * ROW_BLOCK;
        const int64_t rows = M - m0 < ROW_BLOCK ? M - m0 : ROW_BLOCK;
        const int64_t lo = c * CHUNK, hi = lo + CHUNK < N ? lo + CHUNK : N, ys = y_bf16 ? CHUNK : N;
        /* column n of row m (from m0) at yc[m * ys + n] */
        float *yc = (y_bf16 ? out - lo : (float *)y) + m0 * ys;
        const void *xb = (const char *)x + (size_t)m0 * x_row;
        if (rows_are == ROWS_TILES) rows_amx(xb, M == 1, rows, K, w, N, lo, hi, ys, yc, edge);
        else if (rows_are == ROWS_DOT) rows_dot(xb, rows, K, w, lo, hi, ys, yc);
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
    if (rows_are == ROWS_TILES) amx_end();
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
             if (float_part(x, ROWS_FP32, M, K, w, w_kind, N, bias, y, 0, simd, tm)) team_fail(&failed));
    return failed ? -3 : 0;
}

static void *volatile team_rows;  /* thread 0's widened rows or x^T tiles, in a running team (team.h) */

/* float_linear of bf16 rows x [M, K], widened exactly to fp32 first (each
 * thread its share, then the team meets): the same sums as for those fp32
 * rows; on path 3 with bf16 weights, the dot-product path's sums of the rows
 * as they are (float_linear_dot.h), on path 4 the AMX tiles' (rewritten as
 * x^T tiles the same way first; float_linear_amx.h). y [M, N] is bf16
 * (y_bf16: each output rounded to nearest even after the bias, as torch's
 * .to(bfloat16) of the fp32 result) or fp32. What a bf16 model's linears and
 * LM head call, so that no conversion runs outside the kernel (a captured
 * step replays kernels only). Returns as float_linear. */
int float_linear_bf16(const uint16_t *x, int64_t M, int64_t K, const void *w, int w_kind, int64_t N,
                      const float *bias, void *y, int y_bf16, int simd, int threads) {
    if (simd > float_linear_simd()) return -2;
    if (M <= 0 || N <= 0) return 0;
    int failed = 0;
    if (simd == 3 && w_kind == W_BF16) {
        TEAM_RUN(threads, M * N * K > (1 << 16),
                 if (float_part(x, ROWS_DOT, M, K, w, w_kind, N, bias, y, y_bf16, simd, tm)) team_fail(&failed));
        return failed ? -3 : 0;
    }
    const int tiles = simd == 4 && w_kind == W_BF16;
    if (tiles && M <= 16) {  /* one row tile: each thread makes its own, and the team never meets */
        TEAM_RUN(threads, M * N * K > (1 << 16), {
            uint32_t *xs = grow_scratch(&tl_tiles, &tl_tiles_size, (size_t)x_tiles_bytes(M, K));
            if (xs) x_tiles(x, M, K, xs, 0, 1);
            if (!xs || float_part(xs, ROWS_TILES, M, K, w, w_kind, N, bias, y, y_bf16, simd, tm))
                team_fail(&failed);
        });
        return failed ? -3 : 0;
    }
    const size_t bytes = tiles ? (size_t)x_tiles_bytes(M, K) : sizeof(float) * (size_t)(M * K);
    /* in a running team thread 0 makes the buffer inside the part */
    void *made = team_joined() ? NULL : grow_scratch(&tl_rows, &tl_rows_size, bytes);
    if (!team_joined() && !made) return -3;
    TEAM_RUN(threads, M * N * K > (1 << 16), {
        void *xs = team_buffer(tm, made, &team_rows, &tl_rows, &tl_rows_size, bytes);
        if (xs && tiles) x_tiles(x, M, K, xs, tm.t, tm.T);
        for (int64_t i = M * K * tm.t / tm.T; xs && !tiles && i < M * K * (tm.t + 1) / tm.T; i++)
            ((float *)xs)[i] = bf16_to_float(x[i]);
        TEAM_SYNC(tm);
        if (!xs || float_part(xs, tiles ? ROWS_TILES : ROWS_FP32, M, K, w, w_kind, N, bias, y, y_bf16, simd, tm))
            team_fail(&failed);
    });
    return failed ? -3 : 0;
}
