/* Log-probabilities of rows of logits on CPU, as torch.log_softmax gives
 * them (l - max - log(sum e^(l - max))), without writing the [rows, V]
 * result: per row its max, the log of its sum, and the k largest logits' ids
 * and logprobs. The sampler wants one or a few logprobs per row; torch's
 * log_softmax writes every one of them, and topk reads them all again.
 *
 * Two passes over a row: the first finds its max and its k largest (a block
 * of 16 whose max does not beat the k-th best so far is skipped in one
 * compare, so after the first few blocks the pass runs at the speed of a
 * max), the second sums e^(l - max) in 16 lanes, then in double.
 *
 * logprob_step is the same per row as one step of a decode burst records it
 * (engine/burst.py), after the draw: each row's chosen token's logprob and
 * its top k, at that step's place in [steps, rows] buffers. */
#include <math.h>
#include <stdint.h>

#include "exp_f32.h"
#include "team.h"

#define LANES 16
#define MAX_K 64

/* v (token t) into the k best so far, largest first; a tie goes after the
 * tokens already there (lower ids first, as a row is read in order) */
static inline void insert_top(float *val, int64_t *id, int64_t *count, int64_t k, float v, int64_t t) {
    int64_t j;
    if (*count < k) j = (*count)++;
    else if (v > val[k - 1]) j = k - 1;  /* the k-th best so far drops out */
    else return;
    for (; j > 0 && v > val[j - 1]; j--) {
        val[j] = val[j - 1];
        id[j] = id[j - 1];
    }
    val[j] = v;
    id[j] = t;
}

static void row_logprobs(const float *l, int64_t V, int64_t k, float *shift, float *logsum, int64_t *top_id,
                         float *top_lp) {
    float best[MAX_K];
    int64_t count = 0;
    float m = -INFINITY;
    int64_t i = 0;
    for (; i + LANES <= V; i += LANES) {
        float bm = l[i];
        for (int j = 1; j < LANES; j++) bm = l[i + j] > bm ? l[i + j] : bm;
        m = bm > m ? bm : m;
        if (k && (count < k || bm > best[k - 1]))
            for (int j = 0; j < LANES; j++)
                if (count < k || l[i + j] > best[k - 1]) insert_top(best, top_id, &count, k, l[i + j], i + j);
    }
    for (; i < V; i++) {
        m = l[i] > m ? l[i] : m;
        if (k && (count < k || l[i] > best[k - 1])) insert_top(best, top_id, &count, k, l[i], i);
    }
    float acc[LANES] = {0};
    i = 0;
    for (; i + LANES <= V; i += LANES)
        for (int j = 0; j < LANES; j++) {
            const float x = l[i + j] - m;
            acc[j] += x >= -87.0f ? exp_f32(x) : 0.0f;  /* -inf (masked) and below e^-87: 0 */
        }
    double s = 0.0;
    for (; i < V; i++) {
        const float x = l[i] - m;
        s += x >= -87.0f ? exp_f32(x) : 0.0f;
    }
    for (int j = 0; j < LANES; j++) s += acc[j];
    const float ls = (float)log(s);
    *shift = m;
    *logsum = ls;
    for (int64_t j = 0; j < k; j++) top_lp[j] = (best[j] - m) - ls;
}

/* For each j < n, row rows[j] of logits [*, V] (row stride `stride`):
 * shift[j] = its max, logsum[j] = log(sum e^(l - max)), so that a token's
 * logprob is (l - shift) - logsum; when k > 0 (k <= MAX_K, k <= V) its k
 * largest logits' ids top_id[j * k ..] and logprobs top_lp[j * k ..], largest
 * first. A row must hold a finite logit. Returns 0, -1 for k out of range. */
int logprob_rows(const float *logits, int64_t stride, int64_t V, const int64_t *rows, int64_t n, int64_t k,
                 float *shift, float *logsum, int64_t *top_id, float *top_lp, int threads) {
    if (k < 0 || k > MAX_K || k > V) return -1;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (n > 1 && threads > 1)
    for (int64_t j = 0; j < n; j++)
        row_logprobs(logits + rows[j] * stride, V, k, shift + j, logsum + j, top_id + j * k, top_lp + j * k);
    return 0;
}

/* One step of a decode burst, recorded after the draw (team-aware: the rows
 * split between the team's threads): for row i < rows of logits,
 * out_lp[s * rows + i] = the logprob of chosen[i] and, when k > 0, its k
 * largest at top_id / top_lp [(s * rows + i) * k ..], s = *step. Returns 0,
 * -1 for k out of range. */
int logprob_step(const float *logits, int64_t stride, int64_t V, int64_t rows, const int64_t *chosen,
                 const int64_t *step, int64_t k, float *out_lp, int64_t *top_id, float *top_lp, int threads) {
    if (k < 0 || k > MAX_K || k > V) return -1;
    const int64_t base = *step * rows;
    TEAM_RUN(threads, rows > 1, for (int64_t i = rows * tm.t / tm.T; i < rows * (tm.t + 1) / tm.T; i++) {
        const float *l = logits + i * stride;
        float m, ls;
        row_logprobs(l, V, k, &m, &ls, top_id + (base + i) * k, top_lp + (base + i) * k);
        out_lp[base + i] = (l[chosen[i]] - m) - ls;
    });
    return 0;
}
