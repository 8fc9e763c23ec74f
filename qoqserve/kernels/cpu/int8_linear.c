/* One INT8 linear of the CPU path in a single call: per-token INT8
 * quantization of the input, the INT8 x INT8 -> INT32 GEMM on AVX-512 VNNI
 * (vpdpbusd), and the epilogue to fp32/bf16 while the tile is in registers.
 * At decode sizes the three separate passes (C quantize, torch._int_mm, C
 * epilogue) spent more in per-call setup and memory round trips than in math.
 *
 * vpdpbusd multiplies unsigned by signed bytes. The weight is the unsigned
 * operand, stored once at load as (w + offset): offset 0 for QoQ per-channel
 * codes 0..15, 128 for signed INT8 weights. The offset's share,
 * offset * sum_k x_q[m, k], is subtracted in INT32, so the accumulator is the
 * exact integer the reference computes.
 *
 * Packed weights (int8_linear.py pack_weight): for each block of 16 output
 * channels, one 64-byte unit per 4 input channels: one zmm holds 4
 * consecutive k of 16 consecutive n, the order vpdpbusd sums. Blocks come in
 * tiles of NR (the last may hold fewer, nt) stored interleaved: unit kq of
 * block NR t + i is unit kq nt + i of tile t (weight_layout.py), so a tile's
 * walk reads one sequential stream.
 *
 * Numerics are those of w4a8_ops.c (and so of qoq_ref): the scale divides,
 * rounding is half to even, the epilogue multiplies in the same order, bf16
 * rounds to nearest even; no FMA contraction (compiled with
 * -ffp-contract=off).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NB 16  /* output channels per weight block: one zmm of int32 */
#define NR 4   /* weight blocks per tile: of the layout and of the loops (TILE_BLOCKS) */

typedef struct {
    const int8_t *xq; const float *sa; const int32_t *qsum; int64_t M, Kp, N;
    const uint8_t *w; int offset; const float *s1, *rowsum, *zs1, *bias; void *y; int out_bf16;
} Job;

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>

#define MR 6   /* rows per tile: 24 accumulators + 6 broadcasts + 1 weight vector of 32 zmm */
#define HAVE_INT8 2  /* int8_linear_available(): the VNNI path */

#include "int8_act_avx512.h"
#define QUANTIZE_ROW quantize_row_avx512

/* The accumulators are named registers, not an array: GCC keeps an array of
 * 24 zmm in registers only by copying them around on every iteration. Each
 * guard is a constant at its call site, so unused ones compile away. */
#define FOR_ROWS(X, b) X(0, b) X(1, b) X(2, b) X(3, b) X(4, b) X(5, b)
#define FOR_TILE(X) FOR_ROWS(X, 0) FOR_ROWS(X, 1) FOR_ROWS(X, 2) FOR_ROWS(X, 3)
#define DECLARE(i, b) __m512i a##i##b = _mm512_setzero_si512();
#define DP(i, b) if (i < mr) a##i##b = _mm512_dpbusd_epi32(a##i##b, wb, x##i);
#define BCAST(i) __m512i x##i = _mm512_setzero_si512(); if (i < mr) x##i = broadcast4(x + i * j->Kp + kq * 4);
/* One block's weights at a time: 24 accumulators, 6 broadcasts and 1 weight
 * vector fit the 32 zmm. Left alone, GCC loads all 4 blocks' weights first
 * and spills accumulators; so each block's weight address passes through an
 * empty asm that also takes the previous block's accumulators, which orders
 * the load after that block's products (no instruction is emitted). */
#define AFTER(b) __asm__("" : "+r"(wp), "+v"(a0##b), "+v"(a1##b), "+v"(a2##b), "+v"(a3##b), "+v"(a4##b), \
                         "+v"(a5##b));
#define BLOCK(b, prev) if (b < nr) { \
        const uint8_t *wp = w + kq * step + b * 64; \
        prev \
        _mm_prefetch((const char *)wp + WEIGHT_AHEAD * step, WEIGHT_HINT); \
        const __m512i wb = _mm512_loadu_si512(wp); \
        FOR_ROWS(DP, b) \
    }
