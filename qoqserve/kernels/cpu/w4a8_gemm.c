/* The QoQ W4A8 linear on CPU with the weights kept 4-bit: per-token INT8
 * quantization of the input, the GEMM whose main loop loads the UINT4 codes
 * packed and unpacks them in registers, and the fp32/bf16 epilogue, in one
 * call. Numerics are those of int8_linear.c (and so of qoq_ref) bit for bit:
 * the same activation quantizer, the same exact INT32 accumulator, the same
 * epilogue in the same order; no FMA contraction (-ffp-contract=off).
 *
 * Layout (w4a8_gemm.py repacks it once at load from the checkpoint's
 * [N, K/2] bytes), Kp = K rounded up to 8, zero codes in the padding. Output
 * channels come in blocks of 16 (block b: channels 16b..16b+15), blocks in
 * tiles of NR = 4 (the last tile may hold fewer, nt), and a tile's blocks
 * are interleaved, so that the kernel's walk over one tile, and so over a
 * thread's whole range, is one sequential stream (weight_layout.py):
 *   codes  uint8, 64-byte units: unit (p, b) of block b = NR t + i is unit
 *          p nt + i of tile t, tiles back to back (Kp/8 * nt units each).
 *          Byte 4c + r of unit (p, b) holds u[16b + c, 8p + r] in its low
 *          nibble and u[16b + c, 8p + 4 + r] in its high nibble (c < 16,
 *          r < 4). So one 64-byte load gives, by one and (low) and one shift
 *          + and (high), the two vpdpbusd weight operands of input channels
 *          8p..8p+3 and 8p+4..8p+7: 4 consecutive k of 16 consecutive n, the
 *          order vpdpbusd sums.
 *   groups uint8 (group configs only), 16-byte units tiled the same way:
 *          unit (group gi, block b) is unit gi nt + i of tile t; byte c is
 *          channel 16b + c's (s2 - 1) << 4 | z. s2 is 1..16 wherever
 *          s2*(u - z) fits INT8 for every code, so 1 byte per group instead
 *          of the checkpoint's 2 (g32: 0.53 instead of 0.56 byte/weight).
 *
 * Per group the codes are expanded in registers to the unsigned operand
 * s2*(u - z) + 128: vpmullw by s2 gives u*s2 in each byte (u*s2 <= 240, so no
 * carry crosses a byte), vpsubb of c = (s2*z - 128) mod 256, made per group,
 * then wraps to s2*(u - z) + 128, which is
 * in 0..255 because s2*(u - z) fits INT8 (checked at load). The +128 is
 * removed in INT32 as 128 * sum_k x_q, as in int8_linear.c. Per channel the
 * codes u are the unsigned operand as they are and the zero point is removed
 * in the epilogue: y = s_a*s1*(x_q . u) - (z*s1)*rowsum(x).
 *
 * One or two rows (decode) take another loop for group layouts: the raw codes
 * u are vpdpbusd's unsigned operand, and per group and channel the integer
 * s2 * (x_q . u - z * sum(x_q)) joins the accumulator (tile_codes): the same
 * INT32 as the expanded operand gives, for half the multiplies per code.
 *
 * With more rows than one tile holds, the first row tile also stores the
 * expanded operand of its 64 columns to a per-thread panel (64*Kp bytes) that
 * the later row tiles read, so the codes are unpacked once per call.
 *
 * The AVX-512 (F/BW/VL/VNNI, w4a8_gemm_avx512.h) and AVX2 (w4a8_gemm_avx2.h) code is compiled by
 * target attributes and chosen at run time (w4a8_gemm_simd); the scalar code (w4a8_gemm_scalar.h)
 * beside it runs anywhere.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define NB 16  /* output channels per weight block: one zmm of int32 */
#define NR 4   /* weight blocks per tile: of the layout and of the SIMD loops (TILE_BLOCKS in weight_layout.py) */
#define MR 6   /* rows per tile: 24 accumulators of the 32 zmm */
/* Rows of the tile that unpacks the codes when more tiles follow: beside its
 * accumulators it keeps each block's s2 and zero-point vectors (8 zmm), and
 * at 6 rows GCC spills accumulators to the stack in the inner loop; 4 rows
 * fit (docs/benchmarks.md, "The W4A8 GEMM's first row tile"). */
#define PACKED_MR 4
/* The SIMD loops that read the packed codes use each code byte for only a
 * few rows' products, so they ask for lines faster than the hardware
 * prefetchers bring them in: each step requests into L2 the line of the unit
 * CODES_AHEAD steps on. The codes are one sequential stream (layout tiles
 * back to back), so that is a line this thread reads next unless its range
 * ends first; a prefetch past the array never faults. */
