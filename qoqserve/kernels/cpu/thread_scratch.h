/* Scratch buffers kept per thread across calls and grown on demand (the
 * caller holds a `static __thread` pointer and size per buffer): the CPU
 * kernels run tens to hundreds of calls per decode step, each of a few
 * microseconds, and a fresh buffer per call costs an allocation, page faults
 * above malloc's mmap threshold, and zeroing where calloc was used. */
#ifndef QOQSERVE_THREAD_SCRATCH_H
#define QOQSERVE_THREAD_SCRATCH_H
#include <stdlib.h>
#include <string.h>

/* *buf, grown to at least `need` bytes: 64-byte aligned, zeroed when made
 * (contents are kept only until it grows); NULL when out of memory */
static void *grow_scratch(void **buf, size_t *size, size_t need) {
    if (need > *size) {
        free(*buf);
        *buf = aligned_alloc(64, (need + 63) & ~(size_t)63);
        *size = *buf ? need : 0;
        if (*buf) memset(*buf, 0, need);
    }
    return *buf;
}
#endif
