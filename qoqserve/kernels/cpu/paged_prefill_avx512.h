/* The AVX-512 path of paged_prefill.c (included once by it, after its job
 * type), entered only after a run-time CPU check.
 *
 * Per key tile of WIDE positions: the K rows are converted to fp32
 * (kv_rows_avx512.h, scale and zero applied) and transposed by 16 x 16
 * blocks, so that a query row's WIDE scores are KV_VECS vectors built by D
 * broadcast-FMAs; blocks of 8 query rows share each loaded K vector (8 x
 * KV_VECS independent sums). V rows stay row-major; once every row's
 * weights for the tile are known, the tile's V is taken 64 channels at a
 * time, each block (WIDE x 64 floats, in L1) passing every row, blocks of 4
 * query rows sharing each loaded V vector: the output rows are loaded and
 * stored once per WIDE keys. (Past head_dim 64, sweeping the whole tile's
 * K, then its V, per block of rows thrashed L1 between the two: each came
 * from L2, and the path fell below the AVX2 one at head_dim 256.) KV4 and bf16 rows come out planar per 32 channels, so q is
 * permuted into that order once per task and the output permuted back
 * (load_query, store_output: kv_rows_avx512.h).
 */
#include "kv_rows_avx512.h"
#ifdef KV_AVX512
#define KV_VECS (WIDE / 16)  /* score vectors per row and tile */

KV_AVX512_BEGIN

/* n <= WIDE rows of (s, h) from position k0 -> dst[WIDE][np] fp32, dequantized;
 * rows n.. are zero */
static inline __attribute__((always_inline)) void tile_rows(const pjob *j, const uint8_t *pages, int s, int64_t k0,
                                                             int n, int h, const int fmt, const int D, const int np,
                                                             float *dst) {
    for (int i = 0; i < n; i++) {
        const uint8_t *r = pages + row_at(j, s, k0 + i, h);
        float *x = dst + i * np;
        row_avx512(r, fmt, D, x);
        if (fmt == KV_INT4 || fmt == KV_INT8) {  /* KV4 rows hold code - 8, KV8 rows the code */
            const __m512 sc = _mm512_set1_ps(half_at(r + (fmt == KV_INT4 ? D / 2 : D)));
            const __m512 z = _mm512_set1_ps(fmt == KV_INT4 ? half_at(r + D / 2 + 2) - 8.f : 0.f);
            for (int c = 0; c < np; c += 16)
                _mm512_store_ps(x + c, _mm512_mul_ps(_mm512_sub_ps(_mm512_load_ps(x + c), z), sc));
        }
    }
    if (n < WIDE) memset(dst + n * np, 0, sizeof(float) * (size_t)(WIDE - n) * np);
}

/* src[16][stride] (16 columns from col0) -> dst[16][16] transposed, dst rows `ds` floats apart */
static inline __attribute__((always_inline)) void transpose16(const float *src, int64_t stride, float *dst, int ds) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_load_ps(src + i * stride);
    for (int i = 0; i < 8; i++) {  /* per 128-bit lane: [a0 b0 a1 b1], [a2 b2 a3 b3] */
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int g = 0; g < 4; g++) {  /* r[4g + k]: lane L holds column 4L + k of rows 4g .. 4g + 3 */
        r[4 * g] = _mm512_shuffle_ps(t[4 * g], t[4 * g + 2], 0x44);
        r[4 * g + 1] = _mm512_shuffle_ps(t[4 * g], t[4 * g + 2], 0xee);
        r[4 * g + 2] = _mm512_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0x44);
        r[4 * g + 3] = _mm512_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0xee);
    }
    for (int k = 0; k < 4; k++) {
        const __m512 x0 = _mm512_shuffle_f32x4(r[k], r[4 + k], 0x88), x1 = _mm512_shuffle_f32x4(r[k], r[4 + k], 0xdd);
        const __m512 y0 = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0x88);
        const __m512 y1 = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0xdd);
        _mm512_store_ps(dst + ds * k, _mm512_shuffle_f32x4(x0, y0, 0x88));
        _mm512_store_ps(dst + ds * (8 + k), _mm512_shuffle_f32x4(x0, y0, 0xdd));
        _mm512_store_ps(dst + ds * (4 + k), _mm512_shuffle_f32x4(x1, y1, 0x88));
        _mm512_store_ps(dst + ds * (12 + k), _mm512_shuffle_f32x4(x1, y1, 0xdd));
    }
}

