/* Which path the CPU attention kernels take now (included after their
 * vector-path headers): the widest the CPU has, capped by QOQSERVE_CPU_ISA. */
#ifndef QOQSERVE_KV_PATH_H
#define QOQSERVE_KV_PATH_H
#include "isa_cap.h"
#include "kv_rows_avx2.h"
#include "kv_rows_avx512.h"

enum { KV_PATH_SCALAR = 0, KV_PATH_AVX2 = 1, KV_PATH_AVX512 = 2 };

static int kv_vector_path(void) {
    const int cap = isa_cap();
#ifdef KV_AVX512
    if (cap >= ISA_AVX512 && avx512_supported()) return KV_PATH_AVX512;
#endif
#ifdef KV_AVX2
    if (cap >= ISA_AVX2 && avx2_supported()) return KV_PATH_AVX2;
#endif
    (void)cap;
    return KV_PATH_SCALAR;
}
#endif
