/* Sampling rows of logits on CPU: temperature, min_p, top_k, top_p and one
 * draw per row, without sorting the vocabulary.
 *
 * A row's weights are w_i = e^((l_i - max) / T) (exp_f32; exactly 0 below
 * e^-87 and for masked -inf or NaN logits), so the top token weighs 1. Then,
 * in vLLM's order:
 *   min_p: w_i < min_p dropped (min_p of the top token's probability);
 *   top_k: the k heaviest kept, every token tied with the k-th too;
 *   top_p: token i kept while the weight of the tokens heavier than it is
 *          below top_p of what is left (the heaviest always kept): the rule
 *          of a descending sort and its cumulative sum, ties kept together.
 * The k-th weight and the top_p threshold are found by bisection on the
 * bits of a non-negative float (its order is its bits' order): about 30
 * passes of a vectorizable count or sum, for top_k over the tokens at or
 * above a floor that a few passes over the row find (weights 256x apart
 * until k tokens reach it), for top_p over the tokens that can be kept at
 * all, gathered in one pass (of
 * the S a row's weights sum to, a token lighter than f = (1 - top_p) S / V
 * has at most V f = (1 - top_p) S at or below its weight, so at least
 * top_p S above it: it goes).
 * The draw: the first token, in vocabulary order, at which the running sum
 * of kept weights passes u * (their sum), u in [0, 1) the row's uniform (from
 * its own generator: a seeded request draws the same whatever the batch).
 * Sums run in 16 lanes, then in double; rows are independent (one thread
 * each), so a row's token depends only on its logits, its settings and u.
 *
 * penalize_rows applies the penalties before that, in place, with the
 * operations and roundings of sampler.apply_penalties (build with
 * -ffp-contract=off: each product and sum rounds on its own, as torch's). */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "exp_f32.h"
#include "penalty_ops.h"
#include "team.h"
#include "thread_scratch.h"

#define LANES 16

static inline uint32_t bits_of(float v) { uint32_t b; memcpy(&b, &v, 4); return b; }
static inline float float_of(uint32_t b) { float v; memcpy(&v, &b, 4); return v; }

/* sum of w[i] for w[i] > v (v < 0: all), lane by lane */
static double mass_above(const float *w, int64_t n, float v) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += w[i + l] > v ? w[i + l] : 0.0f;
    double s = 0.0;
    for (; i < n; i++) s += w[i] > v ? w[i] : 0.0f;
    for (int l = 0; l < LANES; l++) s += acc[l];
    return s;
}

static int64_t count_at_least(const float *w, int64_t n, float v) {
    int32_t lanes[LANES] = {0};  /* lane by lane: the loop vectorizes (a row is far below 2^31 per lane) */
    int64_t i = 0, c = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) lanes[l] += w[i + l] >= v;
    for (; i < n; i++) c += w[i] >= v;
    for (int l = 0; l < LANES; l++) c += lanes[l];
    return c;
}

/* the largest of l[0..n), NaN skipped (-inf when all are NaN or -inf), lane by lane */
static float row_max(const float *l, int64_t n) {
    float lanes[LANES];
    for (int k = 0; k < LANES; k++) lanes[k] = -INFINITY;
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int k = 0; k < LANES; k++) lanes[k] = l[i + k] > lanes[k] ? l[i + k] : lanes[k];
    float m = -INFINITY;
    for (; i < n; i++) m = l[i] > m ? l[i] : m;
    for (int k = 0; k < LANES; k++) m = lanes[k] > m ? lanes[k] : m;
    return m;
}

/* the k-th largest of w[0..n) (k < number of w > 0): the largest v with k of w >= v */
static float kth_largest(const float *w, int64_t n, int64_t k) {
    uint32_t lo = 0, hi = bits_of(1.0f);  /* count(>= lo) >= k; the answer is <= 1 */
    while (lo < hi) {
        const uint32_t mid = lo + (hi - lo + 1) / 2;
        if (count_at_least(w, n, float_of(mid)) >= k) lo = mid;
        else hi = mid - 1;
    }
    return float_of(lo);
}

/* the smallest v >= 0 whose heavier weights sum below p * total: keep w >= v */
static float top_p_threshold(const float *w, int64_t n, double total, float p) {
    const double limit = (double)p * total;
    uint32_t lo = 0, hi = bits_of(1.0f);  /* mass_above(1) = 0 < limit */
    while (lo < hi) {
        const uint32_t mid = lo + (hi - lo) / 2;
        if (mass_above(w, n, float_of(mid)) < limit) hi = mid;
        else lo = mid + 1;
    }
    return float_of(lo);
}