/* o[r][c0 .. c0 + 16 nv) += sum_{k<n} w[r][k] * v[k][same] for `rows` rows (a
 * multiple of 4; w rows WIDE apart). nv must be a constant where inlined: as
 * a run-time count the 4 x nv sums lived on the stack (a load and a store per
 * FMA), which is what made every head_dim but 64 slow here. */
static inline __attribute__((always_inline)) void accumulate_block(float *o, const float *w, const float *v, int n,
                                                                    const int np, int rows, int c0, const int nv) {
    for (int r0 = 0; r0 < rows; r0 += 4) {
        float *orow = o + (int64_t)r0 * np;
        const float *wrow = w + (int64_t)r0 * WIDE;
        __m512 a[4][4];
        for (int r = 0; r < 4; r++)
            for (int u = 0; u < nv; u++) a[r][u] = _mm512_load_ps(orow + r * np + c0 + 16 * u);
        for (int k = 0; k < n; k++) {
            __m512 x[4];
            for (int u = 0; u < nv; u++) x[u] = _mm512_load_ps(v + k * np + c0 + 16 * u);
            for (int r = 0; r < 4; r++) {
                const __m512 wr = _mm512_set1_ps(wrow[r * WIDE + k]);
                for (int u = 0; u < nv; u++) a[r][u] = _mm512_fmadd_ps(wr, x[u], a[r][u]);
            }
        }
        for (int r = 0; r < 4; r++)
            for (int u = 0; u < nv; u++) _mm512_store_ps(orow + r * np + c0 + 16 * u, a[r][u]);
    }
}

/* o[r][np] += sum_{k<n} w[r][k] * v[k] for `rows` rows (a multiple of 4),
 * per block of 64 channels, the block passing every row */
static inline __attribute__((always_inline)) void accumulate_rows(float *o, const float *w, const float *v, int n,
                                                                   const int np, int rows) {
    int c0 = 0;
    for (; c0 + 64 <= np; c0 += 64) accumulate_block(o, w, v, n, np, rows, c0, 4);
    switch ((np - c0) / 16) {  /* the last 16, 32 or 48 channels */
    case 1: accumulate_block(o, w, v, n, np, rows, c0, 1); break;
    case 2: accumulate_block(o, w, v, n, np, rows, c0, 2); break;
    case 3: accumulate_block(o, w, v, n, np, rows, c0, 3); break;
    default: break;
    }
}

