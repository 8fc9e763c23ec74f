/* Paged decode attention for a bf16 model's step (included once, at the end
 * of paged_decode.c): q [B, H, D] bf16 widened exactly, the fp32 kernel, each
 * output rounded to nearest even as torch's .to(bfloat16) of it. So the
 * conversions run inside one kernel call, not as torch ops around it, which a
 * captured step could not replay. In a running team every thread takes its
 * share of both conversions, meeting the others before and after the kernel
 * (which every thread calls as one of its team). */
#ifndef QOQSERVE_PAGED_DECODE_BF16_H
#define QOQSERVE_PAGED_DECODE_BF16_H

static __thread void *tl_f32;  /* q, then the outputs, in fp32: 2 * B * H * D floats */
static __thread size_t tl_f32_size;
static void *volatile team_f32;  /* thread 0's, in a running team (team.h) */

int paged_decode_attention_bf16(const uint16_t *q, const uint8_t *k, const uint8_t *v, int64_t slot_stride,
                                int64_t head_stride, int fmt, const int64_t *tables, const int64_t *lens,
                                uint16_t *out, int B, int H, int Hkv, int D, int bs, int width,
                                float sm_scale, int window, float softcap, int threads) {
    const int64_t n = (int64_t)B * H * D;
    const size_t bytes = sizeof(float) * (size_t)(n > 0 ? 2 * n : 1);
    team_t tm = {0, 1, 0};
#ifdef _OPENMP
    if (team_joined()) tm = (team_t){omp_get_thread_num(), omp_get_num_threads(), 1};
#endif
    float *q32 = team_share(tm, &team_f32, tm.t == 0 ? grow_scratch(&tl_f32, &tl_f32_size, bytes) : NULL);
    if (!q32) return -1;  /* every thread sees the same pointer */
    float *out32 = q32 + n;
    for (int64_t i = n * tm.t / tm.T; i < n * (tm.t + 1) / tm.T; i++) q32[i] = bf16_to_float(q[i]);
    TEAM_SYNC(tm);
    const int rc = paged_decode_attention(q32, k, v, slot_stride, head_stride, fmt, tables, lens, out32, B, H, Hkv,
                                          D, bs, width, sm_scale, window, softcap, threads);
    TEAM_SYNC(tm);
    for (int64_t i = n * tm.t / tm.T; !rc && i < n * (tm.t + 1) / tm.T; i++) out[i] = float_to_bf16(out32[i]);
    return rc;
}

#endif
