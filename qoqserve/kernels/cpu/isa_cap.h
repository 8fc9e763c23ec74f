/* QOQSERVE_CPU_ISA as a level, for kernels that read the cap themselves
 * (isa.py is the Python side, the same names in the same order; a value it
 * would refuse caps nothing here). */
#ifndef QOQSERVE_ISA_CAP_H
#define QOQSERVE_ISA_CAP_H
#include <stdlib.h>
#include <string.h>

enum { ISA_SCALAR, ISA_AVX2, ISA_AVX512, ISA_AVX512_VNNI, ISA_AMX };

static inline int isa_cap(void) {
    static const char *names[] = {"scalar", "avx2", "avx512", "avx512-vnni", "amx"};
    const char *isa = getenv("QOQSERVE_CPU_ISA");
    if (isa)
        for (int i = 0; i < (int)(sizeof names / sizeof *names); i++)
            if (!strcmp(isa, names[i])) return i;
    return ISA_AMX;
}
#endif