static inline __attribute__((always_inline)) void task_impl(const pjob *j, int s, int h, int t0, int t1,
                                                             float *buf, const int fmt, const int D) {
    const int np = padded(fmt, D), G = j->G, R = (t1 - t0) * G, rows = R + 8;
    float *q = buf, *o = q + (int64_t)rows * np, *lv = o + (int64_t)rows * np, *m = lv + (int64_t)rows * TILE;
    float *kt = m + (rows + 15) / 16 * 16, *tmp = kt + WIDE * np, *vb = tmp + WIDE * np, *w = vb + WIDE * np;
    const int64_t base = j->q_starts[s], pos0 = j->first_pos[s] + t0, last = j->first_pos[s] + t1 - 1;
    const __m512 qscale = _mm512_set1_ps(j->qscale);
    for (int r = 0; r < rows; r++) {
        if (r < R) load_query(j->q + ((base + t0 + r / G) * j->H + h * G + r % G) * D, fmt, D, np, qscale,
                              q + (int64_t)r * np);
        else memset(q + (int64_t)r * np, 0, sizeof(float) * (size_t)np);  /* pad rows add 0 */
        m[r] = -INFINITY;
    }
    memset(o, 0, sizeof(float) * (size_t)rows * np);
    memset(lv, 0, sizeof(float) * (size_t)rows * TILE);
    for (int64_t k0 = first_tile(j, pos0, WIDE); k0 <= last; k0 += WIDE) {
        const int n = (int)(last + 1 - k0 < WIDE ? last + 1 - k0 : WIDE);
        tile_rows(j, j->k, s, k0, n, h, fmt, D, np, tmp);
        for (int c = 0; c < np; c += 16)
            for (int u = 0; u < KV_VECS; u++) {
                if (n > 16 * u) transpose16(tmp + 16 * u * np + c, np, kt + c * WIDE + 16 * u, WIDE);
                else for (int i = 0; i < 16; i++) _mm512_store_ps(kt + (c + i) * WIDE + 16 * u, _mm512_setzero_ps());
            }
        tile_rows(j, j->v, s, k0, n, h, fmt, D, np, vb);
        const int first = (int)(k0 > pos0 ? k0 - pos0 : 0) * G;  /* the first row that sees this tile */
        for (int r = first; r < R; r += 8) {
            __m512 sc[8][KV_VECS];
            for (int b = 0; b < 8; b++)
                for (int u = 0; u < KV_VECS; u++) sc[b][u] = _mm512_setzero_ps();
            const float *qr = q + (int64_t)r * np;  /* the 8 rows sit at constant offsets from it */
            for (int i = 0; i < np; i++, qr++) {
                __m512 kv[KV_VECS];
                for (int u = 0; u < KV_VECS; u++) kv[u] = _mm512_load_ps(kt + i * WIDE + 16 * u);
                for (int b = 0; b < 8; b++) {
                    const __m512 qb = _mm512_set1_ps(qr[b * np]);
                    for (int u = 0; u < KV_VECS; u++) sc[b][u] = _mm512_fmadd_ps(qb, kv[u], sc[b][u]);
                }
            }
            for (int b = 0; j->cap2 > 0.f && b < 8; b++)
                for (int u = 0; u < KV_VECS; u++) sc[b][u] = softcap_ps(sc[b][u], j->cap2);
            for (int b = 0; b < 8; b++) {
                const int rr = r + b;
                float *wr = w + (int64_t)rr * WIDE;  /* the row's weights for the tile */
                if (rr >= R) {
                    for (int u = 0; u < KV_VECS; u++) _mm512_store_ps(wr + 16 * u, _mm512_setzero_ps());
                    continue;
                }
                const int64_t p = pos0 + rr / G;
                const int nv = (int)(p - k0 + 1 < n ? p - k0 + 1 : n), lo = (int)keys_before_window(j, p, k0);
                __mmask16 valid[KV_VECS], above = 0;
                float *orow = o + (int64_t)rr * np, *lrow = lv + (int64_t)rr * TILE;
                const __m512 mo = _mm512_set1_ps(m[rr]);
                for (int u = 0; u < KV_VECS; u++) {  /* a row that sees none of the tile: all 0, adds exactly 0 */
                    valid[u] = lane_mask(nv - 16 * u) & (__mmask16)~lane_mask(lo - 16 * u);
                    above |= _mm512_mask_cmp_ps_mask(valid[u], sc[b][u], mo, _CMP_GT_OQ);
                }
                /* the tile's max is reduced only when a score passes the row's
                 * max, which after the first tiles is rare */
                if (above) {
                    __m512 mv = _mm512_set1_ps(-INFINITY);
                    for (int u = 0; u < KV_VECS; u++) mv = _mm512_mask_max_ps(mv, valid[u], mv, sc[b][u]);
                    const float mx = _mm512_reduce_max_ps(mv);
                    if (mx > m[rr]) {  /* rescale what was summed under the old max */
                        const __m512 f = _mm512_set1_ps(exp2f(m[rr] - mx));
                        _mm512_store_ps(lrow, _mm512_mul_ps(_mm512_load_ps(lrow), f));
                        for (int c = 0; c < np; c += 16)
                            _mm512_store_ps(orow + c, _mm512_mul_ps(_mm512_load_ps(orow + c), f));
                        m[rr] = mx;
                    }
                }
                const __m512 mr = _mm512_set1_ps(m[rr]);
                __m512 l = _mm512_load_ps(lrow);
                for (int u = 0; u < KV_VECS; u++) {
                    const __m512 e = _mm512_maskz_mov_ps(valid[u], exp2_ps(_mm512_sub_ps(sc[b][u], mr)));
                    l = _mm512_add_ps(l, e);
                    _mm512_store_ps(wr + 16 * u, e);
                }
                _mm512_store_ps(lrow, l);
            }
        }
        /* the rows from `first`, in blocks of 8 as scored (rows past R: weights 0) */
        accumulate_rows(o + (int64_t)first * np, w + (int64_t)first * WIDE, vb, n, np, (R - first + 7) / 8 * 8);
    }
    for (int r = 0; r < R; r++) {
        float *dst = j->out + ((base + t0 + r / G) * j->H + h * G + r % G) * D;
        const float inv = 1.f / _mm512_reduce_add_ps(_mm512_load_ps(lv + (int64_t)r * TILE));
        store_output(o + (int64_t)r * np, fmt, D, np, _mm512_setzero_ps(), _mm512_set1_ps(inv), NULL, dst);
    }
}

#define TASK(f, d) task_impl(j, s, h, t0, t1, buf, f, d)
static void task_avx512(const pjob *j, int s, int h, int t0, int t1, float *buf) { KV_SPECIALIZE(j->fmt, j->D, TASK); }
#undef TASK

KV_AVX512_END
#endif
