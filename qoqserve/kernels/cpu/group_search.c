/* The offline quantizer's level-2 group search (quant/group_search.py) for
 * CPUs: per row of level-1 values, every (s2, z) candidate's weighted squared
 * error, the smallest kept.
 *
 * It must choose exactly what the torch reference chooses, so every float
 * operation is the reference's, in its order (built with -ffp-contract=off,
 * no FMA): torch.round is round-half-even (rintf in the default rounding
 * mode), `d ** 2` is d * d, and torch sums a contiguous row of g floats in
 * four 8-lane accumulators over 32-float chunks, the four added in order,
 * then their 8 lanes in order. That order is only known for g a multiple of
 * 32 (tests/test_group_search.py checks it against torch); other sizes stay
 * on the reference. Ties go as in the reference: the first z of the
 * smallest error for each s2, then a later (smaller) s2 only if strictly
 * better.
 */
#include <math.h>
#include <stdint.h>

enum { LANES = 8, ACCS = 4, MAX_G = 1024 };

/* the reference's fp32 sum of t[0..g) (g % 32 == 0) */
static float torch_row_sum(const float *t, int g) {
    float acc[ACCS][LANES];
    for (int a = 0; a < ACCS; a++)
        for (int l = 0; l < LANES; l++) acc[a][l] = t[a * LANES + l];
    for (int c = ACCS * LANES; c < g; c += ACCS * LANES)
        for (int a = 0; a < ACCS; a++)
            for (int l = 0; l < LANES; l++) acc[a][l] += t[c + a * LANES + l];
    float lane[LANES];
    for (int l = 0; l < LANES; l++) lane[l] = ((acc[0][l] + acc[1][l]) + acc[2][l]) + acc[3][l];
    float s = lane[0];
    for (int l = 1; l < LANES; l++) s += lane[l];
    return s;
}

static void search_row(const float *x, const float *w, int g, float min_ratio, float *s2_out, float *z_out) {
    float q1[MAX_G], r[MAX_G], t[MAX_G];
    float lo = INFINITY, hi = -INFINITY;
    for (int j = 0; j < g; j++) {
        q1[j] = rintf(x[j]);
        lo = q1[j] < lo ? q1[j] : lo;
        hi = q1[j] > hi ? q1[j] : hi;
    }
    lo = lo > 0.f ? 0.f : lo;
    hi = hi < 0.f ? 0.f : hi;
    float s2_max = ceilf((hi - lo) / 15.f);
    s2_max = s2_max < 1.f ? 1.f : s2_max;
    const float lowest = floorf(min_ratio * s2_max);
    float best_err = INFINITY, best_s2 = s2_max, best_z = 0.f;
    for (int s2 = 16; s2 >= 1; s2--) {
        const float s2f = (float)s2;
        if (!(s2f <= s2_max && s2f >= lowest)) continue;
        const int z_lo = 15 - 127 / s2 > 0 ? 15 - 127 / s2 : 0, z_hi = 128 / s2 < 15 ? 128 / s2 : 15;
        for (int j = 0; j < g; j++) r[j] = rintf(q1[j] / s2f);
        float e_min = INFINITY;
        int z_min = z_lo;
        for (int z = z_lo; z <= z_hi; z++) {
            const float zf = (float)z;
            for (int j = 0; j < g; j++) {
                float u = r[j] + zf;
                u = u < 0.f ? 0.f : (u > 15.f ? 15.f : u);
                const float d = s2f * (u - zf) - x[j];
                t[j] = (d * d) * w[j];
            }
            const float e = torch_row_sum(t, g);
            if (e < e_min) {
                e_min = e;
                z_min = z;
            }
        }
        if (e_min < best_err) {
            best_err = e_min;
            best_s2 = s2f;
            best_z = (float)z_min;
        }
    }
    *s2_out = best_s2;
    *z_out = best_z;
}

/* x [n, g] level-1 values, already clamped to the protective range; w [g]
 * column weights. s2_out, z_out [n]: floats holding the chosen integers.
 * Returns 0, or -1 for a group size it does not handle. */
int group_search(const float *x, int64_t n, int g, const float *w, float min_ratio, float *s2_out, float *z_out,
                 int threads) {
    if (g <= 0 || g % (ACCS * LANES) || g > MAX_G) return -1;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; i++) search_row(x + i * g, w, g, min_ratio, s2_out + i, z_out + i);
    return 0;
}
