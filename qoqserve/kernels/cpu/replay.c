/* A captured step's kernel calls replayed from C (kernels/cpu/graph.py): the
 * calls are recorded once with their arguments, so each becomes a prepared
 * libffi call, and a step costs one ctypes call instead of one per kernel
 * (a ctypes call converts and checks every argument: ~1-2 us for a
 * 16-argument kernel, ~300 calls a decode step).
 *
 * A plan holds, per call: the function, its libffi call interface and one
 * 8-byte slot per argument holding the argument's bits (little-endian, so
 * an int32 or a float sits in the slot's first bytes).
 */
#include <ffi.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    void (*fn)(void);
    ffi_cif cif;
    ffi_type **types;
    void **values;
    int returns_int;
} call_t;

typedef struct {
    int n;
    call_t *calls;
    uint64_t *slots;
} plan_t;

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
    free(p);
}

/* n calls: fns[i]; argument codes of call i in codes (nargs[i] characters
 * each, back to back, from 'p' 'i' 'l' 'f' 'd'); returns[i] 'i' (int) or 'v'
 * (void); bits: every call's argument slots back to back. NULL on a bad code
 * or out of memory. */
plan_t *plan_new(int n, void **fns, const char *codes, const int *nargs, const char *returns,
                 const uint64_t *bits) {
    plan_t *p = calloc(1, sizeof(plan_t));
    if (!p) return NULL;
    int64_t total = 0;
    for (int i = 0; i < n; i++) total += nargs[i];
    p->n = n;
    p->calls = calloc((size_t)n, sizeof(call_t));
    p->slots = malloc(sizeof(uint64_t) * (size_t)(total > 0 ? total : 1));
    if (!p->calls || !p->slots) { plan_free(p); return NULL; }
    memcpy(p->slots, bits, sizeof(uint64_t) * (size_t)total);
    int64_t at = 0;
    for (int i = 0; i < n; i++) {
        call_t *c = &p->calls[i];
        c->fn = (void (*)(void))fns[i];
        c->returns_int = returns[i] == 'i';
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

/* Every call in order. Returns 0, or 1 + the index of the first call that
 * returned nonzero (the calls after it are not made). */
int plan_run(const plan_t *p) {
    for (int i = 0; i < p->n; i++) {
        ffi_arg rc = 0;
        ffi_call((ffi_cif *)&p->calls[i].cif, p->calls[i].fn, &rc, p->calls[i].values);
        if (p->calls[i].returns_int && (int32_t)rc != 0) return i + 1;
    }
    return 0;
}