#define CODES_AHEAD 32

typedef struct {
    const int8_t *xq; const float *sa; const int32_t *qsum; int64_t M, Kp, N;
    const uint8_t *w, *gp; int64_t group;  /* gp NULL and group 0: per channel */
    const float *s1, *rowsum, *zs1, *bias; void *y; int out_bf16;
    int silu;  /* y_silu: y [M, N/2] = silu(gate) * up of each (gate, up) pair of blocks */
    const int32_t *gsum;  /* AVX2 with groups: sum of x_q over each (row, group), [M][K / group] */
} Job;

#include "bf16.h"
#include "int8_round.h"
#include "team.h"
#include "thread_scratch.h"
#include "silu_mul_row.h"
#include "norm_row.h"

/* Where block nb's first unit sits in a tiled array of `units` units of
 * `unit` bytes per block (layout above), and the byte step from one of its
 * units to the next: the blocks nb.. of its tile sit `unit` bytes apart. */
static inline const uint8_t *tiled(const uint8_t *base, const Job *j, int64_t nb, int64_t units, int64_t unit,
                                   int64_t *step) {
    const int64_t t0 = nb / NR * NR, left = (j->N + NB - 1) / NB - t0;
    *step = (left < NR ? left : NR) * unit;
    return base + t0 * units * unit + (nb - t0) * unit;
}

#include "w4a8_gemm_scalar.h"  /* the scalar path */

/* ---------------------------------------------------------- AVX-512 VNNI */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_SIMD 1
#include <immintrin.h>

#define SIMD __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

#define AVX512_FN SIMD
#include "int8_act_avx512.h"

#include "w4a8_gemm_avx512.h"

static int simd_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

#include "w4a8_gemm_avx2.h"
#else
#define HAVE_SIMD 0
static int simd_supported(void) { return 0; }
static int avx2_supported(void) { return 0; }
static int amx_supported(void) { return 0; }
static inline int amx_rows(int amx, int64_t M, int64_t Kp) { (void)amx; (void)M; (void)Kp; return 0; }
#endif

/* The best path this CPU runs, as the simd argument: 3 AMX-INT8 (and the
 * AVX-512 VNNI loops), 2 AVX-512 VNNI, 1 AVX2, 0 the scalar code */
int w4a8_gemm_simd(void) { return simd_supported() ? 2 + amx_supported() : avx2_supported(); }

/* per-thread scratch (thread_scratch.h): activations (the caller's, or each
 * thread's own rows), panel, made row */
static __thread void *tl_main, *tl_own, *tl_panel, *tl_row;
static __thread size_t tl_main_size, tl_own_size, tl_panel_size, tl_row_size;

/* Calls of up to OWN_ROWS rows (decode) skip the barrier between making the
 * quantized rows and the blocks: every thread makes all of them for itself
 * (a few hundred ns a row, less than a barrier costs), and X_NORM's update of
 * h is written by the calling thread after the threads are done reading it. */
enum { OWN_ROWS = 2 };

enum { X_PLAIN = 0, X_SILU = 1, X_NORM = 2 };

typedef struct {
    const void *x; int x_bf16, x_mode; const void *delta; float eps; int64_t K, Kp;
    int simd, avx2; int64_t groups, group;
} RowPrep;

/* input row m, made (x_mode) in row[] and quantized into xq, sa, qsum (and
 * AVX2's group sums); store: X_NORM writes h + delta back to h */
static void make_row(const RowPrep *p, int64_t m, float *row, int store, int8_t *xq, float *sa, int32_t *qsum,
                     int32_t *gsum) {
    const int64_t K = p->K, Kp = p->Kp;
    const size_t es = p->x_bf16 ? 2 : 4;
    const void *xm = (const char *)p->x + (size_t)(m * K * (p->x_mode == X_SILU ? 2 : 1)) * es;
    int bf16 = p->x_bf16;
    if (p->x_mode) {  /* bf16 rows come out bf16-valued in fp32: quantize them as fp32 */
#if HAVE_SIMD
        if (p->simd && p->x_mode == X_SILU) silu_mul_row_simd(xm, (const char *)xm + (size_t)K * es, bf16, K, row);
        else if (p->simd) add_norm_row_simd((void *)p->x, p->delta, row + K, m, K, p->eps, bf16, row, store);
        else
#endif
        if (p->x_mode == X_SILU) silu_mul_row(xm, (const char *)xm + (size_t)K * es, bf16, K, row);
        else add_norm_row((void *)p->x, p->delta, row + K, m, K, p->eps, bf16, row, store);
        xm = row;
        bf16 = 0;
    }
#if HAVE_SIMD
    if (p->simd) { quantize_row_avx512(xm, bf16, K, Kp, xq + m * Kp, sa + m, qsum + m); return; }
    if (p->avx2) {  /* the group sums once per row, not once per row and channel block */
        quantize_row_avx2(xm, bf16, K, Kp, xq + m * Kp, sa + m, qsum + m);
        for (int64_t gi = 0; gi < p->groups; gi++)
            gsum[m * p->groups + gi] = sum_i8_avx2(xq + m * Kp + gi * p->group, p->group);
        return;
    }
#endif
    quantize_row_scalar(xm, bf16, K, Kp, xq + m * Kp, sa + m, qsum + m);
}

