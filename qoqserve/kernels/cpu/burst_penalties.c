/* Penalties inside a decode burst (engine/burst_penalties.py): one step's
 * repetition, presence / frequency penalties and logit bias on the rows that
 * have them, in place, recorded after the LM head and before the draw, with
 * the arithmetic of penalize_rows (penalty_ops.h: the same bits as single
 * steps). A penalized greedy row's token is then the argmax of its penalized
 * logits (torch.argmax's: the first NaN, else the first maximum), written
 * over the step's greedy token, which the draw and decode_advance read.
 *
 * Each row's state is what single steps read from its Sequence, written
 * before the burst and brought up to date here: the tokens it has seen
 * (prompt and output, a bitmap), its output tokens with their counts, its
 * logit bias, and its stop tokens with the steps they stay banned (until
 * min_tokens are out: -inf, as layers/token_bans.py bans them after the
 * penalties). At step s > 0 the row's token of step s - 1 (the burst's
 * history) joins the seen tokens and the counts first. */
#include <math.h>
#include <stdint.h>

#include "argmax_row.h"
#include "penalty_ops.h"
#include "team.h"

/* The row's token t (of the step before) among its seen tokens and counts;
 * 0, or -1 when its count list is full (out_cap). */
static int absorb(int64_t t, uint32_t *seen, int64_t *out_tok, float *out_cnt, int64_t *out_len, int64_t out_cap) {
    seen[t >> 5] |= 1u << (t & 31);
    for (int64_t k = 0; k < *out_len; k++)
        if (out_tok[k] == t) {
            out_cnt[k] += 1.0f;
            return 0;
        }
    if (*out_len == out_cap) return -1;
    out_tok[*out_len] = t;
    out_cnt[(*out_len)++] = 1.0f;
    return 0;
}

static int penalize_row(float *w, int64_t V, int64_t *greedy, float temperature, float rep, float presence,
                        float frequency, uint32_t *seen, int64_t words, int64_t *out_tok, float *out_cnt,
                        int64_t *out_len, int64_t out_cap, const int64_t *bias_tok, const float *bias_val,
                        int64_t bias_len, const int64_t *stop_tok, int64_t stop_len, int64_t banned, int64_t prev) {
    if (prev >= 0 && absorb(prev, seen, out_tok, out_cnt, out_len, out_cap)) return -1;
    if (rep != 1.0f)
        for (int64_t j = 0; j < words; j++)
            for (uint32_t bits = seen[j]; bits; bits &= bits - 1) {
                const int64_t t = j * 32 + __builtin_ctz(bits);
                w[t] = repetition_penalized(w[t], rep);
            }
    if (presence != 0.0f || frequency != 0.0f)
        for (int64_t k = 0; k < *out_len; k++) w[out_tok[k]] = count_penalized(w[out_tok[k]], frequency, out_cnt[k],
                                                                              presence);
    for (int64_t k = 0; k < bias_len; k++) w[bias_tok[k]] = w[bias_tok[k]] + bias_val[k];
    if (banned)
        for (int64_t k = 0; k < stop_len; k++) w[stop_tok[k]] = -INFINITY;
    if (temperature == 0.0f) *greedy = argmax_row(w, V);
    return 0;
}

/* Step *step of a burst over rows rows of logits [rows, V] (row stride
 * `stride`): each row i with on[i] penalized in place, as above; its state
 * at seen [rows, words], out_tok / out_cnt [rows, out_cap] (out_len [rows]
 * of them in use), bias_tok / bias_val [rows, bias_cap] (bias_len [rows]),
 * stop_tok [rows, stop_cap] (stop_len [rows]) banned while the step is
 * below ban_steps [rows]; history [steps, rows] the burst's tokens so far.
 * The rows split between the team's threads. Returns 0, -1 when a row's
 * count list is full. */
int penalize_step(float *logits, int64_t stride, int64_t V, int64_t rows, int64_t *greedy, const float *temperature,
                  const int32_t *on, const float *rep, const float *presence, const float *frequency,
                  uint32_t *seen, int64_t words, int64_t *out_tok, float *out_cnt, int64_t *out_len, int64_t out_cap,
                  const int64_t *bias_tok, const float *bias_val, const int64_t *bias_len, int64_t bias_cap,
                  const int64_t *stop_tok, const int64_t *stop_len, const int64_t *ban_steps, int64_t stop_cap,
                  const int64_t *history, const int64_t *step, int threads) {
    const int64_t s = *step;
    int failed = 0;
    TEAM_RUN(threads, rows > 1, for (int64_t i = rows * tm.t / tm.T; i < rows * (tm.t + 1) / tm.T; i++) {
        if (!on[i]) continue;
        if (penalize_row(logits + i * stride, V, greedy + i, temperature[i], rep[i], presence[i], frequency[i],
                         seen + i * words, words, out_tok + i * out_cap, out_cnt + i * out_cap, out_len + i,
                         out_cap, bias_tok + i * bias_cap, bias_val + i * bias_cap, bias_len[i],
                         stop_tok + i * stop_cap, stop_len[i], s < ban_steps[i], s > 0 ? history[(s - 1) * rows + i] : -1))
            team_fail(&failed);
    });
    return failed ? -1 : 0;
}
