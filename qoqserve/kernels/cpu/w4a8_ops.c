/* The elementwise halves of a W4A8 linear on CPU, one pass each instead of
 * a chain of torch ops: per-token INT8 quantization of the input (with the
 * row sums the per-channel epilogue needs) and the epilogue of the INT32
 * GEMM. Bit-identical to qoq_ref.quantize_act_int8 and the torch epilogue:
 * IEEE fp32 in the same order, round half to even (compiled without
 * fast-math for that reason).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "int8_round.h"

/* x [M, K] (fp32 or bf16) -> q int8 [M, K], scale fp32 [M], rowsum fp32 [M] */
void quantize_rows_int8(const void *x, int bf16, int64_t M, int64_t K, int8_t *q, float *scale,
                        float *rowsum, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if (M * K > 32768)
    for (int64_t m = 0; m < M; m++) {
        float amax = 0.f, sum = 0.f;
        for (int64_t k = 0; k < K; k++) {
            float v = load(x, bf16, m * K + k);
            float a = fabsf(v);
            amax = a > amax ? a : amax;
        }
        /* torch's row sum (pairwise, vectorized) is not reproducible here; the
         * sum only feeds the per-channel epilogue, so callers that need torch's
         * exact value pass rowsum == NULL and compute it in torch */
        float s = amax > 0.f ? amax / 127.f : 1.f;
        for (int64_t k = 0; k < K; k++) {
            float v = load(x, bf16, m * K + k);
            const float r = int8_round(v, s);
            q[m * K + k] = (int8_t)r;
            sum += v;
        }
        scale[m] = s;
        if (rowsum) rowsum[m] = sum;
    }
}

/* y[m, n] = acc * s_a[m] * s1[n] (- rowsum[m] * zs1[n]) (+ bias[n]), written as
 * fp32 or bf16. s1, zs1, bias are fp32 [N]; zs1/bias may be NULL. */
void w4a8_epilogue(const int32_t *acc, const float *s_a, const float *s1, const float *rowsum,
                   const float *zs1, const float *bias, int64_t M, int64_t N, void *y, int out_bf16,
                   int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if (M * N > 32768)
    for (int64_t m = 0; m < M; m++) {
        const float sa = s_a[m], rs = rowsum ? rowsum[m] : 0.f;
        for (int64_t n = 0; n < N; n++) {
            float v = (float)acc[m * N + n] * sa * s1[n];
            if (zs1) v = v - rs * zs1[n];
            if (bias) v = v + bias[n];
            if (out_bf16) ((uint16_t *)y)[m * N + n] = float_to_bf16(v);
            else ((float *)y)[m * N + n] = v;
        }
    }
}
