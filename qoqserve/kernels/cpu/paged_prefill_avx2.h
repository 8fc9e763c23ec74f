/* The AVX2 path of paged_prefill.c (included once by it, after its job type):
 * paged_prefill_avx512.h at half the width, for CPUs without AVX-512,
 * entered only after a run-time CPU check.
 *
 * Per key tile: the TILE K rows are converted to fp32 (scale and zero
 * applied) and transposed by 8 x 8 blocks, so that a query row's TILE scores
 * are two vectors built by D broadcast-FMAs; blocks of 4 query rows share each
 * loaded K vector (8 accumulators, the rest of the 16 registers for loads).
 * V rows stay row-major and the same 4 rows share each loaded V vector.
 */
#include "kv_rows_avx2.h"
#ifdef KV_AVX2

KV_AVX2_BEGIN

/* TILE rows of (s, h) from position k0 -> dst[TILE][np] fp32, dequantized;
 * rows n.. are zero */
static inline __attribute__((always_inline)) void tile_rows_avx2(const pjob *j, const uint8_t *pages, int s,
                                                                  int64_t k0, int n, int h, const int fmt,
                                                                  const int D, const int np, float *dst) {
    for (int i = 0; i < n; i++) {
        const uint8_t *r = pages + row_at(j, s, k0 + i, h);
        float *x = dst + i * np;
        row_avx2(r, fmt, D, x);
        if (fmt == KV_INT4 || fmt == KV_INT8) {  /* KV4 rows hold code - 8, KV8 rows the code */
            const __m256 sc = _mm256_set1_ps(half_at(r + (fmt == KV_INT4 ? D / 2 : D)));
            const __m256 z = _mm256_set1_ps(fmt == KV_INT4 ? half_at(r + D / 2 + 2) - 8.f : 0.f);
            for (int c = 0; c < np; c += 8)
                _mm256_store_ps(x + c, _mm256_mul_ps(_mm256_sub_ps(_mm256_load_ps(x + c), z), sc));
        }
    }
    if (n < TILE) memset(dst + n * np, 0, sizeof(float) * (size_t)(TILE - n) * np);
}

/* src[8][stride] (8 columns) -> dst column k at dst + k * TILE (8 floats each) */
static inline __attribute__((always_inline)) void transpose8(const float *src, int64_t stride, float *dst) {
    __m256 r[8], t[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_load_ps(src + i * stride);
    for (int i = 0; i < 4; i++) {  /* per 128-bit lane: [a0 b0 a1 b1], [a2 b2 a3 b3] */
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int g = 0; g < 2; g++) {  /* r[4g + k]: lane L (of 4) holds rows 4g .. 4g + 3 of column k (+ 4) */
        r[4 * g] = _mm256_shuffle_ps(t[4 * g], t[4 * g + 2], 0x44);
        r[4 * g + 1] = _mm256_shuffle_ps(t[4 * g], t[4 * g + 2], 0xee);
        r[4 * g + 2] = _mm256_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0x44);
        r[4 * g + 3] = _mm256_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0xee);
    }
    for (int k = 0; k < 4; k++) {
        _mm256_store_ps(dst + k * TILE, _mm256_permute2f128_ps(r[k], r[4 + k], 0x20));
        _mm256_store_ps(dst + (4 + k) * TILE, _mm256_permute2f128_ps(r[k], r[4 + k], 0x31));
    }
}

/* o[4 rows][np] += sum_{k<n} w[row][k] * v[k] (w rows TILE apart) */
static inline __attribute__((always_inline)) void accumulate4_avx2(float *o, const float *w, const float *v, int n,
                                                                    const int np) {
    for (int c0 = 0; c0 < np; c0 += 16) {
        __m256 a[4][2];
        for (int r = 0; r < 4; r++)
            for (int u = 0; u < 2; u++) a[r][u] = _mm256_load_ps(o + r * np + c0 + 8 * u);
        for (int k = 0; k < n; k++) {
            const __m256 x0 = _mm256_load_ps(v + k * np + c0), x1 = _mm256_load_ps(v + k * np + c0 + 8);
            for (int r = 0; r < 4; r++) {
                const __m256 wr = _mm256_broadcast_ss(w + r * TILE + k);
                a[r][0] = _mm256_fmadd_ps(wr, x0, a[r][0]);
                a[r][1] = _mm256_fmadd_ps(wr, x1, a[r][1]);
            }
        }
        for (int r = 0; r < 4; r++)
            for (int u = 0; u < 2; u++) _mm256_store_ps(o + r * np + c0 + 8 * u, a[r][u]);
    }
}

