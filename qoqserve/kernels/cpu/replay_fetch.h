/* What the threads of a replayed step's team do while they wait at its
 * barrier (included once by replay.c, after its plan types): fetch into
 * their L2 what the next calls will read. Each thread takes its share of the
 * weights the next GEMMs stream (plan_stream), up to half its L2 ahead, and
 * runs the fetcher of a call a few calls on once (plan_fetcher: attention's
 * pages, which only the call's current arguments say). The memory is idle
 * while a thread waits: the serial calls run on thread 0 alone, and a team
 * call's threads rarely finish together (docs/runtime.md). */
#ifndef QOQSERVE_REPLAY_FETCH_H
#define QOQSERVE_REPLAY_FETCH_H

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

/* Call i's fetcher: a function of the same signature that fetches what call
 * i will read (that only its arguments' current values say: attention's
 * pages); a thread of the team waiting at one of the FETCHER_AHEAD barriers
 * before call i calls it once. Returns 0, or -1 (call out of range). */
enum { FETCHER_AHEAD = 3 };
int plan_fetcher(plan_t *p, int i, void *fn) {
    if (i < 0 || i >= p->n) return -1;
    p->calls[i].fetcher = (void (*)(void))fn;
    return 0;
}

/* the call after `after` (and up to `end`, FETCHER_AHEAD on) whose fetcher
 * this thread has not run yet (past *done), or -1 */
static int next_fetcher(const plan_t *p, int after, int end, int done) {
    for (int j = after + 1; j < end && j <= after + FETCHER_AHEAD; j++)
        if (j > done && p->calls[j].fetcher) return j;
    return -1;
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

/* the first stream call after call i (i = -1: before the first call), or n */
static int stream_after(const plan_t *p, int i) {
    if (i >= 0) return p->next_stream[i];
    return p->n && !p->calls[0].nspans ? p->next_stream[0] : 0;
}

/* after call i: go on with the call being fetched if it is still to run,
 * else start on the next stream call; the budget counts from there */
static void fetch_after(fetch_t *f, const plan_t *p, int i, int t, int T, int64_t budget) {
    const int first = stream_after(p, i);
    if (f->call <= i) fetch_call(f, p, first, t, T);
    f->left = budget - (p->streamed[f->call] - p->streamed[first]) / T;
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

/* team_barrier, the wait spent first on call `fetch`'s fetcher (if not -1),
 * then fetching lines (fetch_next) while any are left. Returns whether it
 * ran the fetcher (the last thread to arrive waits for nothing). */
static int barrier_fetching(const plan_t *p, int t, int T, fetch_t *f, int fetch) {
    const int gen = __atomic_load_n(&team_bar.gen, __ATOMIC_ACQUIRE);
    if (__atomic_add_fetch(&team_bar.count, 1, __ATOMIC_ACQ_REL) == T) {
        __atomic_store_n(&team_bar.count, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&team_bar.gen, gen + 1, __ATOMIC_RELEASE);
        return 0;
    }
    if (fetch >= 0) {
        ffi_arg rc;
        ffi_call((ffi_cif *)&p->calls[fetch].cif, p->calls[fetch].fetcher, &rc, p->calls[fetch].values);
        __atomic_add_fetch(&replay_fetchers_run, 1, __ATOMIC_RELAXED);
    }
    int more = 1;
    for (int spins = 0; __atomic_load_n(&team_bar.gen, __ATOMIC_ACQUIRE) == gen;) {
        const char *line = more ? fetch_next(f, p, t, T) : NULL;
        if (line) __builtin_prefetch(line, 0, 2);
        else if (more = 0, spins++ < TEAM_SPINS) TEAM_PAUSE();
        else sched_yield();
    }
    return fetch >= 0;
}

/* What thread t of T fetches, with `budget` bytes, when it waits after each
 * of the calls after[0..steps-1] (-1: before the first) in turn and the team meets after at most
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

#endif
