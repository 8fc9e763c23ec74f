/* Paged decode attention for CPUs: one query per sequence over its pages,
 * for every page format of qoqserve/layers/kv_cache.py: KV4 (UINT4 codes +
 * fp16 scale and zero per row), KV8 (INT8 codes + fp16 scale) and dense
 * fp16/bf16/fp32. One kernel for all formats, so precisions are compared on
 * equal footing.
 *
 * Three paths in one library, chosen at run time (kv_path.h): AVX-512
 * (paged_decode_avx512.h, compiled for that target whatever the build flags)
 * when the CPU has it, AVX2 (paged_decode_avx2.h, the same passes at half the
 * width) on CPUs below it, and the portable loops below otherwise or when
 * QOQSERVE_CPU_ISA=scalar.
 * Within the AVX-512 path, KV4 scores are integer dot products where the CPU
 * has VNNI (paged_decode_vnni.h; QOQSERVE_CPU_ISA=avx512 keeps them fp32).
 *
 * Work split: a sequence is cut into chunks of whole pages (CHUNK_TOKENS, a
 * constant: never derived from the batch or the thread count); one task is
 * one (sequence, chunk), all its KV heads page by page (a KV4 row is 36 bytes,
 * so the heads of one token share cache lines). Each query head keeps an
 * online softmax (running max m, sum l, unnormalized acc) over blocks of
 * BLOCK tokens; the chunks of a sequence are merged in chunk order at the
 * end. Every sum runs in a fixed order, so a sequence's result does not
 * depend on what else is in the batch nor on the thread count.
 *
 * Scores are kept in log2 units (q is scaled by sm_scale * log2 e once), so
 * the softmax is exp2 of the score minus the max.
 *
 * Sliding-window attention (window > 0: the query at position L - 1 sees the
 * last `window` positions, L - window .. L - 1, as transformers and llama.cpp
 * define it): the chunks start at the page of the first position it sees, and
 * the positions before it in that page are scored -inf, so they weigh exactly
 * 0 and a page outside the window is never read.
 *
 * Logit soft-capping (Gemma 2: softcap > 0): each score s becomes
 * softcap tanh(s / softcap) before the softmax (softcap_log2, kv_rows.h).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "kv_rows.h"
#include "team.h"
#include "thread_scratch.h"

enum { BLOCK = 16 };          /* tokens scored at once: one AVX-512 vector of scores */
enum { CHUNK_TOKENS = 256 };  /* enough chunks for 2+ threads at batch 1, few merges */

typedef struct {
    const float *q;
    const uint8_t *k, *v;
    int64_t slot_stride, head_stride;
    const int64_t *tables, *lens;
    int fmt, B, H, Hkv, G, D, bs, width, chunk_pages, max_chunks;
    int window;    /* positions a query sees (sliding-window attention); 0: all of them */
    float qscale;  /* sm_scale * log2(e) */
    float cap2;    /* soft-capping: the cap in log2 units (softcap * log2 e); 0: none */
    int kv4_vnni;  /* KV4 scores by integer dot products (paged_decode_vnni.h) */
    float *part;   /* per (sequence, chunk, query head): m, l, acc[D] in channel order */
    float *out;    /* [B, H, D]; the vector path writes a one-chunk sequence's rows itself */
    size_t part_bytes;
    int h_lo, h_hi;  /* the KV heads a task computes: all of them, but where one task is split (decode_part) */
} job;

static inline float *partial(const job *j, int b, int c, int hq) {
    return j->part + (((int64_t)b * j->max_chunks + c) * j->H + hq) * (j->D + 2);
}

/* the first position sequence b's query sees, and the page it is on */
static inline int64_t first_token(const job *j, int b) {
    return j->window > 0 && j->lens[b] > j->window ? j->lens[b] - j->window : 0;
}
static inline int64_t first_page(const job *j, int b) { return first_token(j, b) / j->bs; }

/* the pages sequence b reads: from first_page to its last */
static inline int64_t pages_of(const job *j, int b) { return (j->lens[b] + j->bs - 1) / j->bs - first_page(j, b); }

