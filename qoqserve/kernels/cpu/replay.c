/* A captured step's kernel calls replayed from C (kernels/cpu/graph.py): the
 * calls are recorded once with their arguments, so each becomes a prepared
 * libffi call, and a step costs one ctypes call instead of one per kernel
 * (a ctypes call converts and checks every argument: ~1-2 us for a
 * 16-argument kernel, ~300 calls a decode step).
 *
 * A plan holds, per call: the function, its libffi call interface and one
 * 8-byte slot per argument holding the argument's bits (little-endian, so
 * an int32 or a float sits in the slot's first bytes).
 *
 * Calls that can run inside a team and follow each other run in one OpenMP
 * region of the plan's team size, the team meeting at a barrier after each
 * call instead of each call forking and joining its own team: a team-aware
 * kernel (team.h) is called by every thread, a serial one (no OpenMP inside)
 * by thread 0. Other calls run from the calling thread alone, between such
 * regions, as before. The team meets at team.h's barrier, as the kernels'
 * parts do.
 *
 * A call that streams its weights from memory says which bytes (plan_stream:
 * the GEMMs, through their kernel's `streams` in Python). While a thread
 * waits at a barrier (the serial calls run on thread 0 alone; a team call's
 * threads rarely finish together) it fetches its share of the next such
 * calls' weights into its L2, up to half of it: the memory would otherwise
 * sit idle then, and the GEMM finds those lines in L2.
 */
#include <ffi.h>
#include <omp.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "team.h"

/* bytes a call reads once from memory (its weights), split between the team's
 * threads as the kernel splits its output columns */
typedef struct { const char *p; int64_t bytes; } span_t;
enum { MAX_SPANS = 2 };

typedef struct {
    void (*fn)(void);
    ffi_cif cif;
    ffi_type **types;
    void **values;
    int returns_int;
    char team;  /* 't': every thread of a running team makes it (team.h), 's': thread 0 of it, 0: no team */
    int nspans;
    span_t spans[MAX_SPANS];  /* the weights it streams from memory (plan_stream) */
} call_t;

typedef struct {
    int n;
    call_t *calls;
    uint64_t *slots;
    int team_size;  /* threads of the team regions; under 2: none */
    int *next_stream;  /* per call, the next call with spans (n: none) */
    int64_t *streamed;  /* [n + 1]: the span bytes of the calls before each */
} plan_t;

/* 0: the waits fetch nothing (scripts/team_ab.py prefetch compares both) */
int replay_prefetch = 1;

static ffi_type *type_of(char code) {
    switch (code) {
    case 'p': return &ffi_type_pointer;
    case 'i': return &ffi_type_sint32;
    case 'l': return &ffi_type_sint64;
    case 'f': return &ffi_type_float;
    case 'd': return &ffi_type_double;
    default: return NULL;
    }
}

void plan_free(plan_t *p) {
    if (!p) return;
    for (int i = 0; p->calls && i < p->n; i++) {
        free(p->calls[i].types);
        free(p->calls[i].values);
    }
    free(p->calls);
    free(p->slots);
    free(p->next_stream);
    free(p->streamed);
    free(p);
}

/* n calls: fns[i]; argument codes of call i in codes (nargs[i] characters
 * each, back to back, from 'p' 'i' 'l' 'f' 'd'); returns[i] 'i' (int) or 'v'
 * (void); team[i] 't' for a team-aware kernel, 's' for a serial one, else
 * '-'; bits: every call's argument slots back to back. NULL on a bad code or
 * out of memory. */
