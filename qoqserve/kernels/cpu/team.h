/* The threads a kernel's parallel part runs on, one of two ways:
 *
 * - called once (an eager call): the kernel opens its own OpenMP region;
 * - called by every thread of a team already running: replay.c runs the
 *   calls of a captured step that way, in one parallel region with a barrier
 *   between calls, because inside a decode step a fork and a join cost as
 *   much as the work of a small call (docs/runtime.md, "One team per step").
 *
 * TEAM_RUN gives the part a team_t {t, T, joined}: thread t of T. When the
 * kernel's own condition says the work is too small to split, T is 1 either
 * way: in its own region no team is woken, in a running team thread 0 does
 * the work and the others return at once. A part meets the other threads only
 * through TEAM_SYNC (a no-op when T is 1) and shares a buffer one of them
 * made through team_share, never through OpenMP worksharing, which every
 * thread of the running team would have to reach.
 *
 * "A team is running" is omp_in_parallel(): called from inside any parallel
 * region of this OpenMP runtime, a kernel takes its caller for one thread of
 * a team whose every thread makes the same call. Only replay.c calls them
 * so; everything else calls them from Python threads, outside any region.
 */
#ifndef QOQSERVE_TEAM_H
#define QOQSERVE_TEAM_H
#include "thread_scratch.h"

typedef struct {
    int t, T;    /* this thread, of T */
    int joined;  /* 1: every thread of a running team called the kernel */
} team_t;

#ifdef _OPENMP
#include <omp.h>
#include <sched.h>

/* The barrier of a running team: one shared count and a generation, the
 * waiting threads spinning on the generation. A decode step meets ~9 times a
 * layer, and GNU OpenMP's barrier does more work per meeting than this one
 * (docs/runtime.md, "One team per step"). One per library (a static of this
 * header): replay.c runs one team at a time, every thread of it meets at
 * every one, and the count is back at 0 after each. */
static struct {
    _Alignas(64) int count;  /* threads arrived */
    _Alignas(64) int gen;    /* barriers completed */
} team_bar;

#if defined(__x86_64__) || defined(__i386__)
#define TEAM_PAUSE() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define TEAM_PAUSE() __asm__ __volatile__("yield")
#else
#define TEAM_PAUSE() do { } while (0)
#endif

/* spins before a waiting thread starts to yield its core (another thread of
 * the process may need it, e.g. the server's, while a team thread waits) */
enum { TEAM_SPINS = 4096 };

static inline void team_barrier(int T) {
    const int gen = __atomic_load_n(&team_bar.gen, __ATOMIC_ACQUIRE);
    if (__atomic_add_fetch(&team_bar.count, 1, __ATOMIC_ACQ_REL) == T) {
        __atomic_store_n(&team_bar.count, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&team_bar.gen, gen + 1, __ATOMIC_RELEASE);
        return;
    }
    for (int spins = 0; __atomic_load_n(&team_bar.gen, __ATOMIC_ACQUIRE) == gen; spins++) {
        if (spins < TEAM_SPINS) TEAM_PAUSE();
        else sched_yield();
    }
}

#define TEAM_SYNC(tm) do { \
        if ((tm).T > 1) { if ((tm).joined) team_barrier((tm).T); else { _Pragma("omp barrier") } } \
    } while (0)

/* the statement(s) after (threads, cond) run with `tm` in scope, on the
 * running team if there is one, else on a region of `threads` when cond */
#define TEAM_RUN(threads, cond, ...) do { \
        const int team_n_ = (threads) > 0 ? (threads) : 1, team_if_ = (cond); \
        if (omp_in_parallel()) { \
            const team_t tm = {omp_get_thread_num(), team_if_ ? omp_get_num_threads() : 1, 1}; \
            if (tm.t < tm.T) { __VA_ARGS__; } \
        } else { \
            _Pragma("omp parallel num_threads(team_n_) if (team_if_)") \
            { const team_t tm = {omp_get_thread_num(), omp_get_num_threads(), 0}; __VA_ARGS__; } \
        } \
    } while (0)

/* whether the caller is one of the threads of a running team (then every
 * thread of it makes this call) */
static inline int team_joined(void) { return omp_in_parallel(); }

/* *flag = 1 from any thread of a part (shared in the kernel's own region) */
static inline void team_fail(int *flag) {
    #pragma omp atomic write
    *flag = 1;
}
#else
static inline void team_fail(int *flag) { *flag = 1; }
#define TEAM_SYNC(tm) do { (void)(tm); } while (0)
#define TEAM_RUN(threads, cond, ...) do { \
        (void)(threads); (void)(cond); \
        const team_t tm = {0, 1, 0}; \
        __VA_ARGS__; \
    } while (0)
static inline int team_joined(void) { return 0; }
#endif

/* The pointer thread 0 has, for every thread: a buffer one thread makes and
 * all use. In its own region the kernel made it before the region and every
 * thread already has it; in a running team each thread called the kernel with
 * its own locals, so thread 0 publishes its pointer in `slot` (a static of the
 * kernel's library: replay.c runs one team at a time) and the team meets. */
static inline void *team_share(team_t tm, void *volatile *slot, void *mine) {
    if (!tm.joined || tm.T == 1) return mine;
    if (tm.t == 0) *slot = mine;
    TEAM_SYNC(tm);
    return *slot;
}

/* The scratch buffer every thread of a part works in: `made` where the
 * kernel opened its own region (made before it, so a failure returns early),
 * else thread 0's per-thread scratch (*tl of *tl_size, grown to `bytes`),
 * shared through `slot`. NULL when it could not be had: every thread then
 * sees NULL, and meets the others at the same barriers. */
static inline void *team_buffer(team_t tm, void *made, void *volatile *slot, void **tl, size_t *tl_size,
                                size_t bytes) {
    if (!tm.joined) return made;
    return team_share(tm, slot, tm.t == 0 ? grow_scratch(tl, tl_size, bytes) : NULL);
}
#endif