#define STORE(i, b) if (i < mr && b < nr) store(j, m0 + i, nb0 + b, a##i##b);
/* Each step requests the line WEIGHT_AHEAD steps on. A tile's steps and
 * the tiles are one sequential stream, so that line is this thread's next
 * but at the end of its range; a prefetch never faults. On AMD cores the
 * request is non-temporal: the weights (the LM head's 28 MB, read once a
 * decode step) then pass through L1 without displacing from L2 and L3 what
 * the next calls read again, which made a batch-1 step faster there than no
 * prefetch or an L2 one. On Intel Xeons a non-temporal line bypasses L2 and
 * L3 both, so the head came from DRAM every step at half the speed: there
 * it goes to L2 (docs/benchmarks.md has both measurements). */
#define WEIGHT_AHEAD 32
#ifdef QOQ_CPU_AMD
#define WEIGHT_HINT _MM_HINT_NTA
#else
#define WEIGHT_HINT _MM_HINT_T1
#endif

static inline __m512i broadcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* epilogue of one row of one weight block, from its INT32 accumulator */
static inline void store(const Job *j, int64_t m, int64_t nb, __m512i acc) {
    const int64_t n0 = nb * NB;
    const __mmask16 k = lane_mask(j->N - n0);
    __m512i a = _mm512_sub_epi32(acc, _mm512_set1_epi32(j->offset * j->qsum[m]));
    char *y = (char *)j->y + (m * j->N + n0) * (j->out_bf16 ? 2 : 4);
    store_epilogue(a, j->sa[m], j->s1 + n0, j->zs1 ? j->zs1 + n0 : NULL, j->rowsum ? j->rowsum[m] : 0.f,
                   j->bias ? j->bias + n0 : NULL, y, j->out_bf16, k);
}

/* rows m0..m0+mr of blocks nb0..nb0+nr; mr, nr are constants at each call site */
static inline __attribute__((always_inline)) void tile(const Job *j, int64_t m0, int64_t nb0,
                                                       const int mr, const int nr) {
    FOR_TILE(DECLARE)
    /* nb0 starts a layout tile of nr blocks (the loop below hands out whole tiles) */
    const int64_t quads = j->Kp / 4, block = quads * 64, step = nr * 64;
    const uint8_t *w = j->w + nb0 * block;
    const int8_t *x = j->xq + m0 * j->Kp;
    for (int64_t kq = 0; kq < quads; kq++) {
        BCAST(0) BCAST(1) BCAST(2) BCAST(3) BCAST(4) BCAST(5)
        BLOCK(0, ) BLOCK(1, AFTER(0)) BLOCK(2, AFTER(1)) BLOCK(3, AFTER(2))
    }
    FOR_TILE(STORE)
}

#define TILE(a, b) case (a) * 8 + (b): tile(j, m0, nb0, a, b); break
#define ROW(a) TILE(a, 1); TILE(a, 2); TILE(a, 3); TILE(a, 4)

static void run_tile(const Job *j, int64_t m0, int64_t nb0, int mr, int nr) {
    switch (mr * 8 + nr) {
        ROW(1); ROW(2); ROW(3); ROW(4); ROW(5); ROW(6);
    }
}

/* Many rows, where the CPU has AMX-INT8 (amx_tiles.h): the packed weight is
 * AMX's B layout as it is (block b's k-quads nr * 64 bytes apart in its
 * layout tile), so the tiles read it in place. */
#include "amx_tiles.h"

#define STORE_AMX(m, b, acc) store(j, m, nb0 + (b), acc)

AMX_FN static void chunk_amx(const Job *j, int64_t nb0, int nr, int32_t *acc) {
    const int64_t Kp = j->Kp, block = Kp / 4 * 64, step = nr * 64;
    const uint8_t *w = j->w + nb0 * block;
    for (int b = 0; b < nr; b += 2)
        for (int64_t m0 = 0; m0 < j->M; m0 += 32)
            AMX_PASS_ANY(j->xq + m0 * Kp, Kp, w + b * 64, step, 64, acc, m0, j->M, b,
                         j->M - m0 <= 16, b + 1 == nr, STORE_AMX);
}

#elif defined(__AVX2__)
#include "int8_linear_avx2.h"  /* the AVX2 path, and no AMX */
#endif

#ifdef HAVE_INT8
/* 2: the AVX-512 VNNI path (and AMX where the CPU has it), 1: AVX2 */
int int8_linear_available(void) { return HAVE_INT8; }

/* 1 where calls of AMX_MIN_ROWS rows or more take the AMX tiles (the CPU has
 * them and QOQSERVE_CPU_ISA does not cap it below) */
