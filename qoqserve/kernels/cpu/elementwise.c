/* The per-token ops between the GEMMs and attention on CPU: embedding rows,
 * RMSNorm (alone or fused with the residual add before it), q/k/v split with
 * RoPE and the QoQ key transform, SiLU * mul. One call per op and layer,
 * where torch needs 3-12 small ops each, and plain C calls that a captured
 * step (graph.py) can replay.
 *
 * Each output row depends only on its own input row, computed in one fixed
 * order: results do not depend on the batch, how a prompt is chunked or the
 * thread count. Activations are fp32 or bf16 (bf16 = 1), math in fp32, bf16
 * rounding where torch's bf16 ops round (after the normalization, after the
 * weight multiply, ...), so the torch path and this one agree to rounding.
 * Built with -ffp-contract=off: products and sums round one at a time, as
 * torch's elementwise ops do; the key transform's rotation, a dense product,
 * uses explicit fused multiply-adds (key_rotation.h).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#include "team.h"
#endif
#include "bf16.h"
#include "silu_mul_row.h"
#include "norm_row.h"
#include "thread_scratch.h"
#include "key_rotation.h"

enum { MAX_ROW = 16384 };

/* rows are tiny; threads only pay off for prompt-sized batches */
enum { PAR_ROWS = 8 };

void embed_rows(const int64_t *ids, const void *table, void *h, int64_t T, int64_t row_bytes) {
    for (int64_t t = 0; t < T; t++)
        memcpy((char *)h + t * row_bytes, (const char *)table + ids[t] * row_bytes, (size_t)row_bytes);
}

/* h = table[ids] * scale (Gemma's scaled embeddings), rounded as torch's
 * row * scale in the table's dtype (scale as that dtype holds it) */
void embed_scaled(const int64_t *ids, const void *table, void *h, int64_t T, int64_t K, float scale, int bf16) {
    const float s = bf16 ? bf16_to_float(float_to_bf16(scale)) : scale;
    for (int64_t t = 0; t < T; t++) {
        float row[MAX_ROW];
        load_row(table, bf16, ids[t] * K, K, row);
        for (int64_t i = 0; i < K; i++) row[i] *= s;
        store_row(row, K, h, bf16, t * K);
    }
}

/* out = a's bytes then b's: rows of two tensors one after the other */
void concat_rows(const void *a, int64_t a_bytes, const void *b, int64_t b_bytes, void *out) {
    memcpy(out, a, (size_t)a_bytes);
    memcpy((char *)out + a_bytes, b, (size_t)b_bytes);
}

/* y = w * x / rms(x); x rows `x_stride` elements apart, y contiguous [T, K] */
void rms_norm(const void *x, int64_t x_stride, const void *w, void *y, int64_t T, int64_t K, float eps,
              int bf16, int threads) {
    TEAM_RUN(threads, T >= PAR_ROWS, for (int64_t t = T * tm.t / tm.T; t < T * (tm.t + 1) / tm.T; t++) {
        float xv[MAX_ROW], wv[MAX_ROW];
        load_row(w, bf16, 0, K, wv);
        load_row(x, bf16, t * x_stride, K, xv);
        norm_row(xv, wv, K, eps, bf16);
        store_row(xv, K, y, bf16, t * K);
    });
}

/* h += d (in place, the residual stream), then y = rms_norm(h) */
void add_rms_norm(void *h, const void *d, const void *w, void *y, int64_t T, int64_t K, float eps,
                  int bf16, int threads) {
    TEAM_RUN(threads, T >= PAR_ROWS, for (int64_t t = T * tm.t / tm.T; t < T * (tm.t + 1) / tm.T; t++) {
        float xv[MAX_ROW], wv[MAX_ROW];
        load_row(w, bf16, 0, K, wv);
        add_norm_row(h, d, wv, t, K, eps, bf16, xv, 1);
        store_row(xv, K, y, bf16, t * K);
    });
}

