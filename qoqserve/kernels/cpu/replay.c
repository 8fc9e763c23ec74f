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
 * A thread waiting at that barrier fetches what the next calls will read
 * (replay_fetch.h): its share of the next GEMMs' weights, attention's pages.
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
    void (*fetcher)(void);  /* called with its arguments by a thread waiting before it (plan_fetcher) */
} call_t;

typedef struct {
    int n;
    call_t *calls;
    uint64_t *slots;
    int team_size;  /* threads of the team regions; under 2: none */
    int *next_stream;  /* per call, the next call with spans (n: none) */
    int64_t *streamed;  /* [n + 1]: the span bytes of the calls before each */
} plan_t;

/* 1: waiting threads fetch (spans and fetchers); 2: spans only; 0: nothing
 * (scripts/team_ab.py prefetch compares the three) */
int replay_prefetch = 1;
long replay_fetchers_run;  /* fetchers called so far (the tests look) */

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

#include "replay_fetch.h"

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
    int fetched = -1;  /* the last call whose fetcher this thread ran */
    for (int i = first, team = omp_get_num_threads(); i < end; i++) {  /* the threads the region got */
        ffi_arg rc = 0;
        if (p->calls[i].team == 't' || omp_get_thread_num() == 0)
            ffi_call((ffi_cif *)&p->calls[i].cif, p->calls[i].fn, &rc, p->calls[i].values);
        if (failed(&p->calls[i], rc)) {
            #pragma omp critical(replay_failed)
            if (!failed_at || i + 1 < failed_at) failed_at = i + 1;
        }
        fetch_after(&f, p, i, omp_get_thread_num(), team, budget);
        const int fetch = replay_prefetch == 1 ? next_fetcher(p, i, end, fetched) : -1;
        if (barrier_fetching(p, omp_get_thread_num(), team, &f, fetch)) fetched = fetch;
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
