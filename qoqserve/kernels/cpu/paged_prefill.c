/* Paged prefill attention for CPUs, in fp32: the queries of prompt chunks,
 * causal over their sequence's pages (the cached prefix and the chunk itself,
 * which the engine writes into the pages before attending), for every page
 * format that paged_decode.c reads.
 *
 * Flash-style: keys are visited in tiles of TILE (AVX-512: WIDE) positions counted from
 * position 0 of the sequence, whatever page or chunk they fall in; each query
 * row keeps an online softmax (running max m, sum l, unnormalized acc) over
 * the tiles it can see, masking the keys after its own position. A row's
 * arithmetic therefore depends on nothing but its position and the page
 * contents: not on the other queries of its task, on how the prompt was
 * chunked, on the batch or on the thread count. Chunked and whole prefills
 * agree bit for bit by construction, not by rounding fp64 back.
 *
 * Sliding-window attention (window > 0: the query at position p sees
 * positions p - window + 1 .. p): a task starts at the tile of the first
 * position its first query sees, and each row masks the keys before its own
 * window as it masks those after its position. A tile a row sees none of
 * adds exactly nothing to it, so its arithmetic is still a function of its
 * position alone.
 *
 * Logit soft-capping (Gemma 2: softcap > 0): each score s is replaced by
 * softcap tanh(s / softcap) before the online softmax (softcap_log2, kv_rows.h).
 *
 * Task = (sequence, KV head, qblock consecutive queries): each K/V tile is
 * converted to fp32 once per task, for its qblock * G query rows. qblock is
 * QBLOCK, or half of it when a call would hand out too few tasks to keep the
 * threads busy; a row's arithmetic does not depend on its task.
 *
 * Three paths in one library, chosen at run time (kv_path.h): AVX-512
 * (paged_prefill_avx512.h), AVX2 (paged_prefill_avx2.h) and the portable
 * loops below (or when QOQSERVE_CPU_ISA=scalar); on CPUs with AMX-INT8, the
 * queries at positions from AMX_MIN_POS over KV4 pages take integer tiles
 * instead (paged_prefill_amx.h, its own rounding).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "kv_rows.h"

enum { TILE = 16 };    /* key positions per online-softmax step of the AVX2 and portable paths */
enum { WIDE = 48 };    /* of the AVX-512 path: three vectors of scores per row (docs/benchmarks.md, "prefill") */
enum { QBLOCK = 64 };  /* queries per task: enough rows to amortize a tile's conversion */

typedef struct {
    const float *q;  /* [T, H, D] */
    const uint8_t *k, *v;
    int64_t slot_stride, head_stride;
    const int64_t *tables, *q_starts, *first_pos;
    float *out;      /* [T, H, D] */
    int fmt, S, H, Hkv, G, D, bs, width, qblock;
    int window;      /* positions a query sees (sliding-window attention); 0: all before it */
    float qscale;    /* sm_scale * log2(e): scores in log2 units, softmax by exp2 */
    float cap2;      /* soft-capping: the cap in log2 units (softcap * log2 e); 0: none */
} pjob;

/* byte offset of the row of (sequence s, position p, KV head h) */
static inline int64_t row_at(const pjob *j, int s, int64_t p, int h) {
    const int64_t slot = j->tables[(int64_t)s * j->width + p / j->bs] * j->bs + p % j->bs;
    return slot * j->slot_stride + (int64_t)h * j->head_stride;
}

/* the first key tile (of `tile` positions, counted from position 0) that a
 * query at position pos0 or later sees */
static inline int64_t first_tile(const pjob *j, int64_t pos0, int tile) {
    const int64_t lo = j->window > 0 ? pos0 - j->window + 1 : 0;
    return lo > 0 ? lo / tile * tile : 0;
}

/* the keys before tile k0's position `before` that a row at position p does
 * not see: before its window */
static inline int64_t keys_before_window(const pjob *j, int64_t p, int64_t k0) {
    const int64_t lo = j->window > 0 ? p - j->window + 1 - k0 : 0;
    return lo > 0 ? lo : 0;
}