/* gu [T, 2I] (gate | up) -> y [T, I] = silu(gate) * up, silu(g) = g / (1 + e^-g) */
void silu_mul(const void *gu, void *y, int64_t T, int64_t I, int bf16, int threads) {
    const size_t es = bf16 ? 2 : 4;
    TEAM_RUN(threads, T >= PAR_ROWS, for (int64_t t = T * tm.t / tm.T; t < T * (tm.t + 1) / tm.T; t++) {
        float g[MAX_ROW];
        for (int64_t i0 = 0; i0 < I; i0 += MAX_ROW) {
            const int64_t n = I - i0 < MAX_ROW ? I - i0 : MAX_ROW;
            const char *row = (const char *)gu + (size_t)(t * 2 * I) * es;
            silu_mul_row(row + (size_t)i0 * es, row + (size_t)(I + i0) * es, bf16, n, g);
            store_row(g, n, y, bf16, t * I + i0);
        }
    });
}

/* gu [T, 2I] (gate | up) -> y [T, I] = gelu_tanh(gate) * up (Gemma's GeGLU),
 * gelu_tanh(g) = g / 2 (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), with torch's
 * roundings: the GELU rounded to the dtype, then the product */
void gelu_mul(const void *gu, void *y, int64_t T, int64_t I, int bf16, int threads) {
    const size_t es = bf16 ? 2 : 4;
    TEAM_RUN(threads, T >= PAR_ROWS, for (int64_t t = T * tm.t / tm.T; t < T * (tm.t + 1) / tm.T; t++) {
        float g[MAX_ROW], u[MAX_ROW];
        for (int64_t i0 = 0; i0 < I; i0 += MAX_ROW) {
            const int64_t n = I - i0 < MAX_ROW ? I - i0 : MAX_ROW;
            const char *row = (const char *)gu + (size_t)(t * 2 * I) * es;
            load_row(row, bf16, i0, n, g);
            load_row(row, bf16, I + i0, n, u);
            for (int64_t i = 0; i < n; i++) {
                const float x = g[i], inner = 0.7978845608028654f * (x + 0.044715f * (x * x * x));
                g[i] = as_stored(as_stored(0.5f * x * (1.0f + tanh_f32(inner)), bf16) * u[i], bf16);
            }
            store_row(g, n, y, bf16, t * I + i0);
        }
    });
}

/* y = cap tanh(x / cap) of fp32 x [T, V] (Gemma 2's final logit soft-capping),
 * by tanh_f32 (exp_f32.h), so that the loop vectorizes: its error is
 * absolute, under 2.5e-7 cap against torch's tanh / cap * cap. Each row split
 * between the threads as argmax_rows splits it, in units of 64 values. */
void softcap_rows(const float *x, float *y, int64_t T, int64_t V, float cap, int threads) {
    TEAM_RUN(threads, T * V >= 65536, {
        const int64_t units = (V + 63) / 64, lo = units * tm.t / tm.T * 64, end = units * (tm.t + 1) / tm.T * 64;
        const int64_t hi = end < V ? end : V;
        for (int64_t t = 0; t < T; t++)
            for (int64_t i = t * V + lo; i < t * V + hi; i++) y[i] = cap * tanh_f32(x[i] / cap);
    });
}

