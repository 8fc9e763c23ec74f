/* One value of the per-token INT8 quantizer (qoq_ref.quantize_act_int8), for
 * every scalar path and vector tail: v / s rounded half to even (nearbyintf
 * in the default rounding mode), clamped to [-127, 127] (a NaN to -127). */
#ifndef QOQSERVE_INT8_ROUND_H
#define QOQSERVE_INT8_ROUND_H
#include <math.h>

static inline float int8_round(float v, float s) {
    float r = nearbyintf(v / s);
    r = r > -127.f ? r : -127.f;
    return r < 127.f ? r : 127.f;
}
#endif