static inline int chunks_of(const job *j, int b) {
    return (int)((pages_of(j, b) + j->chunk_pages - 1) / j->chunk_pages);
}

/* the pages of (sequence b, chunk c): indices p0 (chunk_first) .. chunk_end - 1 of its table */
static inline int64_t chunk_first(const job *j, int b, int c) { return first_page(j, b) + (int64_t)c * j->chunk_pages; }
static inline int64_t chunk_end(const job *j, int b, int c) {
    const int64_t end = chunk_first(j, b, c) + j->chunk_pages, pages = (j->lens[b] + j->bs - 1) / j->bs;
    return end < pages ? end : pages;
}

/* Between the K pass and the softmax of the vector paths: the T scores of
 * each query head soft-capped (where the model caps them), then those of
 * chunk c's positions before the window (only ever in its first page, of
 * chunk 0) set to -inf: their weights are then exactly 0. sc: the chunk's
 * scores, ct apart per query head. Inlined so that the caller's target
 * vectorizes the capping loop. */
static inline __attribute__((always_inline)) void finish_scores(const job *j, int b, int c, float *sc, int ct,
                                                                int T) {
    for (int hq = j->h_lo * j->G; j->cap2 > 0.f && hq < j->h_hi * j->G; hq++)
        for (int t = 0; t < T; t++) sc[(int64_t)hq * ct + t] = softcap_log2(sc[(int64_t)hq * ct + t], j->cap2);
    const int64_t lo = first_token(j, b) - chunk_first(j, b, c) * j->bs;
    for (int hq = j->h_lo * j->G; lo > 0 && hq < j->h_hi * j->G; hq++)
        for (int64_t t = 0; t < lo; t++) sc[(int64_t)hq * ct + t] = -INFINITY;
}

/* whether merge() makes sequence b's output: on the vector path a sequence
 * of one chunk is written by its task (chunk_impl) */
static inline int merged_apart(const job *j, int b, int vec) { return !vec || chunks_of(j, b) != 1; }

/* tokens of a full chunk, rounded up to whole blocks */
static inline int chunk_tokens(const job *j) { return (j->chunk_pages * j->bs + BLOCK - 1) / BLOCK * BLOCK; }

/* floats of per-thread scratch (either path); the vector path pads rows to 32 channels */
static inline int64_t scratch_floats(const job *j) {
    const int64_t np = (j->D + 31) / 32 * 32;
    return 2 * (int64_t)j->H * np + 2 * BLOCK * np + BLOCK + (int64_t)j->H * (chunk_tokens(j) + BLOCK + 1) +
           (int64_t)j->G * BLOCK + 2 * (int64_t)j->H + 2 * (int64_t)j->Hkv * chunk_tokens(j) + 48;
}

#include "paged_decode_avx512.h"  /* defines PD_AVX512 and chunk_avx512() where it can */
#include "paged_decode_avx2.h"    /* PD_AVX2 and chunk_avx2() */
#include "kv_path.h"

/* ---- the portable path ------------------------------------------------------ */