/* w[i] >= floor (> 0), as (weight, token) pairs in vocabulary order; their
 * count. cw and ci have room for V + 16 (AVX-512 stores whole vectors). */
static int64_t gather(const float *w, int64_t V, float floor, float *cw, int32_t *ci) {
    int64_t n = 0, i = 0;
#ifdef __AVX512F__
    /* compress in registers, then a whole-vector store: the memory form of
     * vcompressps is microcoded on some AMD cores */
    const __m512 f = _mm512_set1_ps(floor);
    __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i step = _mm512_set1_epi32(16);
    for (; i + 16 <= V; i += 16, idx = _mm512_add_epi32(idx, step)) {
        const __m512 x = _mm512_loadu_ps(w + i);
        const __mmask16 k = _mm512_cmp_ps_mask(x, f, _CMP_GE_OQ);
        if (!k) continue;
        _mm512_storeu_ps(cw + n, _mm512_maskz_compress_ps(k, x));
        _mm512_storeu_si512(ci + n, _mm512_maskz_compress_epi32(k, idx));
        n += __builtin_popcount(k);
    }
#endif
    for (; i < V; i++)
        if (w[i] >= floor) cw[n] = w[i], ci[n++] = (int32_t)i;
    return n;
}

/* the pairs with weight >= t, in order; their count */
static int64_t keep_at_least(float *cw, int32_t *ci, int64_t n, float t) {
    int64_t kept = 0;
    for (int64_t j = 0; j < n; j++)
        if (cw[j] >= t) cw[kept] = cw[j], ci[kept++] = ci[j];
    return kept;
}

static __thread void *tl_w, *tl_cw, *tl_ci;
static __thread size_t tl_w_size, tl_cw_size, tl_ci_size;

/* One row; returns the token, -1 when every logit is -inf or NaN, -2 out of memory */
static int64_t sample_row(const float *l, int64_t V, float T, float min_p, int64_t top_k, float top_p, double u) {
    float *w = grow_scratch(&tl_w, &tl_w_size, sizeof(float) * (size_t)V);
    float *cw = grow_scratch(&tl_cw, &tl_cw_size, sizeof(float) * (size_t)(V + 16));
    int32_t *ci = grow_scratch(&tl_ci, &tl_ci_size, sizeof(int32_t) * (size_t)(V + 16));
    if (!w || !cw || !ci) return -2;
    const float m = row_max(l, V);
    if (m == -INFINITY) return -1;
    if (m == INFINITY) {  /* a penalty overflowed: the +inf tokens share the draw */
        for (int64_t i = 0; i < V; i++) w[i] = l[i] == INFINITY ? 1.0f : 0.0f;
    } else {
        for (int64_t i = 0; i < V; i++) {
            const float d = l[i] - m;
            const float x = d == 0.0f ? 0.0f : d / T;  /* the top token weighs 1, even at T -> 0 */
            const float e = exp_f32(x);
            w[i] = x >= -87.0f && e >= min_p ? e : 0.0f;  /* NaN fails the test: 0 */
        }
    }
    int64_t n = 0;
    double total;
    if (top_k > 0 && top_k < V && count_at_least(w, V, FLT_TRUE_MIN) > top_k) {  /* more than k weigh > 0 */
        /* a floor with k tokens at or above it (a few passes: weights fall
         * off fast), those gathered, the k-th found among them */
        float v = 1.0f;
        do v = v * (1.0f / 256.0f); while (count_at_least(w, V, v) < top_k);
        n = gather(w, V, v > 0.0f ? v : FLT_TRUE_MIN, cw, ci);
        n = keep_at_least(cw, ci, n, kth_largest(cw, n, top_k));
        total = mass_above(cw, n, -1.0f);
    } else {
        total = mass_above(w, V, -1.0f);
        const float floor_w = (float)((1.0 - (double)top_p) * total / (double)V);
        n = gather(w, V, floor_w > 0.0f ? floor_w : FLT_TRUE_MIN, cw, ci);
    }
    if (top_p < 1.0f) n = keep_at_least(cw, ci, n, top_p_threshold(cw, n, total, top_p));
    const double target = u * mass_above(cw, n, -1.0f);
    double run = 0.0;
    for (int64_t j = 0; j < n; j++) {
        run += cw[j];
        if (run > target) return ci[j];
    }
    return ci[n - 1];  /* u * sum rounded up to the sum itself */
}

/* *status = v from any thread (shared in the kernel's own region) */
static inline void set_status(int *status, int v) {
#pragma omp atomic write
    *status = v;
}

/* For each j < n: out[j] = the token drawn from row rows[j] of logits [*, V]
 * (row stride `stride` floats) with temperature[j] > 0, min_p[j] in [0, 1],
 * top_k[j] (<= 0: off), top_p[j] in (0, 1] and u[j] in [0, 1). Returns 0;
 * -1 when a row has no finite or +inf logit (out[j] = -1 there); -2 out of memory. */
