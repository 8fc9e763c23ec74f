/* Causal attention over dense fp32 q/k/v, computed in fp64, for the CPU
 * paths that attend without pages: the quantizer's calibration passes and
 * the reference simulation (layers/attention.py: PagedAttention._sdpa). They
 * ran torch's fp64 SDPA, far below this CPU's fp64 FMA rate (docs/accuracy.md
 * has the measurements); fp64 stays because fp32 attention there measurably
 * moved the quantizer's choices. The result is rounded to fp32 once, as the
 * fp64 SDPA's was, so the two agree except where an fp64 value lies within
 * its last bits of an fp32 rounding boundary.
 *
 * Flash-style as paged_prefill.c: each query row keeps an online softmax over
 * key tiles counted from key 0, so its arithmetic depends only on its own
 * position and the keys, not on the other queries or the thread count.
 * First K (transposed per 8-key tile) and V are widened to fp64 once per KV
 * head; then a task is (query head, 8 consecutive queries).
 *
 * AVX-512 (F + DQ) or AVX2 + FMA (dense_attention_f64_avx2.h, the same
 * bits), checked at run time: without either, or with
 * QOQSERVE_CPU_ISA=scalar, the call returns -2 and the caller uses torch's
 * SDPA.
 */
#include "isa_cap.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

enum { KT = 8, QB = 8 };  /* keys per tile (one vector of fp64 scores), queries per task */

#define F64_TARGET __attribute__((target("avx512f,avx512dq")))

/* the constants of both paths' exp: log2(e), ln 2 in two parts, 1/n! from 12 down to 0 */
static const double LOG2E = 1.4426950408889634, LN2_HI = 6.93147180369123816490e-01,
                    LN2_LO = 1.90821492927058770002e-10;
static const double INV_FACT[13] = {1.0 / 479001600.0, 1.0 / 39916800.0, 1.0 / 3628800.0, 1.0 / 362880.0,
                                    1.0 / 40320.0, 1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0,
                                    1.0 / 6.0, 0.5, 1.0, 1.0};

/* e^x for x <= 0 (x = -inf gives 0), within ~2 ulp: x = n ln2 + r, |r| <= ln2 / 2,
 * e^r by its Taylor series to r^12 (remainder < 2e-16 relative) */
F64_TARGET static inline __m512d exp_pd(__m512d x) {
    x = _mm512_max_pd(x, _mm512_set1_pd(-746.0));
    const __m512d n = _mm512_roundscale_pd(_mm512_mul_pd(x, _mm512_set1_pd(LOG2E)), 0);
    __m512d r = _mm512_fnmadd_pd(n, _mm512_set1_pd(LN2_HI), x);
    r = _mm512_fnmadd_pd(n, _mm512_set1_pd(LN2_LO), r);
    __m512d p = _mm512_set1_pd(INV_FACT[0]);
    for (int i = 1; i < 13; i++) p = _mm512_fmadd_pd(p, r, _mm512_set1_pd(INV_FACT[i]));
    return _mm512_scalef_pd(p, n);
}

typedef struct {
    const float *q, *k, *v;  /* [Lq, H, D], [Lk, Hkv, D], [Lk, Hkv, D] */
    float *out;              /* [Lq, H, D] */
    double *kt, *vd;         /* per KV head: [tiles][D][KT] and [Lk][D] */
    int64_t lq, lk, offset;  /* query i sees keys 0 .. i + offset */
    int H, Hkv, D, tiles;
    double scale;
} job;

/* plain C: both vector paths call it */
static void widen(const job *j, int h) {
    double *kt = j->kt + (int64_t)h * j->tiles * j->D * KT, *vd = j->vd + (int64_t)h * j->lk * j->D;
    for (int64_t t = 0; t < j->tiles; t++)
        for (int i = 0; i < KT; i++) {
            const int64_t key = t * KT + i;
            for (int d = 0; d < j->D; d++)
                kt[(t * j->D + d) * KT + i] = key < j->lk ? (double)j->k[(key * j->Hkv + h) * j->D + d] : 0.0;
        }
    for (int64_t key = 0; key < j->lk; key++)
        for (int d = 0; d < j->D; d++) vd[key * j->D + d] = (double)j->v[(key * j->Hkv + h) * j->D + d];
}

