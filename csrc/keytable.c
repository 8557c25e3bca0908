/*
 * kvconnect._native.KeyTable: the master's key -> slot index without a Python object per key.
 *
 * Buckets are 8 bytes (32-bit hash tag, 32-bit slot) in one power-of-two array, probed
 * linearly; a key's home bucket is taken from its tag, so growth rehashes without reading a
 * key and deletion shifts the following run back (no tombstones: churn never lengthens probes).
 * Key bytes (UTF-8) live in one arena, found per slot by a packed (offset, length) word; a
 * removal leaves its bytes dead, and the arena is compacted once they pass half the live ones, so
 * puts and evictions forever keep memory bounded by the peak live set.
 *
 * get_many works in groups: hash every key and prefetch its bucket, then find each tag and
 * prefetch the slot's word, then prefetch the key bytes, then compare. The three cache misses
 * of a lookup at tens of millions of keys thus overlap across the group instead of adding up.
 * live_many adds one more stage, the slot's state and segment columns (the master's exists).
 * The GIL stays held: the master is single-threaded and every call is short.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#include "keytable.h"

#define EMPTY UINT32_MAX   /* bucket slot of an empty bucket */
#define MAX_SLOT (UINT32_MAX - 1)
#define ABSENT UINT64_MAX  /* place word of a slot without a key */
#define LEN_BITS 16
#define MAX_LEN ((1u << LEN_BITS) - 1)
#define GROUP 32           /* keys of get_many in flight at once */
#define MIN_BUCKETS 64
#define COMPACT_MIN 65536  /* dead arena bytes worth a compaction */

typedef struct {
    uint32_t tag;
    uint32_t slot;
} bucket;

typedef struct {
    PyObject_HEAD
    bucket *buckets;
    size_t mask;       /* bucket count - 1 */
    size_t count;      /* keys held */
    uint64_t *place;   /* per slot: offset << LEN_BITS | length, or ABSENT */
    size_t slots;      /* entries of place */
    unsigned char *arena;
    size_t used;       /* arena bytes written (live and dead) */
    size_t capacity;   /* arena bytes allocated */
    size_t dead;
    uint64_t seed;
} KeyTable;

/* ------------------------------------------------------------------------------- hashing */

static inline uint64_t mix(uint64_t a, uint64_t b) {
    __uint128_t r = (__uint128_t)a * b;
    return (uint64_t)r ^ (uint64_t)(r >> 64);
}

static inline uint64_t load64(const unsigned char *p) {
    uint64_t v;
    memcpy(&v, p, sizeof(v));
    return v;
}

/* Multiply-fold over 16-byte blocks, seeded per table so that keys built to collide on one
 * master do not collide on another. */
static uint64_t hash_bytes(const unsigned char *p, size_t n, uint64_t seed) {
    const uint64_t k0 = 0xa0761d6478bd642fULL, k1 = 0xe7037ed1a0b428dbULL;
    uint64_t h = mix(seed ^ k0, (uint64_t)n ^ k1);
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        h = mix(load64(p + i) ^ seed ^ k1, load64(p + i + 8) ^ h);
    }
    unsigned char tail[16] = {0};
    memcpy(tail, p + i, n - i);
    h = mix(load64(tail) ^ seed ^ k0, load64(tail + 8) ^ h ^ k1);
    return mix(h ^ k0, seed ^ (uint64_t)n);
}

static inline uint32_t tag_of(uint64_t h) { return (uint32_t)(h ^ (h >> 32)); }

/* ------------------------------------------------------------------------------- helpers */

static inline const unsigned char *key_at(const KeyTable *t, uint64_t place, size_t *len) {
    *len = (size_t)(place & MAX_LEN);
    return t->arena + (place >> LEN_BITS);
}

/* The UTF-8 of a str (borrowed from the str), or NULL with an exception set. */
static const unsigned char *utf8_of(PyObject *key, Py_ssize_t *len) {
    if (!PyUnicode_Check(key)) {
        PyErr_Format(PyExc_TypeError, "keys are str, not %.100s", Py_TYPE(key)->tp_name);
        return NULL;
    }
    return (const unsigned char *)PyUnicode_AsUTF8AndSize(key, len);
}

/* A lookup of a str that has no UTF-8 (a lone surrogate) finds nothing: such a key is never
 * added. Returns 1 when the key is usable, 0 when absent-by-encoding, -1 on a type error. */
static int lookup_bytes(PyObject *key, const unsigned char **bytes, Py_ssize_t *len) {
    *bytes = utf8_of(key, len);
    if (*bytes != NULL) {
        return 1;
    }
    if (PyErr_ExceptionMatches(PyExc_UnicodeEncodeError)) {
        PyErr_Clear();
        return 0;
    }
    return -1;
}