/* floats of per-thread scratch (any path): rows padded to 32 channels and
 * 8 spare rows, so the vector paths can always work on blocks of 8; a key
 * tile's weights for every row (the AVX-512 path's) */
static inline int64_t scratch_floats(const pjob *j) {
    const int64_t np = (j->D + 31) / 32 * 32, rows = (int64_t)j->qblock * j->G + 8;
    return rows * (2 * np + TILE + 1 + WIDE) + 3 * WIDE * np + 32;
}

#include "paged_prefill_avx512.h"  /* defines task_avx512() where it can */
#include "paged_prefill_amx.h"     /* task_amx() for KV4 pages, where it can (PP_AMX) */
#include "paged_prefill_avx2.h"    /* task_avx2() */
#include "kv_path.h"

/* ---- the portable path ------------------------------------------------------ */

PORTABLE_CLONES static void task_scalar(const pjob *j, int s, int h, int t0, int t1, float *buf) {
    const int D = j->D, G = j->G, R = (t1 - t0) * G;
    float *q = buf, *acc = q + (int64_t)R * D, *m = acc + (int64_t)R * D, *l = m + R;
    float *kr = l + R, *vr = kr + TILE * D;
    const int64_t base = j->q_starts[s], pos0 = j->first_pos[s] + t0, last = j->first_pos[s] + t1 - 1;
    for (int r = 0; r < R; r++) {
        const float *src = j->q + ((base + t0 + r / G) * j->H + h * G + r % G) * D;
        for (int d = 0; d < D; d++) q[r * D + d] = src[d] * j->qscale;
        m[r] = -INFINITY;
        l[r] = 0.f;
    }
    memset(acc, 0, sizeof(float) * (size_t)R * D);
    for (int64_t k0 = first_tile(j, pos0, TILE); k0 <= last; k0 += TILE) {
        const int n = (int)(last + 1 - k0 < TILE ? last + 1 - k0 : TILE);
        for (int i = 0; i < n; i++) {
            const int64_t off = row_at(j, s, k0 + i, h);
            row_scalar(j->k + off, j->fmt, D, kr + i * D);
            row_scalar(j->v + off, j->fmt, D, vr + i * D);
        }
        const int64_t first = k0 > pos0 ? k0 - pos0 : 0;  /* the first query that sees this tile */
        for (int r = (int)first * G; r < R; r++) {  /* keys after the row's own position are not seen */
            const int64_t p = pos0 + r / G;
            const int nv = (int)(p - k0 + 1 < n ? p - k0 + 1 : n), lo = (int)keys_before_window(j, p, k0);
            if (lo < nv)
                softmax_step_scalar(q + (int64_t)r * D, kr + (int64_t)lo * D, vr + (int64_t)lo * D, nv - lo, D, m + r,
                                    l + r, acc + (int64_t)r * D, j->cap2);
        }
    }
    for (int r = 0; r < R; r++) {
        float *o = j->out + ((base + t0 + r / G) * j->H + h * G + r % G) * D;
        for (int d = 0; d < D; d++) o[d] = acc[(int64_t)r * D + d] / l[r];
    }
}

/* Which path paged_prefill_attention takes now: 512 (AVX-512), 256 (AVX2) or 0 (scalar). */
int paged_prefill_isa(void) {
    static const int widths[] = {0, 256, 512};
    return widths[kv_vector_path()];
}

/* The first query position that takes the AMX tiles now, for this page
 * format and head_dim, or -1 where none does. */
int paged_prefill_amx(int fmt, int D) {
#ifdef PP_AMX
    return prefill_amx(fmt, D) ? AMX_MIN_POS : -1;
#else
    (void)fmt, (void)D;
    return -1;
#endif
}

/* q, out: float [T, H, D], the queries of S sequences back to back: sequence s
 * owns rows q_starts[s] .. q_starts[s + 1] - 1, the first at position
 * first_pos[s] (its cached prefix length); query i of it attends to positions
 * 0 .. first_pos[s] + i, or with window > 0 to the last `window` of them;
 * softcap > 0: its scores soft-capped at it. Rows as in paged_decode_attention:
 * K of (slot, head) at k + slot * slot_stride + head * head_stride bytes, V at
 * v + the same, slot = tables[s][p / bs] * bs + p % bs. Returns 0, or -1 if
 * out of memory. */