typedef struct {
    RowPrep prep;
    const void *norm_w;
    Job job;  /* without its activations: each part points them at its scratch */
    uint8_t *main_buf;
    int own, amx;
    size_t xq_bytes, act_bytes, panel_bytes;
    int64_t nblocks;
} Call;

static void *volatile team_main;  /* thread 0's activations, in a running team (team.h) */

/* Thread tm.t of tm.T: the quantized rows (all of them for itself with own
 * rows, else its share, then the team meets), then its range of blocks.
 * Nonzero when this thread's scratch could not be had. */
static int gemm_part(const Call *c, team_t tm) {
    const RowPrep *p = &c->prep;
    const int64_t M = c->job.M, K = p->K;
    /* the made row, and for X_NORM the norm weight as fp32 after it */
    float *row = p->x_mode ? (float *)grow_scratch(&tl_row, &tl_row_size,
                                                   sizeof(float) * (size_t)K * (p->x_mode == X_NORM ? 2 : 1)) : NULL;
    uint8_t *act = c->own ? grow_scratch(&tl_own, &tl_own_size, c->act_bytes)
                          : team_buffer(tm, c->main_buf, &team_main, &tl_main, &tl_main_size, c->act_bytes);
    const int ready = act && (row || !p->x_mode);  /* this thread has its scratch */
    if (p->x_mode == X_NORM && row) load_row(c->norm_w, p->x_bf16, 0, K, row + K);
    int8_t *xq = act ? (int8_t *)act : NULL;
    float *sa = act ? (float *)(act + c->xq_bytes) : NULL;
    int32_t *qsum = act ? (int32_t *)(sa + M) : NULL, *gsum = act && p->groups ? qsum + M : NULL;
    if (c->own) {
        for (int64_t m = 0; ready && m < M; m++) make_row(p, m, row, 0, xq, sa, qsum, gsum);
    } else {
        for (int64_t m = M * tm.t / tm.T; ready && m < M * (tm.t + 1) / tm.T; m++)
            make_row(p, m, row, 1, xq, sa, qsum, gsum);
        TEAM_SYNC(tm);
    }
    Job job = c->job;
    job.xq = xq, job.sa = sa, job.qsum = qsum, job.gsum = gsum;
    uint8_t *mine = c->panel_bytes ? grow_scratch(&tl_panel, &tl_panel_size, c->panel_bytes) : NULL;
    const int ok = ready && (!c->panel_bytes || mine);
    if (ok) {
        /* contiguous, balanced ranges of blocks: one block finer than the tile
         * (y_silu: one pair, so that no pair is split between threads) */
        const int64_t unit = c->job.silu ? 2 : 1, units = c->nblocks / unit;
        const int64_t lo = unit * (units * tm.t / tm.T), hi = unit * (units * (tm.t + 1) / tm.T);
#if HAVE_SIMD
        if (c->amx) blocks_amx(&job, lo, hi, mine);
        else if (p->simd) blocks_simd(&job, lo, hi, mine);
        else if (p->avx2) blocks_avx2(&job, lo, hi);
        else
#endif
            blocks_scalar(&job, lo, hi, (int8_t *)mine);
    }
    /* own rows in a running team: X_NORM's h += delta once every thread has read h */
    if (c->own && p->x_mode == X_NORM && p->delta && tm.joined) {
        TEAM_SYNC(tm);
        if (tm.t == 0 && row)
            for (int64_t m = 0; m < M; m++) add_row((void *)p->x, p->delta, m, K, p->x_bf16, row, 1);
    }
    return !ok;
}