/* The bucket index holding the key, or SIZE_MAX; probing starts at bucket `from`. */
static size_t find_from(const KeyTable *t, size_t from, uint32_t tag, const unsigned char *key,
                        size_t len) {
    for (size_t i = from;; i = (i + 1) & t->mask) {
        bucket b = t->buckets[i];
        if (b.slot == EMPTY) {
            return SIZE_MAX;
        }
        if (b.tag == tag) {
            size_t have;
            const unsigned char *stored = key_at(t, t->place[b.slot], &have);
            if (have == len && memcmp(stored, key, len) == 0) {
                return i;
            }
        }
    }
}

static void insert_bucket(bucket *buckets, size_t mask, bucket b) {
    size_t i = b.tag & mask;
    while (buckets[i].slot != EMPTY) {
        i = (i + 1) & mask;
    }
    buckets[i] = b;
}

static bucket *new_buckets(size_t n) {
    bucket *buckets = PyMem_Malloc(n * sizeof(bucket));
    if (buckets != NULL) {
        memset(buckets, 0xff, n * sizeof(bucket)); /* every slot EMPTY */
    }
    return buckets;
}

/* Double the bucket array; tags give the home buckets, so no key is read. */
static int grow_buckets(KeyTable *t) {
    size_t n = (t->mask + 1) * 2;
    bucket *buckets = new_buckets(n);
    if (buckets == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (size_t i = 0; i <= t->mask; i++) {
        if (t->buckets[i].slot != EMPTY) {
            insert_bucket(buckets, n - 1, t->buckets[i]);
        }
    }
    PyMem_Free(t->buckets);
    t->buckets = buckets;
    t->mask = n - 1;
    return 0;
}

/* Copy the live keys into a right-sized arena, in slot order. */
static int compact_arena(KeyTable *t) {
    size_t live = t->used - t->dead;
    size_t capacity = live + live / 2 + 64;
    unsigned char *arena = PyMem_Malloc(capacity);
    if (arena == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    size_t at = 0;
    for (size_t s = 0; s < t->slots; s++) {
        if (t->place[s] == ABSENT) {
            continue;
        }
        size_t len;
        const unsigned char *key = key_at(t, t->place[s], &len);
        memcpy(arena + at, key, len);
        t->place[s] = ((uint64_t)at << LEN_BITS) | len;
        at += len;
    }
    PyMem_Free(t->arena);
    t->arena = arena;
    t->used = at;
    t->capacity = capacity;
    t->dead = 0;
    return 0;
}

static int reserve(void **array, size_t *have, size_t need, size_t item) {
    if (need <= *have) {
        return 0;
    }
    size_t n = *have ? *have : 64;
    while (n < need) {
        n *= 2;
    }
    void *grown = PyMem_Realloc(*array, n * item);
    if (grown == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    *array = grown;
    *have = n;
    return 0;
}

static int reserve_slots(KeyTable *t, size_t slot) {
    size_t old = t->slots;
    if (reserve((void **)&t->place, &t->slots, slot + 1, sizeof(uint64_t)) < 0) {
        return -1;
    }
    for (size_t s = old; s < t->slots; s++) {
        t->place[s] = ABSENT;
    }
    return 0;
}

/* ---------------------------------------------------------------------------------- type */

static PyObject *keytable_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *names[] = {"seed", NULL};
    unsigned long long seed = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|K", names, &seed)) {
        return NULL;
    }
    KeyTable *t = (KeyTable *)type->tp_alloc(type, 0);
    if (t == NULL) {
        return NULL;
    }
    t->seed = seed;
    t->buckets = new_buckets(MIN_BUCKETS);
    if (t->buckets == NULL) {
        Py_DECREF(t);
        return PyErr_NoMemory();
    }
    t->mask = MIN_BUCKETS - 1;
    return (PyObject *)t;
}

static void keytable_dealloc(KeyTable *t) {
    PyMem_Free(t->buckets);
    PyMem_Free(t->place);
    PyMem_Free(t->arena);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static Py_ssize_t keytable_len(KeyTable *t) { return (Py_ssize_t)t->count; }

static PyObject *keytable_get(KeyTable *t, PyObject *key) {
    const unsigned char *bytes;
    Py_ssize_t len;
    int usable = lookup_bytes(key, &bytes, &len);
    if (usable < 0) {
        return NULL;
    }
    if (usable) {
        uint32_t tag = tag_of(hash_bytes(bytes, (size_t)len, t->seed));
        size_t i = find_from(t, tag & t->mask, tag, bytes, (size_t)len);
        if (i != SIZE_MAX) {
            return PyLong_FromUnsignedLong(t->buckets[i].slot);
        }
    }
    return PyLong_FromLong(-1);
}

typedef struct {
    const unsigned char *bytes;
    size_t len;
    uint32_t tag;
    size_t at;     /* candidate bucket: first of the key's tag, or SIZE_MAX */
} pending;

/* Look up one group; every stage touches the next cache line of each key before any key
 * waits for it. Fills out[] with slots or -1; -1 return on a type error. */
static int lookup_group(const KeyTable *t, PyObject **keys, Py_ssize_t n, long *out) {
    pending p[GROUP];
    for (Py_ssize_t k = 0; k < n; k++) {
        Py_ssize_t len;
        int usable = lookup_bytes(keys[k], &p[k].bytes, &len);
        if (usable < 0) {
            return -1;
        }
        p[k].at = SIZE_MAX;
        out[k] = -1;
        if (!usable) {
            p[k].bytes = NULL;
            continue;
        }
        p[k].len = (size_t)len;
        p[k].tag = tag_of(hash_bytes(p[k].bytes, p[k].len, t->seed));
        __builtin_prefetch(&t->buckets[p[k].tag & t->mask]);
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        if (p[k].bytes == NULL) {
            continue;
        }
        for (size_t i = p[k].tag & t->mask; t->buckets[i].slot != EMPTY; i = (i + 1) & t->mask) {
            if (t->buckets[i].tag == p[k].tag) {
                p[k].at = i;
                __builtin_prefetch(&t->place[t->buckets[i].slot]);
                break;
            }
        }
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        if (p[k].at != SIZE_MAX) {
            __builtin_prefetch(t->arena + (t->place[t->buckets[p[k].at].slot] >> LEN_BITS));
        }
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        if (p[k].at != SIZE_MAX) {
            size_t i = find_from(t, p[k].at, p[k].tag, p[k].bytes, p[k].len);
            out[k] = i == SIZE_MAX ? -1 : (long)t->buckets[i].slot;
        }
    }
    return 0;
}

static PyObject *keytable_get_many(KeyTable *t, PyObject *seq) {
    PyObject *fast = PySequence_Fast(seq, "keys must be a sequence");
    if (fast == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **keys = PySequence_Fast_ITEMS(fast);
    PyObject *result = PyList_New(n);
    if (result == NULL) {
        Py_DECREF(fast);
        return NULL;
    }
    long out[GROUP];
    for (Py_ssize_t first = 0; first < n; first += GROUP) {
        Py_ssize_t count = n - first < GROUP ? n - first : GROUP;
        if (lookup_group(t, keys + first, count, out) < 0) {
            Py_DECREF(result);
            Py_DECREF(fast);
            return NULL;
        }
        for (Py_ssize_t k = 0; k < count; k++) {
            PyObject *slot = PyLong_FromLong(out[k]);
            if (slot == NULL) {
                Py_DECREF(result);
                Py_DECREF(fast);
                return NULL;
            }
            PyList_SET_ITEM(result, first + k, slot);
        }
    }
    Py_DECREF(fast);
    return result;
}

/* A C-contiguous buffer of `itemsize`-byte items of struct format `format`, or -1 with a
 * TypeError. */
static int column(PyObject *obj, Py_buffer *view, const char *format, Py_ssize_t itemsize,
                  const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
        return -1;
    }
    const char *have = view->format != NULL ? view->format : "B";
    if (view->itemsize != itemsize || strcmp(have, format) != 0) {
        PyErr_Format(PyExc_TypeError, "live_many: %s must hold '%s' items, not '%s'", name,
                     format, have);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* Classify one group's slots (out[]) against the columns; prefetches every slot's state and
 * segment before reading any, as lookup_group does for the index. */
static int classify_group(const long *out, Py_ssize_t n, const Py_buffer *state, long wanted,
                          const Py_buffer *segment, const Py_buffer *alive, PyObject **found) {
    const int8_t *states = state->buf;
    const int32_t *segments = segment->buf;
    const unsigned char *up = alive->buf;
    for (Py_ssize_t k = 0; k < n; k++) {
        if (out[k] >= 0 && out[k] < state->len && out[k] < segment->len / 4) {
            __builtin_prefetch(&states[out[k]]);
            __builtin_prefetch(&segments[out[k]]);
        }
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        long slot = out[k];
        if (slot < 0) {
            found[k] = Py_False;
            continue;
        }
        if (slot >= state->len || slot >= segment->len / 4) {
            PyErr_SetString(PyExc_IndexError, "live_many: a slot beyond the columns");
            return -1;
        }
        if (states[slot] != wanted) {
            found[k] = Py_False;
            continue;
        }
        int32_t at = segments[slot];
        if (at < 0 || at >= alive->len) {
            PyErr_SetString(PyExc_IndexError, "live_many: a segment beyond alive");
            return -1;
        }
        found[k] = up[at] ? Py_True : Py_None;
    }
    return 0;
}

static PyObject *keytable_live_many(KeyTable *t, PyObject *args) {
    PyObject *seq, *state_obj, *segment_obj, *alive_obj;
    long wanted;
    if (!PyArg_ParseTuple(args, "OOlOO", &seq, &state_obj, &wanted, &segment_obj, &alive_obj)) {
        return NULL;
    }
    Py_buffer state, segment, alive;
    if (column(state_obj, &state, "b", 1, "state") < 0) {
        return NULL;
    }
    if (column(segment_obj, &segment, "i", 4, "segment") < 0) {
        PyBuffer_Release(&state);
        return NULL;
    }
    if (column(alive_obj, &alive, "B", 1, "alive") < 0) {
        PyBuffer_Release(&segment);
        PyBuffer_Release(&state);
        return NULL;
    }
    PyObject *result = NULL;
    PyObject *fast = PySequence_Fast(seq, "keys must be a sequence");
    if (fast == NULL) {
        goto done;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **keys = PySequence_Fast_ITEMS(fast);
    result = PyList_New(n);
    if (result == NULL) {
        goto done;
    }
    long out[GROUP];
    PyObject *found[GROUP];
    for (Py_ssize_t first = 0; first < n; first += GROUP) {
        Py_ssize_t count = n - first < GROUP ? n - first : GROUP;
        if (lookup_group(t, keys + first, count, out) < 0 ||
            classify_group(out, count, &state, wanted, &segment, &alive, found) < 0) {
            Py_CLEAR(result);
            goto done;
        }
        for (Py_ssize_t k = 0; k < count; k++) {
            PyList_SET_ITEM(result, first + k, Py_NewRef(found[k]));
        }
    }
done:
    Py_XDECREF(fast);
    PyBuffer_Release(&alive);
    PyBuffer_Release(&segment);
    PyBuffer_Release(&state);
    return result;
}

static PyObject *keytable_add(KeyTable *t, PyObject *args) {
    PyObject *key;
    long long slot;
    if (!PyArg_ParseTuple(args, "UL", &key, &slot)) {
        return NULL;
    }
    Py_ssize_t len;
    const unsigned char *bytes = utf8_of(key, &len);
    if (bytes == NULL) {
        return NULL;
    }
    if (slot < 0 || slot > (long long)MAX_SLOT || (size_t)len > MAX_LEN) {
        PyErr_SetString(PyExc_ValueError, "KeyTable.add: slot or key length out of range");
        return NULL;
    }
    if (reserve_slots(t, (size_t)slot) < 0) {
        return NULL;
    }
    uint32_t tag = tag_of(hash_bytes(bytes, (size_t)len, t->seed));
    if (t->place[slot] != ABSENT ||
        find_from(t, tag & t->mask, tag, bytes, (size_t)len) != SIZE_MAX) {
        PyErr_SetString(PyExc_ValueError, "KeyTable.add: the key or the slot is taken");
        return NULL;
    }
    /* At most 3/4 full: linear probes stay short (about 2.5 buckets for a hit). */
    if ((t->count + 1) * 4 > (t->mask + 1) * 3 && grow_buckets(t) < 0) {
        return NULL;
    }
    if (reserve((void **)&t->arena, &t->capacity, t->used + (size_t)len, 1) < 0) {
        return NULL;
    }
    memcpy(t->arena + t->used, bytes, (size_t)len);
    t->place[slot] = ((uint64_t)t->used << LEN_BITS) | (uint64_t)len;
    t->used += (size_t)len;
    insert_bucket(t->buckets, t->mask, (bucket){.tag = tag, .slot = (uint32_t)slot});
    t->count++;
    Py_RETURN_NONE;
}

/* Empty bucket i and shift back the entries after it that probed past it. */
static void delete_bucket(KeyTable *t, size_t i) {
    size_t j = i;
    for (;;) {
        j = (j + 1) & t->mask;
        bucket b = t->buckets[j];
        if (b.slot == EMPTY) {
            break;
        }
        size_t home = b.tag & t->mask;
        /* b may fill the hole at i unless its home lies cyclically in (i, j]. */
        int stays = i <= j ? (home > i && home <= j) : (home > i || home <= j);
        if (!stays) {
            t->buckets[i] = b;
            i = j;
        }
    }
    t->buckets[i].slot = EMPTY;
}

/* The key of the slot `arg` names: 1 when it holds one (then `key`, `len` are set), 0 when
 * not (any other int), -1 on a type error. */
static int held_key(const KeyTable *t, PyObject *arg, long long *slot, const unsigned char **key,
                    size_t *len) {
    *slot = PyLong_AsLongLong(arg);
    if (*slot == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (*slot < 0 || (size_t)*slot >= t->slots || t->place[*slot] == ABSENT) {
        return 0;
    }
    *key = key_at(t, t->place[*slot], len);
    return 1;
}

static PyObject *keytable_remove(KeyTable *t, PyObject *arg) {
    long long slot;
    const unsigned char *key;
    size_t len;
    int held = held_key(t, arg, &slot, &key, &len);
    if (held <= 0) {
        return held < 0 ? NULL : Py_NewRef(Py_None);
    }
    uint32_t tag = tag_of(hash_bytes(key, len, t->seed));
    size_t i = tag & t->mask;
    while (t->buckets[i].slot != (uint32_t)slot) {
        i = (i + 1) & t->mask;
    }
    delete_bucket(t, i);
    t->place[slot] = ABSENT;
    t->count--;
    t->dead += len;
    /* Dead bytes up to half the live ones: the arena stays within 1.5x its keys. */
    if (t->dead >= COMPACT_MIN && t->dead * 2 > t->used - t->dead && compact_arena(t) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *keytable_key(KeyTable *t, PyObject *arg) {
    long long slot;
    const unsigned char *key;
    size_t len;
    if (held_key(t, arg, &slot, &key, &len) <= 0) {
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    }
    return PyUnicode_DecodeUTF8((const char *)key, (Py_ssize_t)len, "strict");
}

static PyObject *keytable_hash(KeyTable *t, PyObject *key) {
    Py_ssize_t len;
    const unsigned char *bytes = utf8_of(key, &len);
    if (bytes == NULL) {
        return NULL;
    }
    return PyLong_FromUnsignedLong(tag_of(hash_bytes(bytes, (size_t)len, t->seed)));
}

static PyObject *keytable_nbytes(KeyTable *t, void *closure) {
    (void)closure;
    size_t n = sizeof(*t) + (t->mask + 1) * sizeof(bucket) + t->slots * sizeof(uint64_t) +
               t->capacity;
    return PyLong_FromSize_t(n);
}

static PyMethodDef keytable_methods[] = {
    {"get", (PyCFunction)keytable_get, METH_O, "get(key) -> slot, or -1 if absent"},
    {"get_many", (PyCFunction)keytable_get_many, METH_O,
     "get_many(keys) -> [slot or -1], misses of the batch overlapped"},
    {"live_many", (PyCFunction)keytable_live_many, METH_VARARGS,
     "live_many(keys, state, wanted, segment, alive) -> [False if absent or state != wanted, "
     "else True if alive[segment[slot]], else None]"},
    {"add", (PyCFunction)keytable_add, METH_VARARGS,
     "add(key, slot): index an absent key at a free slot (ValueError otherwise)"},
    {"remove", (PyCFunction)keytable_remove, METH_O, "remove(slot): forget the slot's key"},
    {"key", (PyCFunction)keytable_key, METH_O, "key(slot) -> the slot's key, or None"},
    {"tag", (PyCFunction)keytable_hash, METH_O,
     "tag(key) -> the key's 32-bit hash tag under this table's seed (its home bucket is the "
     "tag's low bits)"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef keytable_getset[] = {
    {"nbytes", (getter)keytable_nbytes, NULL, "bytes of memory held (buckets, slots, arena)",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods keytable_sequence = {
    .sq_length = (lenfunc)keytable_len,
};

static PyTypeObject KeyTableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvconnect._native.KeyTable",
    .tp_doc = "KeyTable(seed=0): str key -> int slot, keys stored once as UTF-8 bytes.",
    .tp_basicsize = sizeof(KeyTable),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = keytable_new,
    .tp_dealloc = (destructor)keytable_dealloc,
    .tp_methods = keytable_methods,
    .tp_getset = keytable_getset,
    .tp_as_sequence = &keytable_sequence,
};

int keytable_register(PyObject *module) {
    if (PyType_Ready(&KeyTableType) < 0) {
        return -1;
    }
    Py_INCREF(&KeyTableType);
    if (PyModule_AddObject(module, "KeyTable", (PyObject *)&KeyTableType) < 0) {
        Py_DECREF(&KeyTableType);
        return -1;
    }
    return 0;
}