plan_t *plan_new(int n, void **fns, const char *codes, const int *nargs, const char *returns,
                 const char *team, int team_size, const uint64_t *bits) {
    plan_t *p = calloc(1, sizeof(plan_t));
    if (!p) return NULL;
    p->team_size = team_size;
    int64_t total = 0;
    for (int i = 0; i < n; i++) total += nargs[i];
    p->n = n;
    p->calls = calloc((size_t)n, sizeof(call_t));
    p->slots = malloc(sizeof(uint64_t) * (size_t)(total > 0 ? total : 1));
    p->next_stream = malloc(sizeof(int) * (size_t)(n > 0 ? n : 1));
    p->streamed = calloc((size_t)n + 1, sizeof(int64_t));
    if (!p->calls || !p->slots || !p->next_stream || !p->streamed) { plan_free(p); return NULL; }
    for (int i = 0; i < n; i++) p->next_stream[i] = n;
    memcpy(p->slots, bits, sizeof(uint64_t) * (size_t)total);
    int64_t at = 0;
    for (int i = 0; i < n; i++) {
        call_t *c = &p->calls[i];
        c->fn = (void (*)(void))fns[i];
        c->returns_int = returns[i] == 'i';
        c->team = team[i] == 't' || team[i] == 's' ? team[i] : 0;
        c->types = malloc(sizeof(ffi_type *) * (size_t)(nargs[i] > 0 ? nargs[i] : 1));
        c->values = malloc(sizeof(void *) * (size_t)(nargs[i] > 0 ? nargs[i] : 1));
        if (!c->types || !c->values || (returns[i] != 'i' && returns[i] != 'v')) { plan_free(p); return NULL; }
        for (int a = 0; a < nargs[i]; a++) {
            c->types[a] = type_of(codes[at + a]);
            if (!c->types[a]) { plan_free(p); return NULL; }
            c->values[a] = &p->slots[at + a];
        }
        if (ffi_prep_cif(&c->cif, FFI_DEFAULT_ABI, (unsigned)nargs[i],
                         c->returns_int ? &ffi_type_sint32 : &ffi_type_void, c->types) != FFI_OK) {
            plan_free(p);
            return NULL;
        }
        at += nargs[i];
    }
    return p;
}

/* Call i reads `bytes` at ptr once (its weights): a thread of the team that
 * waits at a barrier before it fetches its share of them into its L2 in the
 * meantime. Returns 0, or -1 (call out of range, or MAX_SPANS already). */
int plan_stream(plan_t *p, int i, const void *ptr, int64_t bytes) {
    if (i < 0 || i >= p->n || p->calls[i].nspans == MAX_SPANS || bytes <= 0) return -1;
    p->calls[i].spans[p->calls[i].nspans++] = (span_t){ptr, bytes};
    for (int k = i - 1; k >= 0 && p->next_stream[k] > i; k--) p->next_stream[k] = i;
    for (int k = i + 1; k <= p->n; k++) p->streamed[k] += bytes;
    return 0;
}

/* What a thread fetches while it waits: its share of the spans of the stream
 * calls ahead, one call after the other, as long as what it has fetched for
 * calls still to run stays under half its L2 (a stream call reads the lines
 * again, and more ahead would evict them before that). */
typedef struct {
    int call, n, s;  /* the call whose share it is fetching, its spans, the span at */
    const char *from[MAX_SPANS], *at[MAX_SPANS], *end[MAX_SPANS];
    int64_t left;  /* the bytes it may still fetch */
} fetch_t;

static int64_t fetch_budget(void) {
    static int64_t budget;  /* the same from every thread: a race only writes it twice */
    if (!budget) {
        const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
        budget = (l2 > 0 ? l2 : 1 << 20) / 2;
    }
    return budget;
}

static void fetch_call(fetch_t *f, const plan_t *p, int j, int t, int T) {
    f->call = j, f->s = 0;
    f->n = j < p->n ? p->calls[j].nspans : 0;
    for (int s = 0; s < f->n; s++) {
        const span_t sp = p->calls[j].spans[s];
        f->from[s] = f->at[s] = sp.p + (sp.bytes * t / T & ~(int64_t)63);
        f->end[s] = sp.p + sp.bytes * (t + 1) / T;
    }
}

/* after call i: go on with the call being fetched if it is still to run,
 * else start on the next stream call; the budget counts from there */
static void fetch_after(fetch_t *f, const plan_t *p, int i, int t, int T, int64_t budget) {
    if (f->call <= i) fetch_call(f, p, p->next_stream[i], t, T);
    f->left = budget - (p->streamed[f->call] - p->streamed[p->next_stream[i]]) / T;
    for (int s = 0; s < f->n; s++) f->left -= f->at[s] - f->from[s];
}

/* the next line to fetch, or NULL: none left within the budget */
static const char *fetch_next(fetch_t *f, const plan_t *p, int t, int T) {
    for (;;) {
        while (f->s < f->n && f->at[f->s] >= f->end[f->s]) f->s++;
        if (f->left <= 0) return NULL;
        if (f->s < f->n) {
            const char *line = f->at[f->s];
            f->at[f->s] += 64;
            f->left -= 64;
            return line;
        }
        if (f->call >= p->n || p->next_stream[f->call] >= p->n) return NULL;
        fetch_call(f, p, p->next_stream[f->call], t, T);
    }
}