int sample_rows(const float *logits, int64_t stride, int64_t V, const int64_t *rows, int64_t n,
                const float *temperature, const float *min_p, const int64_t *top_k, const float *top_p,
                const double *u, int64_t *out, int threads) {
    int status = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (n > 1 && threads > 1)
    for (int64_t j = 0; j < n; j++) {
        const int64_t t = sample_row(logits + rows[j] * stride, V, temperature[j], min_p[j], top_k[j], top_p[j], u[j]);
        out[j] = t < 0 ? -1 : t;
        if (t < 0) set_status(&status, (int)t);
    }
    return status;
}

/* One step of a decode burst (engine/burst.py), recorded after the LM head:
 * chosen[i] = greedy[i] where temperature[i] is 0, else the token drawn from
 * row i of logits as sample_rows draws it, with u[*step * rows + i]. The
 * rows split between the threads (team.h: a replayed step's team, or a
 * region of `threads`). Returns 0, -1 for a row with no finite logit, -2 out
 * of memory (on the thread that met it). */
int sample_step(const float *logits, int64_t stride, int64_t V, const int64_t *greedy, int64_t rows,
                const float *temperature, const float *min_p, const int64_t *top_k, const float *top_p,
                const double *u, const int64_t *step, int64_t *chosen, int threads) {
    int status = 0;
    TEAM_RUN(threads, rows > 1, for (int64_t i = rows * tm.t / tm.T; i < rows * (tm.t + 1) / tm.T; i++) {
        if (temperature[i] == 0.0f) {
            chosen[i] = greedy[i];
            continue;
        }
        const int64_t t = sample_row(logits + i * stride, V, temperature[i], min_p[i], top_k[i], top_p[i],
                                     u[*step * rows + i]);
        if (t < 0) {
            set_status(&status, (int)t);
            break;
        }
        chosen[i] = t;
    });
    return status;
}

static __thread uint32_t *tl_stamp, tl_stamp_next;
static __thread size_t tl_stamp_size;

/* Row rows[j] of logits, in place: the repetition penalty rep[j] (!= 1: off
 * when 1) on each distinct token of seen[j] (seen_len[j] ids: the prompt and
 * the output), w > 0 divided by it, -inf kept, the rest multiplied; then
 * w -= frequency[j] * count + presence[j] for each (out_tok, out_cnt) pair of
 * the output; then w += bias for each (bias_tok, bias_val) pair. Returns 0,
 * -1 for a token id outside [0, V), -2 out of memory. */
int penalize_rows(float *logits, int64_t stride, int64_t V, const int64_t *rows, int64_t n,
                  const int64_t *const *seen, const int64_t *seen_len, const int64_t *const *out_tok,
                  const float *const *out_cnt, const int64_t *out_len, const int64_t *const *bias_tok,
                  const float *const *bias_val, const int64_t *bias_len, const float *rep,
                  const float *presence, const float *frequency) {
    if ((size_t)V > tl_stamp_size) {  /* a stamp per token: "penalized in this row" without clearing */
        free(tl_stamp);
        tl_stamp = calloc((size_t)V, sizeof(uint32_t));
        tl_stamp_size = tl_stamp ? (size_t)V : 0;
        tl_stamp_next = 0;
        if (!tl_stamp) return -2;
    }
    for (int64_t j = 0; j < n; j++) {
        float *w = logits + rows[j] * stride;
        if (rep[j] != 1.0f) {
            if (++tl_stamp_next == 0) {  /* wrapped: old stamps could match again */
                memset(tl_stamp, 0, (size_t)V * sizeof(uint32_t));
                tl_stamp_next = 1;
            }
            for (int64_t i = 0; i < seen_len[j]; i++) {
                const int64_t t = seen[j][i];
                if (t < 0 || t >= V) return -1;
                if (tl_stamp[t] == tl_stamp_next) continue;
                tl_stamp[t] = tl_stamp_next;
                w[t] = repetition_penalized(w[t], rep[j]);
            }
        }
        for (int64_t i = 0; i < out_len[j]; i++) {
            const int64_t t = out_tok[j][i];
            if (t < 0 || t >= V) return -1;
            w[t] = count_penalized(w[t], frequency[j], out_cnt[j][i], presence[j]);
        }
        for (int64_t i = 0; i < bias_len[j]; i++) {
            const int64_t t = bias_tok[j][i];
            if (t < 0 || t >= V) return -1;
            w[t] = w[t] + bias_val[j][i];
        }
    }
    return 0;
}