/* token t of qkv_rope (below) */
static void rope_token(const void *qkv, int64_t row, int64_t t, int H, int Hkv, int D, int Dr, const int64_t *pos,
                       const float *cos, const float *sin, const void *shift, const void *rot, int hadamard,
                       const void *qn, const void *kn, float eps, void *q, void *k, void *v, int bf16) {
    /* head_dim <= 512; a bf16 R is widened once per token when it fits
     * the scratch (head_dim <= 128), else row by row. fp32 rows are read
     * where they are and rotated straight into their output rows; bf16
     * ones are widened into x first and rounded on the way out. */
    float x[ROT_GROUP][512], y[ROT_GROUP][512], rmat[128 * 128], sh[512], scales[512];
    const float *R = NULL, *C = NULL;  /* R, or with hadamard its column scales C */
    if (rot && hadamard) {
        if (bf16) load_row(rot, bf16, 0, D, scales);
        C = bf16 ? scales : (const float *)rot;
    } else if (rot && !bf16) R = (const float *)rot;
    else if (rot && D <= 128) { load_row(rot, bf16, 0, (int64_t)D * D, rmat); R = rmat; }
    float nw[2][512];  /* the q and k norms' weights */
    if (qn) {
        load_row(qn, bf16, 0, D, nw[0]);
        load_row(kn, bf16, 0, D, nw[1]);
    }
    const float *c = cos ? cos + pos[t] * Dr : NULL, *s = sin ? sin + pos[t] * Dr : NULL;
    const int half = Dr / 2;
    for (int h0 = 0; h0 < H + Hkv; h0 += ROT_GROUP) {
        const int nh = H + Hkv - h0 < ROT_GROUP ? H + Hkv - h0 : ROT_GROUP;
        float *out[ROT_GROUP];  /* the rotation's destination of each head */
        for (int j = 0; j < nh; j++) {
            const int h = h0 + j, is_k = h >= H;
            const int64_t oi = (t * (is_k ? Hkv : H) + (is_k ? h - H : h)) * D;
            const float *xj = bf16 || qn ? x[j] : (const float *)qkv + t * row + (int64_t)h * D;
            float *yj = y[j];
            if (bf16 || qn) load_row(qkv, bf16, t * row + (int64_t)h * D, D, x[j]);
            if (qn) norm_row(x[j], nw[is_k], D, eps, bf16);  /* as rms_norm() rounds it */
            if (c) {  /* the first Dr channels turn (pairs d, d + Dr / 2); the rest pass (partial rotary) */
                for (int d = 0; d < half; d++) yj[d] = xj[d] * c[d] + -xj[d + half] * s[d];
                for (int d = half; d < Dr; d++) yj[d] = xj[d] * c[d] + xj[d - half] * s[d];
                for (int d = Dr; d < D; d++) yj[d] = xj[d];
            } else {
                memcpy(yj, xj, sizeof(float) * (size_t)D);  /* a layer without RoPE (SmolLM3) */
            }
            round_row(yj, D, bf16);
            if (rot && is_k) {
                const float *shj = bf16 ? sh : (const float *)shift + (int64_t)(h - H) * D;
                if (bf16) load_row(shift, bf16, (int64_t)(h - H) * D, D, sh);
                for (int e = 0; e < D; e++) yj[e] = yj[e] - shj[e];
                round_row(yj, D, bf16);
            }
            out[j] = bf16 ? x[j] : (float *)(is_k ? k : q) + oi;
        }
        if (C) hadamard_heads(y, C, out, nh, D);
        else if (R) rotate_heads(y, R, out, nh, D);
        for (int j = 0; rot && !R && !C && j < nh; j++) {
            for (int d = 0; d < D; d++) out[j][d] = 0.f;
            for (int e = 0; e < D; e++) {
                float rr[512];
                load_row(rot, bf16, (int64_t)e * D, D, rr);
                for (int d = 0; d < D; d++) out[j][d] = fmaf(y[j][e], rr[d], out[j][d]);
            }
        }
        for (int j = 0; j < nh && (bf16 || !rot); j++) {
            const int h = h0 + j, is_k = h >= H;
            const int64_t oi = (t * (is_k ? Hkv : H) + (is_k ? h - H : h)) * D;
            store_row(rot ? x[j] : y[j], D, is_k ? k : q, bf16, oi);
        }
    }
    const size_t es = bf16 ? 2 : 4;
    memcpy((char *)v + (size_t)(t * Hkv * D) * es, (const char *)qkv + (size_t)(t * row + (H + Hkv) * D) * es,
           (size_t)(Hkv * D) * es);
}

/* qkv [T, row] (row >= (H + 2 Hkv) D elements: q | k | v) -> q [T, H, D],
 * k, v [T, Hkv, D] contiguous; with qn (and kn) != NULL first each q (k) head
 * RMS-normalized with those weights [D] (Qwen3's q_norm, k_norm); RoPE
 * (half-split; none where cos is NULL) on the first Dr channels of q and k
 * (Dr = D but for partial rotary embeddings) at positions pos[t] from the
 * fp32 tables cos/sin [max_pos, Dr], rounded once; with
 * rot != NULL then q R and (k - shift) R (shift [Hkv, D], R [D, D] row-major:
 * layers/key_transform.py), each output summed over e in order by fused
 * multiply-adds; with hadamard, rot holds R's column scales c [D] instead,
 * for R = H diag(c), H the Sylvester Hadamard matrix (key_rotation.h). */