/* plain C, both paths: a task's queries widened and scaled (rows past the
 * end: zero queries), its output rows zeroed, the running maxima -inf */
static void start_task(const job *j, int h, int64_t i0, int rows, double *q, double *o, double *m) {
    const int D = j->D;
    for (int r = 0; r < QB; r++) {
        const float *src = j->q + ((i0 + (r < rows ? r : 0)) * j->H + h) * D;
        const double keep = r < rows ? j->scale : 0.0;
        for (int d = 0; d < D; d++) q[r * D + d] = (double)src[d] * keep;
        for (int d = 0; d < D; d++) o[r * D + d] = 0.0;
        m[r] = -INFINITY;
    }
}

/* o[4 rows][NV * 8 columns from c0] += w[r][k] * v[k] over the tile's n keys;
 * NV a constant, so the 4 x NV accumulators stay in registers */
#define ACCUMULATE(NV)                                                                              \
    do {                                                                                            \
        __m512d a[4][NV];                                                                           \
        for (int r = 0; r < 4; r++)                                                                 \
            for (int u = 0; u < NV; u++) a[r][u] = _mm512_loadu_pd(o + r * D + c0 + 8 * u);        \
        for (int k = 0; k < n; k++) {                                                               \
            __m512d x[NV];                                                                          \
            for (int u = 0; u < NV; u++) x[u] = _mm512_loadu_pd(v + (int64_t)k * D + c0 + 8 * u);  \
            for (int r = 0; r < 4; r++) {                                                           \
                const __m512d wr = _mm512_set1_pd(w[r * KT + k]);                                   \
                for (int u = 0; u < NV; u++) a[r][u] = _mm512_fmadd_pd(wr, x[u], a[r][u]);          \
            }                                                                                       \
        }                                                                                           \
        for (int r = 0; r < 4; r++)                                                                 \
            for (int u = 0; u < NV; u++) _mm512_storeu_pd(o + r * D + c0 + 8 * u, a[r][u]);        \
    } while (0)

/* o[4][D] += w[r][k] * v[k] (w rows KT apart) */
F64_TARGET static inline void accumulate(double *o, const double *w, const double *v, int n, int D) {
    int c0 = 0;
    for (; c0 + 32 <= D; c0 += 32) ACCUMULATE(4);
    for (; c0 < D; c0 += 8) ACCUMULATE(1);
}

F64_TARGET static void task(const job *j, int h, int64_t i0, double *buf) {
    const int D = j->D, hk = h / (j->H / j->Hkv);
    const int rows = (int)(j->lq - i0 < QB ? j->lq - i0 : QB);
    double *q = buf, *o = q + QB * D, *w = o + QB * D, m[QB];
    __m512d l[QB];
    start_task(j, h, i0, rows, q, o, m);
    for (int r = 0; r < QB; r++) l[r] = _mm512_setzero_pd();
    const double *kt = j->kt + (int64_t)hk * j->tiles * D * KT, *vd = j->vd + (int64_t)hk * j->lk * D;
    const int64_t last = i0 + rows - 1 + j->offset;  /* the last key the block sees */
    for (int64_t t = 0; t * KT <= last; t++) {
        const int64_t k0 = t * KT;
        const int n = (int)(last + 1 - k0 < KT ? last + 1 - k0 : KT);
        __m512d sc[QB];
        for (int b = 0; b < QB; b++) sc[b] = _mm512_setzero_pd();
        const double *ktile = kt + t * D * KT;
        for (int d = 0; d < D; d++) {
            const __m512d kv = _mm512_loadu_pd(ktile + d * KT);
            for (int b = 0; b < QB; b++) sc[b] = _mm512_fmadd_pd(_mm512_set1_pd(q[b * D + d]), kv, sc[b]);
        }
        for (int b = 0; b < QB; b++) {
            const int64_t see = i0 + b + j->offset - k0 + 1;  /* keys of this tile row b sees */
            if (b >= rows || see <= 0) {
                _mm512_storeu_pd(w + b * KT, _mm512_setzero_pd());
                continue;
            }
            const __mmask8 valid = (__mmask8)(see >= KT ? 0xff : (1u << see) - 1);
            const double mx = _mm512_mask_reduce_max_pd(valid, sc[b]);
            if (mx > m[b]) {  /* rescale what was summed under the old max */
                const double f = exp(m[b] - mx);
                l[b] = _mm512_mul_pd(l[b], _mm512_set1_pd(f));
                for (int d = 0; d < D; d++) o[b * D + d] *= f;
                m[b] = mx;
            }
            const __m512d e = _mm512_maskz_mov_pd(valid, exp_pd(_mm512_sub_pd(sc[b], _mm512_set1_pd(m[b]))));
            l[b] = _mm512_add_pd(l[b], e);
            _mm512_storeu_pd(w + b * KT, e);
        }
        accumulate(o, w, vd + k0 * D, n, D);
        accumulate(o + 4 * D, w + 4 * KT, vd + k0 * D, n, D);
    }
    for (int r = 0; r < rows; r++) {
        const double inv = 1.0 / _mm512_reduce_add_pd(l[r]);
        float *dst = j->out + ((i0 + r) * j->H + h) * D;
        for (int d = 0; d < D; d++) dst[d] = (float)(o[r * D + d] * inv);
    }
}