int int8_linear_amx(void) { return amx_allowed(); }

#include "team.h"

/* per-thread scratch (thread_scratch.h): the quantized rows, their scales and sums */
static __thread void *tl_act;
static __thread size_t tl_act_size;
static void *volatile team_act;  /* thread 0's, in a running team (team.h) */

typedef struct {
    const void *x; int x_bf16; int64_t K;
    Job job;  /* without its activations */
    uint8_t *act; size_t act_bytes, xq_bytes;
    int amx; int64_t nblocks, chunks;
} Call;

/* Thread tm.t of tm.T: its share of the rows quantized, the team meets,
 * then its share of the column chunks. Nonzero without activations. */
static int int8_part(const Call *c, team_t tm) {
    const int64_t M = c->job.M, K = c->K, Kp = c->job.Kp;
    uint8_t *act = team_buffer(tm, c->act, &team_act, &tl_act, &tl_act_size, c->act_bytes);
    int8_t *xq = (int8_t *)act;
    float *sa = act ? (float *)(act + c->xq_bytes) : NULL;
    int32_t *qsum = act ? (int32_t *)(sa + M) : NULL;
    for (int64_t m = M * tm.t / tm.T; act && m < M * (tm.t + 1) / tm.T; m++)
        QUANTIZE_ROW((const char *)c->x + m * K * (c->x_bf16 ? 2 : 4), c->x_bf16, K, Kp, xq + m * Kp, sa + m,
                     qsum + m);
    TEAM_SYNC(tm);
    if (!act) return 1;
    Job job = c->job;
    job.xq = xq, job.sa = sa, job.qsum = qsum;
    int32_t acc[256] __attribute__((aligned(64)));
    if (c->amx) amx_begin();
    for (int64_t ch = c->chunks * tm.t / tm.T; ch < c->chunks * (tm.t + 1) / tm.T; ch++) {
        const int64_t nb0 = ch * NR, nr = c->nblocks - nb0 < NR ? c->nblocks - nb0 : NR;
        if (c->amx) {
            chunk_amx(&job, nb0, (int)nr, acc);
            continue;
        }
#if HAVE_INT8 == 2
        for (int64_t m0 = 0; m0 < M; m0 += MR)
            run_tile(&job, m0, nb0, M - m0 < MR ? (int)(M - m0) : MR, (int)nr);
#else
        run_chunk(&job, nb0, nr);
#endif
    }
    if (c->amx) amx_end();
    return 0;
}

/* x [M, K] fp32/bf16 -> y [M, N] fp32/bf16:
 *   y = (x_q . w) * s_a[m] * s1[n] (- rowsum[m] * zs1[n]) (+ bias[n])
 * rowsum/zs1 (per-channel zero points) and bias may be NULL.
 * Returns 0, or -1 when the scratch buffers cannot be allocated. */
int int8_linear(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                int offset, const float *s1, const float *rowsum, const float *zs1,
                const float *bias, void *y, int out_bf16, int threads) {
    const int64_t Kp = (K + 3) & ~(int64_t)3, nblocks = (N + NB - 1) / NB;
    /* the cap (getenv) is read only for calls the tiles could take, not per decode row */
    const int amx = amx_rows(1, M, Kp) && amx_allowed();
    /* AMX loads 16 rows a tile: rows past M are allocated, never stored */
    const size_t xq_bytes = ((size_t)((amx ? (M + 15) / 16 * 16 : M) * Kp) + 63) & ~(size_t)63;
    const size_t act_bytes = xq_bytes + 8 * (size_t)M;
    /* in a running team, thread 0 makes the activations inside int8_part */
    uint8_t *act = team_joined() ? NULL : grow_scratch(&tl_act, &tl_act_size, act_bytes);
    if (!team_joined() && !act) return -1;
    const Call call = {x, x_bf16, K, {NULL, NULL, NULL, M, Kp, N, w, offset, s1, rowsum, zs1, bias, y, out_bf16},
                       act, act_bytes, xq_bytes, amx, nblocks, (nblocks + NR - 1) / NR};
    int failed = 0;
    TEAM_RUN(threads, M * N * K > (1 << 18), if (int8_part(&call, tm)) team_fail(&failed));
    return failed ? -1 : 0;
}

#else
int int8_linear_available(void) { return 0; }
int int8_linear_amx(void) { return 0; }
int int8_linear(void) { return -2; }
#endif