static inline __attribute__((always_inline)) void task_impl_avx2(const pjob *j, int s, int h, int t0, int t1,
                                                                  float *buf, const int fmt, const int D) {
    const int np = padded(fmt, D), G = j->G, R = (t1 - t0) * G, rows = R + 8;
    float *q = buf, *o = q + (int64_t)rows * np, *lv = o + (int64_t)rows * np, *m = lv + (int64_t)rows * TILE;
    float *kt = m + (rows + 15) / 16 * 16, *tmp = kt + TILE * np, *vb = tmp + TILE * np, *w = vb + TILE * np;
    const int64_t base = j->q_starts[s], pos0 = j->first_pos[s] + t0, last = j->first_pos[s] + t1 - 1;
    for (int r = 0; r < rows; r++) {
        float *dst = q + (int64_t)r * np;
        if (r < R) {
            const float *src = j->q + ((base + t0 + r / G) * j->H + h * G + r % G) * D;
            for (int i = 0; i < np; i++) {
                const int ch = channel_of(fmt, i);
                dst[i] = ch < D ? src[ch] * j->qscale : 0.f;
            }
        } else memset(dst, 0, sizeof(float) * (size_t)np);  /* pad rows add 0 */
        m[r] = -INFINITY;
    }
    memset(o, 0, sizeof(float) * (size_t)rows * np);
    memset(lv, 0, sizeof(float) * (size_t)rows * TILE);
    for (int64_t k0 = first_tile(j, pos0, TILE); k0 <= last; k0 += TILE) {
        const int n = (int)(last + 1 - k0 < TILE ? last + 1 - k0 : TILE);
        tile_rows_avx2(j, j->k, s, k0, n, h, fmt, D, np, tmp);
        for (int c = 0; c < np; c += 8)
            for (int half = 0; half < 2; half++) transpose8(tmp + 8 * half * np + c, np, kt + c * TILE + 8 * half);
        tile_rows_avx2(j, j->v, s, k0, n, h, fmt, D, np, vb);
        const int first = (int)(k0 > pos0 ? k0 - pos0 : 0) * G;  /* the first row that sees this tile */
        for (int r = first; r < R; r += 4) {
            /* named accumulators: as an array indexed by the row loop below, GCC
             * stores them back to memory on every channel */
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0, c0 = a0, c1 = a0, d0 = a0, d1 = a0;
            const float *qr = q + (int64_t)r * np;  /* the 4 rows sit at constant offsets from it */
            for (int i = 0; i < np; i++, qr++) {
                const __m256 lo = _mm256_load_ps(kt + i * TILE), hi = _mm256_load_ps(kt + i * TILE + 8);
                __m256 x = _mm256_broadcast_ss(qr);
                a0 = _mm256_fmadd_ps(x, lo, a0);
                a1 = _mm256_fmadd_ps(x, hi, a1);
                x = _mm256_broadcast_ss(qr + np);
                b0 = _mm256_fmadd_ps(x, lo, b0);
                b1 = _mm256_fmadd_ps(x, hi, b1);
                x = _mm256_broadcast_ss(qr + 2 * np);
                c0 = _mm256_fmadd_ps(x, lo, c0);
                c1 = _mm256_fmadd_ps(x, hi, c1);
                x = _mm256_broadcast_ss(qr + 3 * np);
                d0 = _mm256_fmadd_ps(x, lo, d0);
                d1 = _mm256_fmadd_ps(x, hi, d1);
            }
            __m256 sc[4][2] = {{a0, a1}, {b0, b1}, {c0, c1}, {d0, d1}};
            for (int b = 0; j->cap2 > 0.f && b < 4; b++)
                for (int u = 0; u < 2; u++) sc[b][u] = softcap_avx2(sc[b][u], j->cap2);
            for (int b = 0; b < 4; b++) {
                const int rr = r + b;
                if (rr >= R) {
                    _mm256_store_ps(w + b * TILE, _mm256_setzero_ps());
                    _mm256_store_ps(w + b * TILE + 8, _mm256_setzero_ps());
                    continue;
                }
                const int64_t p = pos0 + rr / G;
                const int nv = (int)(p - k0 + 1 < n ? p - k0 + 1 : n), lo = (int)keys_before_window(j, p, k0);
                /* a row that sees none of the tile: all 0, adds exactly 0 */
                const __m256 valid[2] = {_mm256_castsi256_ps(_mm256_andnot_si256(lanes8(lo), lanes8(nv))),
                                         _mm256_castsi256_ps(_mm256_andnot_si256(lanes8(lo - 8), lanes8(nv - 8)))};
                const __m256 ninf = _mm256_set1_ps(-INFINITY);
                const float mx = hmax8(_mm256_max_ps(_mm256_blendv_ps(ninf, sc[b][0], valid[0]),
                                                     _mm256_blendv_ps(ninf, sc[b][1], valid[1])));
                float *orow = o + (int64_t)rr * np, *lrow = lv + (int64_t)rr * TILE;
                if (mx > m[rr]) {  /* rescale what was summed under the old max */
                    const __m256 f = _mm256_set1_ps(exp2f(m[rr] - mx));
                    for (int c = 0; c < TILE; c += 8) _mm256_store_ps(lrow + c, _mm256_mul_ps(_mm256_load_ps(lrow + c), f));
                    for (int c = 0; c < np; c += 8) _mm256_store_ps(orow + c, _mm256_mul_ps(_mm256_load_ps(orow + c), f));
                    m[rr] = mx;
                }
                for (int k = 0; k < 2; k++) {
                    const __m256 e = _mm256_and_ps(valid[k], exp2_avx2(_mm256_sub_ps(sc[b][k], _mm256_set1_ps(m[rr]))));
                    _mm256_store_ps(lrow + 8 * k, _mm256_add_ps(_mm256_load_ps(lrow + 8 * k), e));
                    _mm256_store_ps(w + b * TILE + 8 * k, e);
                }
            }
            accumulate4_avx2(o + (int64_t)r * np, w, vb, n, np);
        }
    }
    for (int r = 0; r < R; r++) {
        float *dst = j->out + ((base + t0 + r / G) * j->H + h * G + r % G) * D;
        const float *lr = lv + (int64_t)r * TILE;
        const float inv = 1.f / hsum8(_mm256_add_ps(_mm256_load_ps(lr), _mm256_load_ps(lr + 8)));
        store_output_avx2(o + (int64_t)r * np, fmt, D, np, _mm256_setzero_ps(), _mm256_set1_ps(inv), dst);
    }
}

#define TASK(f, d) task_impl_avx2(j, s, h, t0, t1, buf, f, d)
static void task_avx2(const pjob *j, int s, int h, int t0, int t1, float *buf) { KV_SPECIALIZE(j->fmt, j->D, TASK); }
#undef TASK

KV_AVX2_END
#endif