PORTABLE_CLONES static void chunk_scalar(const job *j, int b, int c, float *s) {
    const int D = j->D, G = j->G, H = j->H, bs = j->bs;
    float *q = s, *acc = q + (int64_t)H * D, *kr = acc + (int64_t)H * D, *vr = kr + BLOCK * D;
    float *m = vr + BLOCK * D, *l = m + H;
    for (int hq = j->h_lo * G; hq < j->h_hi * G; hq++) {
        for (int d = 0; d < D; d++) q[hq * D + d] = j->q[((int64_t)b * H + hq) * D + d] * j->qscale;
        m[hq] = -INFINITY;
        l[hq] = 0.f;
    }
    memset(acc, 0, sizeof(float) * (size_t)H * D);
    const int64_t L = j->lens[b], *table = j->tables + (int64_t)b * j->width;
    const int64_t p0 = chunk_first(j, b, c), p1 = chunk_end(j, b, c), lo = first_token(j, b);
    for (int64_t p = p0; p < p1; p++) {
        const int64_t base = table[p] * bs * j->slot_stride;
        const int ntok = (int)(L - p * bs < bs ? L - p * bs : bs);
        const int skip = (int)(lo > p * bs ? lo - p * bs : 0);  /* positions before the window */
        for (int h = j->h_lo; h < j->h_hi; h++) {
            const uint8_t *kh = j->k + base + h * j->head_stride, *vh = j->v + base + h * j->head_stride;
            for (int t0 = skip; t0 < ntok; t0 += BLOCK) {
                const int n = ntok - t0 < BLOCK ? ntok - t0 : BLOCK;
                for (int i = 0; i < n; i++) {
                    row_scalar(kh + (t0 + i) * j->slot_stride, j->fmt, D, kr + i * D);
                    row_scalar(vh + (t0 + i) * j->slot_stride, j->fmt, D, vr + i * D);
                }
                for (int g = 0; g < G; g++) {
                    const int hq = h * G + g;
                    softmax_step_scalar(q + hq * D, kr, vr, n, D, m + hq, l + hq, acc + hq * D, j->cap2);
                }
            }
        }
    }
    for (int hq = j->h_lo * G; hq < j->h_hi * G; hq++) {
        float *pr = partial(j, b, c, hq);
        pr[0] = m[hq];
        pr[1] = l[hq];
        memcpy(pr + 2, acc + hq * D, sizeof(float) * (size_t)D);
    }
}

/* the chunks of (sequence b, query head hq), in chunk order -> out[D] */
static void merge(const job *j, int b, int hq, float *out) {
    const int nc = chunks_of(j, b), D = j->D;
    float mx = -INFINITY, den = 0.f;
    for (int c = 0; c < nc; c++) mx = fmaxf(mx, partial(j, b, c, hq)[0]);
    for (int c = 0; c < nc; c++) den += partial(j, b, c, hq)[1] * exp2f(partial(j, b, c, hq)[0] - mx);
    memset(out, 0, sizeof(float) * (size_t)D);
    if (!(den > 0.f)) return;  /* an empty context attends to nothing */
    for (int c = 0; c < nc; c++) {
        const float *pr = partial(j, b, c, hq), f = exp2f(pr[0] - mx);
        for (int d = 0; d < D; d++) out[d] += pr[2 + d] * f;
    }
    for (int d = 0; d < D; d++) out[d] /= den;
}

/* The first PREFETCH_PAGES pages of a task's K, then of its V, requested
 * into L2 as the task starts: in a decode step the pages come cold from
 * memory (the layers' weights pass through every cache between two steps),
 * and the vector passes' own prefetch, PD_PF pages ahead, leaves a task's
 * first pages to be waited for one load at a time. Capped because a burst
 * for a whole 16-page chunk made long single sequences slower.
 * always_inline: GCC judges a function made only of prefetches free of side
 * effects and drops the calls (tests/test_paged_decode.py checks the
 * instructions are there). */
enum { PREFETCH_PAGES = 8 };
static inline __attribute__((always_inline)) void prefetch_task(const job *j, int b, int c) {
    const int64_t bs = j->bs, bytes = bs * j->slot_stride, *table = j->tables + (int64_t)b * j->width;
    const int64_t p0 = chunk_first(j, b, c), p1 = chunk_end(j, b, c);
    const int64_t end = p1 < p0 + PREFETCH_PAGES ? p1 : p0 + PREFETCH_PAGES;
    for (int kv = 0; kv < 2; kv++)
        for (int64_t p = p0; p < end; p++)
            for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch((kv ? j->v : j->k) + table[p] * bytes + o, 0, 2);
}

/* task (sequence b, chunk c) on the vector path vec, after its first pages are requested */
static inline __attribute__((always_inline)) void run_task(const job *j, int b, int c, int vec, float *s) {
    prefetch_task(j, b, c);
#ifdef PD_AVX512
    if (vec == KV_PATH_AVX512) { chunk_avx512(j, b, c, s); return; }
#endif
#ifdef PD_AVX2
    if (vec == KV_PATH_AVX2) { chunk_avx2(j, b, c, s); return; }
#endif
    chunk_scalar(j, b, c, s);
}

