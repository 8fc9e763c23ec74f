/* The scalar path of w4a8_gemm.c (included once by it, after its Job and
 * tiled()): the activation quantizer, the epilogue and the blocks, one
 * channel at a time. It runs anywhere and defines the numbers the SIMD paths
 * must give bit for bit. */

/* the max/min below pick their second operand on NaN, as vmaxps/vminps do */
static void quantize_row_scalar(const void *x, int bf16, int64_t K, int64_t Kp, int8_t *q,
                                float *scale, int32_t *qsum) {
    float a = 0.f;
    for (int64_t k = 0; k < K; k++) {
        float v = fabsf(bf16 ? bf16_to_float(((const uint16_t *)x)[k]) : ((const float *)x)[k]);
        a = v > a ? v : a;
    }
    float s = a > 0.f ? a / 127.f : 1.f;
    int32_t sum = 0;
    for (int64_t k = 0; k < K; k++) {
        float v = bf16 ? bf16_to_float(((const uint16_t *)x)[k]) : ((const float *)x)[k];
        const float r = int8_round(v, s);
        q[k] = (int8_t)r;
        sum += (int32_t)r;
    }
    memset(q + K, 0, (size_t)(Kp - K));
    *scale = s;
    *qsum = sum;
}

static inline float epilogue_scalar(const Job *j, int64_t m, int64_t n, int32_t acc) {
    float v = (float)acc * j->sa[m] * j->s1[n];
    if (j->zs1) v = v - j->rowsum[m] * j->zs1[n];
    if (j->bias) v = v + j->bias[n];
    return v;
}

/* signed weights of channel n (s2*(u - z), or u per channel) into row[Kp] */
static void unpack_channel(const Job *j, int64_t n, int8_t *row) {
    int64_t wstep, gstep = 0;
    const uint8_t *w = tiled(j->w, j, n / NB, j->Kp / 8, 64, &wstep) + 4 * (n % NB);
    const uint8_t *g = j->gp ? tiled(j->gp, j, n / NB, j->Kp / j->group, NB, &gstep) + n % NB : NULL;
    for (int64_t k = 0; k < j->Kp; k++) {
        const uint8_t byte = w[(k / 8) * wstep + k % 4];
        int u = (k % 8) < 4 ? byte & 15 : byte >> 4;
        if (g) {
            const uint8_t gb = g[(k / j->group) * gstep];
            u = ((gb >> 4) + 1) * (u - (gb & 15));
        }
        row[k] = (int8_t)u;
    }
}

static inline int32_t dot_scalar(const int8_t *x, const int8_t *w, int64_t n) {
    int32_t acc = 0;
    for (int64_t k = 0; k < n; k++) acc += (int32_t)x[k] * w[k];
    return acc;
}

/* row: 2 Kp bytes (a gate channel's weights and its up channel's, y_silu) */
static void blocks_scalar(const Job *j, int64_t nb_lo, int64_t nb_hi, int8_t *row) {
    const int64_t Kp = j->Kp, ys = j->silu ? j->N / 2 : j->N;
    for (int64_t n = nb_lo * NB; n < nb_hi * NB && n < j->N; n++) {
        if (j->silu && n / NB % 2) continue;  /* an up channel: made with its gate channel */
        unpack_channel(j, n, row);
        if (j->silu) unpack_channel(j, n + NB, row + Kp);
        const int64_t col = j->silu ? n / (2 * NB) * NB + n % NB : n;
        for (int64_t m = 0; m < j->M; m++) {
            const int8_t *x = j->xq + m * Kp;
            float v = epilogue_scalar(j, m, n, dot_scalar(x, row, Kp));
            if (j->silu) {  /* the pair as gate_up would hold it, then silu_mul_row's arithmetic */
                const float u = epilogue_scalar(j, m, n + NB, dot_scalar(x, row + Kp, Kp));
                v = silu_mul_value(as_stored(v, j->out_bf16), as_stored(u, j->out_bf16), j->out_bf16);
            }
            if (j->out_bf16) ((uint16_t *)j->y)[m * ys + col] = float_to_bf16(v);
            else ((float *)j->y)[m * ys + col] = v;
        }
    }
}