#include "dense_attention_f64_avx2.h"

/* 2: AVX-512, 1: AVX2, 0: neither (or QOQSERVE_CPU_ISA rules them out) */
static int vector_path(void) {
    const int cap = isa_cap();
    if (cap >= ISA_AVX512 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq")) return 2;
    if (cap >= ISA_AVX2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
    return 0;
}

/* Where dense_attention_f64 runs here: 2 on AVX-512 F + DQ, 1 on AVX2 + FMA,
 * 0 nowhere (QOQSERVE_CPU_ISA caps the choice). */
int dense_attention_f64_supported(void) { return vector_path(); }

/* Returns 0; -1 out of memory, a head_dim that is not a multiple of 8 or
 * keys that do not cover the queries (lk must be offset + lq); -2 when this
 * CPU (or QOQSERVE_CPU_ISA) rules both vector paths out. */
int dense_attention_f64(const float *q, const float *k, const float *v, float *out, int64_t lq, int64_t lk,
                        int64_t offset, int H, int Hkv, int D, double scale, int threads) {
    const int path = vector_path();
    if (!path) return -2;
    if (D % 8 || Hkv <= 0 || H % Hkv || offset < 0 || offset + lq != lk) return -1;
    job j = {q, k, v, out, NULL, NULL, lq, lk, offset, H, Hkv, D, (int)((lk + KT - 1) / KT), scale};
    j.kt = aligned_alloc(64, ((size_t)Hkv * j.tiles * D * KT * sizeof(double) + 63) / 64 * 64);
    j.vd = aligned_alloc(64, ((size_t)Hkv * lk * D * sizeof(double) + 63) / 64 * 64);
    if (!j.kt || !j.vd) {
        free(j.kt);
        free(j.vd);
        return -1;
    }
    const int64_t blocks = (lq + QB - 1) / QB;
    int failed = 0;
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (int h = 0; h < Hkv; h++) widen(&j, h);
        double *buf = aligned_alloc(64, (size_t)(2 * QB * D + QB * KT) * sizeof(double));
        if (!buf) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < blocks * H; t++) {  /* the last blocks see the most keys: first */
            if (buf) (path == 2 ? task : task_avx2)(&j, (int)(t % H), (blocks - 1 - t / H) * QB, buf);
        }
        free(buf);
    }
    free(j.kt);
    free(j.vd);
    return failed ? -1 : 0;
}
#else
int dense_attention_f64_supported(void) { return 0; }

int dense_attention_f64(const float *q, const float *k, const float *v, float *out, int64_t lq, int64_t lk,
                        int64_t offset, int H, int Hkv, int D, double scale, int threads) {
    return -2;
}
#endif