void qkv_rope(const void *qkv, int64_t row, int64_t T, int H, int Hkv, int D, int Dr, const int64_t *pos,
              const float *cos, const float *sin, const void *shift, const void *rot, int hadamard,
              const void *qn, const void *kn, float eps, void *q, void *k, void *v, int bf16, int threads) {
    TEAM_RUN(threads, T >= PAR_ROWS, for (int64_t t = T * tm.t / tm.T; t < T * (tm.t + 1) / tm.T; t++)
             rope_token(qkv, row, t, H, Hkv, D, Dr, pos, cos, sin, shift, rot, hadamard, qn, kn, eps, q, k, v,
                        bf16));
}

#include "argmax_row.h"

/* One thread's share of a row in a running team: its first NaN, else its
 * first maximum (i < 0: an empty share) */
typedef struct { int64_t i; float v; int nan; } arg_share;

static void *volatile team_shares;  /* thread 0's, in a running team (team.h) */
static __thread void *tl_shares;
static __thread size_t tl_shares_size;

/* Thread tm.t of a running team: of every row, the columns of its share, in
 * units of 64 as the linears split their output channels (int8_linear.c,
 * float_linear.c), so it reads the logits it has just written; then thread
 * 0 joins the shares in column order: the first share holding a NaN gives
 * its first NaN, else the first share holding the row's maximum gives its
 * first index of it. That is argmax_row's answer over the whole row. */
static void argmax_part(const float *x, int64_t stride, int64_t T, int64_t V, int64_t *out, team_t tm) {
    arg_share *sh = (arg_share *)team_buffer(tm, NULL, &team_shares, &tl_shares, &tl_shares_size,
                                             sizeof(arg_share) * (size_t)(T * tm.T));
    if (!sh) {  /* no scratch for the shares (every thread sees NULL): thread 0 takes every row whole */
        for (int64_t t = 0; tm.t == 0 && t < T; t++) out[t] = argmax_row(x + t * stride, V);
        return;
    }
    const int64_t units = (V + 63) / 64, lo = units * tm.t / tm.T * 64, end = units * (tm.t + 1) / tm.T * 64;
    const int64_t hi = end < V ? end : V;
    for (int64_t t = 0; t < T; t++) {
        arg_share *mine = &sh[t * tm.T + tm.t];
        mine->i = -1;
        if (lo >= hi) continue;
        const float *row = x + t * stride;
        mine->i = lo + argmax_row(row + lo, hi - lo);
        mine->v = row[mine->i];
        mine->nan = mine->v != mine->v;
    }
    TEAM_SYNC(tm);
    for (int64_t t = 0; tm.t == 0 && t < T; t++) {
        const arg_share *best = NULL;
        for (int u = 0; u < tm.T; u++) {
            const arg_share *s = &sh[t * tm.T + u];
            if (s->i < 0) continue;
            if (s->nan) { best = s; break; }
            if (!best || s->v > best->v) best = s;
        }
        out[t] = best->i;
    }
}

/* out[t] = index of the largest value of row t of x [T, V] (fp32, rows
 * `stride` apart), the first one on ties, the first NaN if there is one:
 * torch.argmax's answer, for greedy sampling (one vectorized pass for the
 * maximum, then one for the first index holding it). Called on its own, the
 * rows go over the threads; in a running team (a captured step, after the
 * LM head), every row is split between them (argmax_part). */
void argmax_rows(const float *x, int64_t stride, int64_t T, int64_t V, int64_t *out, int threads) {
    if (team_joined()) {
        TEAM_RUN(threads, V >= 1024, argmax_part(x, stride, T, V, out, tm));
        return;
    }
    #pragma omp parallel for num_threads(threads) if (T >= 2)
    for (int64_t t = 0; t < T; t++) out[t] = argmax_row(x + t * stride, V);
}