/* per-thread scratch (thread_scratch.h): one call per layer and step, a few
 * microseconds each at short contexts */
static __thread void *tl_scratch, *tl_part;
static __thread size_t tl_scratch_size, tl_part_size;

/* whether KV4 scores take VNNI now: the vector path, a CPU with VNNI, and
 * QOQSERVE_CPU_ISA=avx512 not asking for the fp32 scores */
static int kv4_vnni_path(void) {
#ifdef PD_AVX512
    return kv_vector_path() == KV_PATH_AVX512 && vnni_supported() && isa_cap() >= ISA_AVX512_VNNI;
#else
    return 0;
#endif
}

/* Which path paged_decode_attention takes now: 513 (AVX-512, KV4 scores by
 * VNNI), 512 (AVX-512), 256 (AVX2) or 0 (scalar). */
int paged_decode_isa(void) {
    static const int widths[] = {0, 256, 512};
    return kv4_vnni_path() ? 513 : widths[kv_vector_path()];
}

/* shared by a running team (team.h): thread 0's partials and the next task */
static void *volatile team_part;
static int team_next;

/* Thread tm.t of tm.T: tasks (sequence, chunk) claimed in order from
 * *next, in guided shares, then, once all are done, its share of the merges. j is this thread's
 * own copy in a running team, shared in the kernel's own region. Nonzero when
 * this thread had no scratch (its tasks are skipped). */