/* team_barrier, the wait spent fetching lines (fetch_next) while any are left */
static void barrier_fetching(const plan_t *p, int t, int T, fetch_t *f) {
    const int gen = __atomic_load_n(&team_bar.gen, __ATOMIC_ACQUIRE);
    if (__atomic_add_fetch(&team_bar.count, 1, __ATOMIC_ACQ_REL) == T) {
        __atomic_store_n(&team_bar.count, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&team_bar.gen, gen + 1, __ATOMIC_RELEASE);
        return;
    }
    int more = 1;
    for (int spins = 0; __atomic_load_n(&team_bar.gen, __ATOMIC_ACQUIRE) == gen;) {
        const char *line = more ? fetch_next(f, p, t, T) : NULL;
        if (line) __builtin_prefetch(line, 0, 2);
        else if (more = 0, spins++ < TEAM_SPINS) TEAM_PAUSE();
        else sched_yield();
    }
}

/* What thread t of T fetches, with `budget` bytes, when it waits after each
 * of the calls after[0..steps-1] in turn and the team meets after at most
 * waits[k] lines there: the lines in order into out (up to max), their
 * number returned. The barrier's own walk, for the tests. */
int plan_fetch_walk(const plan_t *p, int t, int T, int64_t budget, const int *after, const int *waits, int steps,
                    const char **out, int max) {
    fetch_t f = {.call = -1};
    int n = 0;
    for (int k = 0; k < steps; k++) {
        fetch_after(&f, p, after[k], t, T, budget);
        const char *line;
        for (int w = 0; w < waits[k] && n < max && (line = fetch_next(&f, p, t, T)); w++) out[n++] = line;
    }
    return n;
}

static int failed(const call_t *c, ffi_arg rc) { return c->returns_int && (int32_t)rc != 0; }

/* Team regions share the kernels' team statics (team.h): one at a time. */
static pthread_mutex_t team_lock = PTHREAD_MUTEX_INITIALIZER;

/* Calls first..end-1, all team-aware or serial, on one team. Returns 0 or
 * 1 + the index of the first call that failed on some thread; the team
 * stops after it, every thread at the same barrier. */
static int run_team(const plan_t *p, int first, int end) {
    int failed_at = 0;  /* 1 + the first failed call */
    pthread_mutex_lock(&team_lock);
    #pragma omp parallel num_threads(p->team_size)
    {
    fetch_t f = {.call = -1};
    const int64_t budget = replay_prefetch ? fetch_budget() : 0;
    for (int i = first, team = omp_get_num_threads(); i < end; i++) {  /* the threads the region got */
        ffi_arg rc = 0;
        if (p->calls[i].team == 't' || omp_get_thread_num() == 0)
            ffi_call((ffi_cif *)&p->calls[i].cif, p->calls[i].fn, &rc, p->calls[i].values);
        if (failed(&p->calls[i], rc)) {
            #pragma omp critical(replay_failed)
            if (!failed_at || i + 1 < failed_at) failed_at = i + 1;
        }
        fetch_after(&f, p, i, omp_get_thread_num(), team, budget);
        barrier_fetching(p, omp_get_thread_num(), team, &f);
        int seen;
        #pragma omp atomic read
        seen = failed_at;
        /* only calls up to i can have failed by now: every thread stops here */
        if (seen && seen <= i + 1) break;
    }
    }
    pthread_mutex_unlock(&team_lock);
    return failed_at;
}

/* Every call in order. Returns 0, or 1 + the index of the first call that
 * returned nonzero (the calls after it are not made). */
int plan_run(const plan_t *p) {
    for (int i = 0; i < p->n;) {
        int end = i;
        while (p->team_size > 1 && end < p->n && p->calls[end].team) end++;
        if (end > i) {
            const int rc = run_team(p, i, end);
            if (rc) return rc;
            i = end;
            continue;
        }
        ffi_arg rc = 0;
        ffi_call((ffi_cif *)&p->calls[i].cif, p->calls[i].fn, &rc, p->calls[i].values);
        if (failed(&p->calls[i], rc)) return i + 1;
        i++;
    }
    return 0;
}

/* The plan n times in a row (a decode burst: the plan ends by feeding its
 * tokens back as its inputs). Returns 0, or what the first failed run did. */
int plan_run_times(const plan_t *p, int n) {
    for (int k = 0; k < n; k++) {
        const int rc = plan_run(p);
        if (rc) return rc;
    }
    return 0;
}