int paged_prefill_attention(const float *q, const uint8_t *k, const uint8_t *v, int64_t slot_stride,
                            int64_t head_stride, int fmt, const int64_t *tables, const int64_t *q_starts,
                            const int64_t *first_pos, float *out, int S, int H, int Hkv, int D, int bs,
                            int width, float sm_scale, int window, float softcap, int threads) {
    pjob j = {q, k, v, slot_stride, head_stride, tables, q_starts, first_pos, out, fmt, S, H, Hkv, H / Hkv,
              D, bs, width, QBLOCK, window > 0 ? window : 0, sm_scale * 1.4426950408889634f,
              softcap > 0.f ? softcap * 1.4426950408889634f : 0.f};
    int64_t ntasks = 0;
    for (;;) {  /* at least 4 tasks a thread where the prompts allow, for the dynamic schedule to even out */
        ntasks = 0;
        for (int s = 0; s < S; s++) ntasks += (q_starts[s + 1] - q_starts[s] + j.qblock - 1) / j.qblock * Hkv;
        if (ntasks >= 4 * (int64_t)threads || j.qblock <= QBLOCK / 4) break;
        j.qblock /= 2;
    }
    int32_t *tasks = malloc(sizeof(int32_t) * 3 * (size_t)(ntasks + 1));
    if (!tasks) return -1;
    int64_t n = 0;
    for (int s = 0; s < S; s++) {  /* the last blocks of a prompt see the most keys: hand them out first */
        const int blocks = (int)((q_starts[s + 1] - q_starts[s] + j.qblock - 1) / j.qblock);
        for (int b = blocks - 1; b >= 0; b--)
            for (int h = 0; h < Hkv; h++, n++) {
                tasks[3 * n] = s;
                tasks[3 * n + 1] = h;
                tasks[3 * n + 2] = b;
            }
    }
    const int vec = kv_vector_path(), amx = paged_prefill_amx(fmt, D) >= 0;
    int64_t floats = scratch_floats(&j);
#ifdef PP_AMX
    if (amx && amx_scratch_floats(&j) > floats) floats = amx_scratch_floats(&j);
#endif
    int failed = 0;
    #pragma omp parallel num_threads(threads)
    {
    float *scratch = calloc((size_t)floats + 16, sizeof(float));
    float *buf = scratch ? (float *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63) : NULL;  /* 64-byte rows */
    if (!scratch) {
        #pragma omp atomic write
        failed = 1;
    }
    #pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < ntasks; t++) {
        if (!buf) continue;
        const int s = tasks[3 * t], h = tasks[3 * t + 1], t0 = tasks[3 * t + 2] * j.qblock;
        const int len = (int)(q_starts[s + 1] - q_starts[s]), t1 = t0 + j.qblock < len ? t0 + j.qblock : len;
#ifdef PP_AMX
        if (amx) {  /* by position: a row's arithmetic stays a function of its position and the pages */
            const int64_t cut = AMX_MIN_POS - first_pos[s];
            const int mid = cut <= t0 ? t0 : cut >= t1 ? t1 : (int)cut;
            if (mid > t0) task_avx512(&j, s, h, t0, mid, buf);
            if (mid < t1) task_amx(&j, s, h, mid, t1, buf);
            continue;
        }
#endif
#ifdef KV_AVX512
        if (vec == KV_PATH_AVX512) { task_avx512(&j, s, h, t0, t1, buf); continue; }
#endif
#ifdef KV_AVX2
        if (vec == KV_PATH_AVX2) { task_avx2(&j, s, h, t0, t1, buf); continue; }
#endif
        task_scalar(&j, s, h, t0, t1, buf);
    }
    free(scratch);
    }
    free(tasks);
    (void)vec, (void)amx;
    return failed ? -1 : 0;
}
