/* One token's penalties, as sampler.apply_penalties computes them, shared by
 * penalize_rows (sample.c) and a decode burst's penalize_step
 * (burst_penalties.c) so both give the same bits. Build with
 * -ffp-contract=off: each product and sum rounds on its own, as torch's. */
#ifndef QOQSERVE_PENALTY_OPS_H
#define QOQSERVE_PENALTY_OPS_H
#include <math.h>

/* repetition (HF/CTRL): a positive logit divided, the rest multiplied; a
 * masked -inf stays (times a tiny rep it would be NaN) */
static inline float repetition_penalized(float w, float rep) {
    return w > 0.0f ? w / rep : (w == -INFINITY ? w : w * rep);
}

/* OpenAI's presence / frequency for a token the output holds `count` times */
static inline float count_penalized(float w, float frequency, float count, float presence) {
    float d = frequency * count;
    d = d + presence;
    return w - d;
}
#endif