/* x [M, K] fp32/bf16 -> y [M, N] fp32/bf16 on packed codes (layout above).
 * The input row is x's row (x_mode 0), or made from x and only quantized,
 * never written out, rounded as the standalone op rounds it:
 *   x_mode 1 (X_SILU): x is [M, 2K], gate | up; the row is silu(gate) * up
 *            (silu_mul_row.h);
 *   x_mode 2 (X_NORM): x is the residual stream h [M, K]; h += delta in
 *            place (delta [M, K], or NULL: no add), the row is
 *            rms_norm(h) * norm_w with eps (norm_row.h); norm_w [K] in x's dtype.
 *   y = (x_q . w) * s_a[m] * s1[n] (- rowsum[m] * zs1[n]) (+ bias[n]),
 * w = s2*(u - z) per group (gp != NULL; group % 8 == 0, K % group == 0) or u
 * (per channel: gp NULL, group 0). rowsum/zs1 and bias may be NULL.
 * y_silu: the N channels come as (gate, up) pairs of 16-channel blocks (block
 * 2p: gate channels 16p.., block 2p + 1: the up channels of the same p; N a
 * multiple of 32), and y [M, N/2] gets silu(gate) * up of each pair, rounded
 * as silu_mul_row.h rounds the pair y would otherwise hold: a gate_up linear
 * and the SiLU * mul after it in one call (every path but AVX2).
 * simd: 0 the scalar code, 1 AVX2, 2 AVX-512 VNNI, 3 also AMX-INT8 for calls
 * of AMX_MIN_ROWS rows or more (the same numbers on every path).
 * Returns 0; -1: out of memory; -2: SIMD asked for where it cannot run (or
 * y_silu on AVX2); -3: a group size, K or N the layout does not allow; -4: an
 * unknown x_mode. */
int w4a8_gemm(const void *x, int x_bf16, int x_mode, const void *delta, const void *norm_w, float eps,
              int64_t M, int64_t K, const uint8_t *w, const uint8_t *gp,
              int64_t group, int64_t N, const float *s1, const float *rowsum, const float *zs1,
              const float *bias, void *y, int out_bf16, int y_silu, int simd, int threads) {
    if (simd < 0 || simd > w4a8_gemm_simd() || (y_silu && simd == 1)) return -2;
    const int avx2 = simd == 1;
    simd = simd > 1 ? simd - 1 : 0;  /* below: 1 the VNNI loops, 2 also AMX */
    if ((gp != NULL) != (group > 0) || (group && (group % 8 || K % group)) || (y_silu && N % (2 * NB))) return -3;
    if (x_mode < X_PLAIN || x_mode > X_NORM || (x_mode == X_NORM && !norm_w)) return -4;
    if (M <= 0 || N <= 0) return 0;  /* nothing to write (an empty batch) */
    const int64_t Kp = (K + 7) & ~(int64_t)7, nblocks = (N + NB - 1) / NB;
    const int amx = amx_rows(simd > 1, M, Kp);
    const int own = M <= OWN_ROWS && !amx;
    /* AMX loads 16 rows a tile: rows past M are allocated, never stored */
    const int64_t rows = amx ? (M + 15) / 16 * 16 : M;
    const size_t xq_bytes = ((size_t)(rows * Kp) + 63) & ~(size_t)63;
    const int64_t groups = avx2 && group ? K / group : 0;
    const size_t act_bytes = xq_bytes + 8 * (size_t)M + 4 * (size_t)(M * groups);
    /* in a running team, thread 0 makes the shared activations inside gemm_part */
    uint8_t *main_buf = own || team_joined() ? NULL : grow_scratch(&tl_main, &tl_main_size, act_bytes);
    if (!own && !team_joined() && !main_buf) return -1;
    /* the SIMD panel holds NR blocks of 16 channels x Kp, needed only past one
     * row tile; the scalar path keeps one channel's Kp weights (y_silu: a pair's) */
    const size_t panel_bytes = simd ? (M > MR || amx ? (size_t)(NR * NB * Kp) : 0) : avx2 ? 0 : (size_t)(2 * Kp);
    const Call call = {{x, x_bf16, x_mode, delta, eps, K, Kp, simd, avx2, groups, group}, norm_w,
                       {NULL, NULL, NULL, M, Kp, N, w, gp, group, s1, rowsum, zs1, bias, y, out_bf16, y_silu != 0,
                        NULL},
                       main_buf, own, amx, xq_bytes, act_bytes, panel_bytes, nblocks};
    int failed = 0;
    TEAM_RUN(threads, M * N * K > (1 << 18), if (gemm_part(&call, tm)) team_fail(&failed));
    if (failed) return -1;
    if (own && x_mode == X_NORM && delta && !team_joined())  /* every thread has read h: now h += delta */
        for (int64_t m = 0; m < M; m++) add_row((void *)x, delta, m, K, x_bf16, (float *)tl_row, 1);
    return 0;
}