static int decode_part(job *j, int vec, int merges, team_t tm, int *next) {
    if (tm.joined && tm.T > 1) {  /* reset before the team meets in team_buffer */
        if (tm.t == 0) team_next = 0;
        next = &team_next;
    }
    if (tm.joined)  /* j is this thread's own copy: in the kernel's own region the caller made the partials */
        j->part = (float *)team_buffer(tm, NULL, &team_part, &tl_part, &tl_part_size, j->part_bytes);
    float *s = (float *)grow_scratch(&tl_scratch, &tl_scratch_size, sizeof(float) * (size_t)scratch_floats(j));
    const int tasks = j->B * j->max_chunks;
    if (tm.joined && tasks == 1 && tm.T > 1) {
        /* One task in a running team (a short context at batch 1): its KV
         * heads split between the threads, each head computed alone as
         * ever (the same bits), instead of one thread doing it all while
         * the others wait at the barrier after the call. */
        j->h_lo = j->Hkv * tm.t / tm.T, j->h_hi = j->Hkv * (tm.t + 1) / tm.T;
        if (s && j->part && j->h_lo < j->h_hi && chunks_of(j, 0) > 0) run_task(j, 0, 0, vec, s);
    } else {
        /* guided: each claim takes a share of what is left (at least one
         * task), so that the threads meet at the shared counter ~20 times
         * a call instead of once a task */
        int first = __atomic_load_n(next, __ATOMIC_RELAXED);
        while (first < tasks) {
            const int take = (tasks - first) / (2 * tm.T) > 1 ? (tasks - first) / (2 * tm.T) : 1;
            if (!__atomic_compare_exchange_n(next, &first, first + take, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
                continue;  /* first now holds the counter another thread moved */
            for (int task = first; task < first + take; task++) {
                const int b = task / j->max_chunks, c = task % j->max_chunks;
                if (s && j->part && c < chunks_of(j, b)) run_task(j, b, c, vec, s);
            }
            first = __atomic_load_n(next, __ATOMIC_RELAXED);
        }
    }
    /* the vector path has written every one-chunk sequence: with only
     * those, no merge pass (and no second barrier) at all */
    if (merges) {
        TEAM_SYNC(tm);
        const int n = j->B * j->H;
        for (int task = n * tm.t / tm.T; j->part && task < n * (tm.t + 1) / tm.T; task++)
            if (merged_apart(j, task / j->H, vec)) merge(j, task / j->H, task % j->H, j->out + (int64_t)task * j->D);
    }
    return !s || !j->part;
}

/* q, out: float [B, H, D]. The row of (slot, head) for K starts at
 * k + slot * slot_stride + head * head_stride bytes, for V at v + the same;
 * slot = table[t / bs] * bs + t % bs. tables: int64 [B, width]; lens: int64 [B].
 * window > 0: each query sees only its sequence's last `window` positions.
 * softcap > 0: the scores soft-capped at it.
 * Returns 0, or -1 if out of memory. */
int paged_decode_attention(const float *q, const uint8_t *k, const uint8_t *v, int64_t slot_stride,
                           int64_t head_stride, int fmt, const int64_t *tables, const int64_t *lens,
                           float *out, int B, int H, int Hkv, int D, int bs, int width,
                           float sm_scale, int window, float softcap, int threads) {
    job j = {q, k, v, slot_stride, head_stride, tables, lens, fmt, B, H, Hkv, H / Hkv, D, bs, width,
             CHUNK_TOKENS / bs > 0 ? CHUNK_TOKENS / bs : 1, 1, window > 0 ? window : 0,
             sm_scale * 1.4426950408889634f, softcap > 0.f ? softcap * 1.4426950408889634f : 0.f,
             0, NULL, out, 0, 0, Hkv};
    j.kv4_vnni = kv4_vnni_path();
    for (int b = 0; b < B; b++) j.max_chunks = chunks_of(&j, b) > j.max_chunks ? chunks_of(&j, b) : j.max_chunks;
    /* in a running team, thread 0's partials are shared inside decode_part */
    const size_t part_bytes = sizeof(float) * (size_t)B * j.max_chunks * H * (D + 2);
    j.part = team_joined() ? NULL : (float *)grow_scratch(&tl_part, &tl_part_size, part_bytes);
    j.part_bytes = part_bytes;
    if (!team_joined() && !j.part) return -1;
    const int vec = kv_vector_path();
    int merges = 0;
    for (int b = 0; b < B; b++) merges |= merged_apart(&j, b, vec);
    int failed = 0, next = 0;
    /* one task: no team to wake and wait for, but in a running team its heads are split */
    TEAM_RUN(threads, B * j.max_chunks > 1 || (team_joined() && Hkv > 1),
             if (decode_part(&j, vec, merges, tm, &next)) team_fail(&failed));
    return failed ? -1 : 0;
}

/* What a thread of a running team that waits before this call can fetch into
 * its L2 (replay.c calls it with the call's own arguments, from inside the
 * team): with one sequence (batch 1: a short context, cold after the step's
 * weight stream went through the caches) its K and V pages, up to
 * FETCH_PAGE_BYTES; nothing for larger batches, whose tasks the threads take
 * in an order not known here. Returns 0. */
enum { FETCH_PAGE_BYTES = 128 << 10 };
int paged_decode_fetch(const float *q, const uint8_t *k, const uint8_t *v, int64_t slot_stride,
                       int64_t head_stride, int fmt, const int64_t *tables, const int64_t *lens,
                       float *out, int B, int H, int Hkv, int D, int bs, int width,
                       float sm_scale, int window, float softcap, int threads) {
    (void)q, (void)head_stride, (void)fmt, (void)out, (void)H, (void)Hkv, (void)D, (void)sm_scale, (void)softcap,
        (void)threads;
    if (B != 1 || lens[0] <= 0) return 0;
    const int64_t bytes = bs * slot_stride, pages = (lens[0] + bs - 1) / bs;
    const int64_t n = pages < width ? pages : width, most = FETCH_PAGE_BYTES / (2 * bytes);
    const int64_t seen = window > 0 ? window / bs + 2 : n;  /* at most the pages the window touches */
    const int64_t from = n - (most < seen ? most : seen);
    for (int64_t p = from > 0 ? from : 0; p < n; p++)  /* the newest pages, if not all */
        for (int64_t o = 0; o < bytes; o += 64) {
            __builtin_prefetch(k + tables[p] * bytes + o, 0, 2);
            __builtin_prefetch(v + tables[p] * bytes + o, 0, 2);
        }
    return 0;
}

#include "paged_decode_bf16.h"
