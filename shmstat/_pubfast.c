/* Optional C publish path: ``Outbox``, the publisher's bounded, batched, already-encoded backlog, and
 * ``check_data``, the fast path of ``Event``'s data check. ``shmstat/outbox.py`` is the pure-Python twin of
 * ``Outbox`` (``SHMSTAT_PURE_PYTHON=1`` or no compiler) and the reference for its behaviour; both must put the
 * same bytes on the wire (tests/test_outbox.py checks that on random input).
 *
 * Callers (``log_event``, ``put_metric``) encode their item here, under the GIL, straight into the msgpack bytes
 * the wire carries, and add it to the open batch of its topic; the publisher thread only seals whole batches
 * (header + array header + items) and sends them. Items this fast path does not handle (subclasses of the scalar
 * types, ints past 64 bits, strings that are not valid UTF-8, ...) make ``event``/``metric`` return -1: the
 * Python caller then validates and encodes them the slow way and hands the bytes to ``raw`` (or ``invalid``).
 * Nothing here calls back into Python code, so every method is atomic with respect to other threads.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <datetime.h>
#include <structmember.h>

#include <stdint.h>
#include <string.h>

#define MAX_OPEN 16
#define K_EVENT 0
#define K_METRIC 1
#define K_STAT 2
#define K_RANK 3
#define K_GAP (-1)

static const char *KIND_NAMES[4] = {"event", "metric", "stat", "rank"};

/* ------------------------------------------------------------------------------------------ byte buffer */

typedef struct {
    char *p;
    Py_ssize_t len, cap;
} Buf;

static int
buf_grow(Buf *b, Py_ssize_t extra)
{
    Py_ssize_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + extra) {
        cap *= 2;
    }
    char *p = PyMem_Realloc(b->p, (size_t)cap);
    if (p == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    b->p = p;
    b->cap = cap;
    return 0;
}

static inline int
buf_reserve(Buf *b, Py_ssize_t extra)
{
    return b->len + extra <= b->cap ? 0 : buf_grow(b, extra);
}

static inline void
put_be(char *p, uint64_t v, int n)
{
    for (int i = n - 1; i >= 0; i--) {
        p[i] = (char)(v & 0xff);
        v >>= 8;
    }
}

/* The msgpack encodings below are the ones msgpack-python's Packer(use_bin_type=True) writes. */

static int
pk_i64(Buf *b, long long x)
{
    if (buf_reserve(b, 9) < 0) return -1;
    char *p = b->p + b->len;
    if (x >= 0) {
        uint64_t u = (uint64_t)x;
        if (u < 128) { p[0] = (char)u; b->len += 1; }
        else if (u < 256) { p[0] = (char)0xcc; put_be(p + 1, u, 1); b->len += 2; }
        else if (u < 65536) { p[0] = (char)0xcd; put_be(p + 1, u, 2); b->len += 3; }
        else if (u <= 0xffffffffULL) { p[0] = (char)0xce; put_be(p + 1, u, 4); b->len += 5; }
        else { p[0] = (char)0xcf; put_be(p + 1, u, 8); b->len += 9; }
    }
    else if (x >= -32) { p[0] = (char)(int8_t)x; b->len += 1; }
    else if (x >= -128) { p[0] = (char)0xd0; put_be(p + 1, (uint64_t)x, 1); b->len += 2; }
    else if (x >= -32768) { p[0] = (char)0xd1; put_be(p + 1, (uint64_t)x, 2); b->len += 3; }
    else if (x >= -2147483648LL) { p[0] = (char)0xd2; put_be(p + 1, (uint64_t)x, 4); b->len += 5; }
    else { p[0] = (char)0xd3; put_be(p + 1, (uint64_t)x, 8); b->len += 9; }
    return 0;
}

static int
pk_u64(Buf *b, unsigned long long u)
{
    if (u <= (unsigned long long)INT64_MAX) return pk_i64(b, (long long)u);
    if (buf_reserve(b, 9) < 0) return -1;
    b->p[b->len] = (char)0xcf;
    put_be(b->p + b->len + 1, u, 8);
    b->len += 9;
    return 0;
}

static int
pk_f64(Buf *b, double d)
{
    if (buf_reserve(b, 9) < 0) return -1;
    uint64_t u;
    memcpy(&u, &d, 8);
    b->p[b->len] = (char)0xcb;
    put_be(b->p + b->len + 1, u, 8);
    b->len += 9;
    return 0;
}

static int
pk_hdr(Buf *b, Py_ssize_t n, int fix, int fixmax, int c16, int c32)
{
    if (buf_reserve(b, 5) < 0) return -1;
    char *p = b->p + b->len;
    if (n < fixmax) { p[0] = (char)(fix | (int)n); b->len += 1; }
    else if (c16 == 0xd9 && n < 256) { p[0] = (char)0xd9; put_be(p + 1, (uint64_t)n, 1); b->len += 2; }
    else if (n < 65536) { p[0] = (char)(c16 == 0xd9 ? 0xda : c16); put_be(p + 1, (uint64_t)n, 2); b->len += 3; }
    else { p[0] = (char)c32; put_be(p + 1, (uint64_t)n, 4); b->len += 5; }
    return 0;
}

#define pk_array(b, n) pk_hdr((b), (n), 0x90, 16, 0xdc, 0xdd)
#define pk_map(b, n) pk_hdr((b), (n), 0x80, 16, 0xde, 0xdf)

/* 1 ok, 0 not handled here (the caller falls back to Python), -1 error set. ``*n8`` gets the UTF-8 length. */
static int
pk_str(Buf *b, PyObject *s, Py_ssize_t *n8)
{
    Py_ssize_t n;
    const char *u;
    if (PyUnicode_IS_COMPACT_ASCII(s)) {  /* the common case: the characters are the UTF-8 bytes */
        n = PyUnicode_GET_LENGTH(s);
        if (n < 32 && b->len + n + 1 <= b->cap) {
            char *p = b->p + b->len;
            p[0] = (char)(0xa0 | (int)n);
            memcpy(p + 1, PyUnicode_1BYTE_DATA(s), (size_t)n);
            b->len += n + 1;
            if (n8) *n8 = n;
            return 1;
        }
        u = (const char *)PyUnicode_1BYTE_DATA(s);
    }
    else u = PyUnicode_AsUTF8AndSize(s, &n);
    if (u == NULL) {
        if (PyErr_ExceptionMatches(PyExc_UnicodeEncodeError)) {
            PyErr_Clear();
            return 0;
        }
        return -1;
    }
    if (n > 0xffffffffLL) return 0;
    if (pk_hdr(b, n, 0xa0, 32, 0xd9, 0xdb) < 0 || buf_reserve(b, n) < 0) return -1;
    memcpy(b->p + b->len, u, (size_t)n);
    b->len += n;
    if (n8) *n8 = n;
    return 1;
}

/* A scalar of exactly bool/int/float (and str when ``allow_str``): 1 ok, 0 not handled, -1 error. */
static int
pk_scalar(Buf *b, PyObject *v, int allow_str, Py_ssize_t *strlen8)
{
    PyTypeObject *t = Py_TYPE(v);
    if (t == &PyUnicode_Type) {
        return allow_str ? pk_str(b, v, strlen8) : 0;
    }
    if (t == &PyFloat_Type) {
        return pk_f64(b, PyFloat_AS_DOUBLE(v)) < 0 ? -1 : 1;
    }
    if (t == &PyBool_Type) {
        if (buf_reserve(b, 1) < 0) return -1;
        b->p[b->len++] = (char)(v == Py_True ? 0xc3 : 0xc2);
        return 1;
    }
    if (t == &PyLong_Type) {
        int overflow = 0;
        long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (overflow == 0) {
            if (x == -1 && PyErr_Occurred()) return -1;
            return pk_i64(b, x) < 0 ? -1 : 1;
        }
        if (overflow < 0) return 0;
        unsigned long long u = PyLong_AsUnsignedLongLong(v);
        if (u == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            return 0;
        }
        return pk_u64(b, u) < 0 ? -1 : 1;
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------ Outbox */

typedef struct Chunk {
    struct Chunk *next;
    int kind;               /* K_EVENT.., or K_GAP */
    PyObject *key1, *key2;  /* event: name; metric: group, name; stat/rank: topic (owned references) */
    long long taken;        /* publish index of the first item */
    long long n;            /* items (or dropped items for a gap) */
    long long nbytes;       /* estimated bytes (item_bytes / METRIC_BYTES) */
    Buf buf;                /* the encoded items */
    PyObject *frames;       /* (topic, payload) once sealed */
} Chunk;

typedef struct {
    PyObject_HEAD
    long long rank, pid, incarnation;
    long long batch_max, max_items, max_bytes, max_batch_bytes, metric_bytes;
    Chunk *head, *tail;
    Chunk *open[MAX_OPEN];
    int nopen;
    int open_kind;
    long long index;        /* publish calls so far (accepted, refused or invalid) */
    long long held, held_bytes;
    long long wire_seq;     /* the next sequence number on the wire */
    long long sent_items, sent_messages, dropped, invalid, late;
    int closed;
    Buf scratch;
} Outbox;

static void
chunk_free(Chunk *c)
{
    Py_XDECREF(c->key1);
    Py_XDECREF(c->key2);
    Py_XDECREF(c->frames);
    PyMem_Free(c->buf.p);
    PyMem_Free(c);
}

static void
forget_open(Outbox *self)
{
    self->nopen = 0;
    self->open_kind = K_GAP;
}

static int
add_gap(Outbox *self, long long n)
{
    Chunk *t = self->tail;
    forget_open(self);
    self->dropped += n;
    self->index += n;
    if (t != NULL && t->kind == K_GAP) {
        t->n += n;
        return 0;
    }
    Chunk *c = PyMem_Calloc(1, sizeof(Chunk));
    if (c == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    c->kind = K_GAP;
    c->taken = self->index - n;
    c->n = n;
    if (t == NULL) self->head = c; else t->next = c;
    self->tail = c;
    return 0;
}

static int
same_key(PyObject *a, PyObject *b)
{
    if (a == b) return 1;
    if (a == NULL || b == NULL) return 0;
    return PyUnicode_Compare(a, b) == 0;  /* compares contents; never calls Python code */
}

/* Add the item encoded in self->scratch to the open batch of its topic (or a new one). */
static int
add_item(Outbox *self, int kind, PyObject *key1, PyObject *key2, long long size)
{
    if (self->held >= self->max_items || self->held_bytes + size > self->max_bytes) {
        return add_gap(self, 1);
    }
    Py_ssize_t len = self->scratch.len;
    Chunk *c = NULL;
    if (self->open_kind == kind) {
        for (int i = 0; i < self->nopen; i++) {
            Chunk *o = self->open[i];
            if (same_key(o->key1, key1) && same_key(o->key2, key2)) {
                if (o->frames == NULL && o->n < self->batch_max && o->buf.len + len <= self->max_batch_bytes) {
                    c = o;
                } else {  /* full or sealed: a new batch of this topic replaces it in the open set */
                    self->open[i] = self->open[--self->nopen];
                }
                break;
            }
        }
        if (PyErr_Occurred()) return -1;
    }
    if (c == NULL) {
        c = PyMem_Calloc(1, sizeof(Chunk));
        if (c == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        c->kind = kind;
        Py_XINCREF(key1);
        Py_XINCREF(key2);
        c->key1 = key1;
        c->key2 = key2;
        c->taken = self->index;
        if (self->tail == NULL) self->head = c; else self->tail->next = c;
        self->tail = c;
        if (self->open_kind != kind || self->nopen >= MAX_OPEN) {
            forget_open(self);
            self->open_kind = kind;
        }
        self->open[self->nopen++] = c;
    }
    if (buf_reserve(&c->buf, len) < 0) return -1;
    memcpy(c->buf.p + c->buf.len, self->scratch.p, (size_t)len);
    c->buf.len += len;
    c->n += 1;
    c->nbytes += size;
    self->held += 1;
    self->held_bytes += size;
    self->index += 1;
    return 0;
}

/* Encode and queue an event: its size (as item_bytes estimates it, or ``size`` if given) once queued (or when over
 * ``limit`` > 0: not queued), 0 once the outbox is closed, -1 when the fast encoder declines it, -2 on error. */
static long long
outbox_event(Outbox *self, PyObject *name, PyObject *ts, PyObject *data, long long size, long long limit)
{
    if (self->closed) {
        self->late += 1;
        return 0;
    }
    if (!PyUnicode_CheckExact(name) || !PyDict_CheckExact(data) || Py_TYPE(ts) != &PyLong_Type) return -1;
    Buf *b = &self->scratch;
    b->len = 0;
    int r;
    Py_ssize_t name8 = 0;
    if (buf_reserve(b, 64) < 0) return -2;
    b->p[b->len++] = (char)0x93;
    if ((r = pk_str(b, name, &name8)) != 1) goto fallback;
    if ((r = pk_scalar(b, ts, 0, NULL)) != 1) goto fallback;
    Py_ssize_t nd = PyDict_GET_SIZE(data);
    if (pk_map(b, nd) < 0) return -2;
    /* item_bytes(): 128 + len(name) + 16 * len(data) + sum(len(key)) + sum(len(str value)) in code points,
     * recounted in UTF-8 bytes past 4096 */
    long long est = 128 + PyUnicode_GET_LENGTH(name) + 16 * (long long)nd, est8 = 128 + name8 + 16 * (long long)nd;
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    while (PyDict_Next(data, &pos, &k, &v)) {
        Py_ssize_t k8 = 0, v8 = 0;
        if (!PyUnicode_CheckExact(k)) { r = 0; goto fallback; }
        if ((r = pk_str(b, k, &k8)) != 1) goto fallback;
        if ((r = pk_scalar(b, v, 1, &v8)) != 1) goto fallback;
        est += PyUnicode_GET_LENGTH(k);
        est8 += k8;
        if (Py_TYPE(v) == &PyUnicode_Type) {
            est += PyUnicode_GET_LENGTH(v);
            est8 += v8;
        }
    }
    if (est > 4096) est = est8;
    if (size <= 0) size = est;
    if (limit > 0 && size > limit) return size;
    if (add_item(self, K_EVENT, name, NULL, size) < 0) return -2;
    return size;
fallback:
    return r < 0 ? -2 : -1;
}

static PyObject *
Outbox_event(Outbox *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 3 || nargs > 5) {
        PyErr_SetString(PyExc_TypeError, "event(name, ts_ns, data, size=0, limit=0)");
        return NULL;
    }
    long long size = 0, limit = 0;
    if (nargs > 3 && ((size = PyLong_AsLongLong(args[3])) == -1 && PyErr_Occurred())) return NULL;
    if (nargs > 4 && ((limit = PyLong_AsLongLong(args[4])) == -1 && PyErr_Occurred())) return NULL;
    long long res = outbox_event(self, args[0], args[1], args[2], size, limit);
    return res == -2 ? NULL : PyLong_FromLongLong(res);
}

static PyObject *
Outbox_metric(Outbox *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "metric(group, name, value, ts)");
        return NULL;
    }
    if (self->closed) {
        self->late += 1;
        Py_RETURN_NONE;
    }
    PyObject *group = args[0], *name = args[1], *value = args[2], *ts = args[3];
    PyTypeObject *tt = Py_TYPE(ts);
    if (!PyUnicode_CheckExact(group) || !PyUnicode_CheckExact(name) || Py_TYPE(value) == &PyUnicode_Type
        || (tt != &PyFloat_Type && tt != &PyLong_Type)) {
        return PyLong_FromLong(-1);
    }
    Buf *b = &self->scratch;
    b->len = 0;
    int r;
    if (buf_reserve(b, 1) < 0) return NULL;
    b->p[b->len++] = (char)0x94;
    if ((r = pk_str(b, group, NULL)) != 1 || (r = pk_str(b, name, NULL)) != 1
        || (r = pk_scalar(b, value, 0, NULL)) != 1 || (r = pk_scalar(b, ts, 0, NULL)) != 1) {
        if (r < 0) return NULL;
        return PyLong_FromLong(-1);
    }
    if (add_item(self, K_METRIC, group, name, self->metric_bytes) < 0) return NULL;
    Py_RETURN_NONE;
}

/* raw(kind, key1, key2, encoded, size): an item validated and encoded by the caller (the slow path). */
static PyObject *
Outbox_raw(Outbox *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5 || !PyLong_Check(args[0]) || !PyBytes_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "raw(kind: int, key1, key2, encoded: bytes, size: int)");
        return NULL;
    }
    if (self->closed) {
        self->late += 1;
        Py_RETURN_NONE;
    }
    long kind = PyLong_AsLong(args[0]);
    long long size = PyLong_AsLongLong(args[4]);
    if (PyErr_Occurred()) return NULL;
    if (kind < 0 || kind > 3) {
        PyErr_SetString(PyExc_ValueError, "raw: kind must be 0..3");
        return NULL;
    }
    PyObject *k1 = args[1] == Py_None ? NULL : args[1], *k2 = args[2] == Py_None ? NULL : args[2];
    if ((k1 != NULL && !PyUnicode_Check(k1)) || (k2 != NULL && !PyUnicode_Check(k2))) {
        PyErr_SetString(PyExc_TypeError, "raw: keys must be str or None");
        return NULL;
    }
    Buf *b = &self->scratch;
    b->len = 0;
    Py_ssize_t n = PyBytes_GET_SIZE(args[3]);
    if (buf_reserve(b, n) < 0) return NULL;
    memcpy(b->p, PyBytes_AS_STRING(args[3]), (size_t)n);
    b->len = n;
    if (add_item(self, (int)kind, k1, k2, size) < 0) return NULL;
    Py_RETURN_NONE;
}

/* invalid(n=1): n items that cannot be sent were published here: dropped, counted, numbered. */
static PyObject *
Outbox_invalid(Outbox *self, PyObject *const *args, Py_ssize_t nargs)
{
    long long n = 1;
    if (nargs > 0 && ((n = PyLong_AsLongLong(args[0])) == -1 && PyErr_Occurred())) return NULL;
    if (self->closed) {
        self->late += n;
        Py_RETURN_NONE;
    }
    self->invalid += n;
    if (add_gap(self, n) < 0) return NULL;
    Py_RETURN_NONE;
}

/* refused(n=1): n items refused (over a bound) by the caller: dropped, counted, numbered. */
static PyObject *
Outbox_refused(Outbox *self, PyObject *const *args, Py_ssize_t nargs)
{
    long long n = 1;
    if (nargs > 0 && ((n = PyLong_AsLongLong(args[0])) == -1 && PyErr_Occurred())) return NULL;
    if (self->closed) {
        self->late += n;
        Py_RETURN_NONE;
    }
    if (add_gap(self, n) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *
topic_of(Chunk *c)
{
    if (c->kind == K_EVENT) return PyUnicode_FromFormat("event/%U", c->key1);
    if (c->kind == K_METRIC) return PyUnicode_FromFormat("metric/%U/%U", c->key1, c->key2);
    Py_INCREF(c->key1);
    return c->key1;
}

static void
pop_head(Outbox *self)
{
    Chunk *c = self->head;
    self->head = c->next;
    if (self->head == NULL) self->tail = NULL;
    for (int i = 0; i < self->nopen; i++) {
        if (self->open[i] == c) {
            self->open[i] = self->open[--self->nopen];
            break;
        }
    }
    chunk_free(c);
}

static int
pk_key(Buf *b, const char *k)
{
    size_t n = strlen(k);
    if (buf_reserve(b, (Py_ssize_t)n + 1) < 0) return -1;
    b->p[b->len++] = (char)(0xa0 | (int)n);
    memcpy(b->p + b->len, k, n);
    b->len += (Py_ssize_t)n;
    return 0;
}

/* head(max_topic): the frames of the first batch, sealed (numbered) now if it was not; None if nothing is held.
 * Gaps at the head are skipped (their sequence numbers consumed); a batch whose topic cannot be sent is given
 * up (counted as invalid). The batch stays at the head until pop(). */
static PyObject *
Outbox_head(Outbox *self, PyObject *arg)
{
    Py_ssize_t max_topic = PyLong_AsSsize_t(arg);
    if (max_topic == -1 && PyErr_Occurred()) return NULL;
    for (;;) {
        Chunk *c = self->head;
        if (c == NULL) Py_RETURN_NONE;
        if (c->kind == K_GAP) {
            self->wire_seq += c->n;
            pop_head(self);
            continue;
        }
        if (c->frames != NULL) {
            Py_INCREF(c->frames);
            return c->frames;
        }
        long long first = self->wire_seq;
        self->wire_seq += c->n;
        PyObject *topic = topic_of(c);
        if (topic == NULL) return NULL;
        PyObject *tb = PyUnicode_AsEncodedString(topic, "utf-8", "strict");
        Py_DECREF(topic);
        if (tb == NULL || PyBytes_GET_SIZE(tb) == 0 || PyBytes_GET_SIZE(tb) > max_topic) {
            if (tb == NULL) {
                if (!PyErr_ExceptionMatches(PyExc_UnicodeEncodeError)) return NULL;
                PyErr_Clear();
            }
            Py_XDECREF(tb);
            self->held -= c->n;
            self->held_bytes -= c->nbytes;
            self->dropped += c->n;
            self->invalid += c->n;
            pop_head(self);
            continue;
        }
        Buf h = {NULL, 0, 0};
        const char *kind = KIND_NAMES[c->kind];
        if (buf_reserve(&h, 64 + c->buf.len) < 0) goto fail;
        h.p[h.len++] = (char)0x87;
        if (pk_key(&h, "v") < 0 || pk_i64(&h, 1) < 0 || pk_key(&h, "k") < 0 || pk_key(&h, kind) < 0
            || pk_key(&h, "r") < 0 || pk_i64(&h, self->rank) < 0 || pk_key(&h, "p") < 0
            || pk_i64(&h, self->pid) < 0 || pk_key(&h, "i") < 0 || pk_i64(&h, self->incarnation) < 0
            || pk_key(&h, "s") < 0 || pk_i64(&h, first) < 0 || pk_key(&h, "items") < 0
            || pk_array(&h, (Py_ssize_t)c->n) < 0 || buf_reserve(&h, c->buf.len) < 0) {
            goto fail;
        }
        memcpy(h.p + h.len, c->buf.p, (size_t)c->buf.len);
        h.len += c->buf.len;
        PyObject *payload = PyBytes_FromStringAndSize(h.p, h.len);
        PyMem_Free(h.p);
        if (payload == NULL) {
            Py_DECREF(tb);
            return NULL;
        }
        c->frames = PyTuple_Pack(2, tb, payload);
        Py_DECREF(tb);
        Py_DECREF(payload);
        if (c->frames == NULL) return NULL;
        PyMem_Free(c->buf.p);  /* the payload holds them now */
        c->buf.p = NULL;
        c->buf.len = c->buf.cap = 0;
        Py_INCREF(c->frames);
        return c->frames;
    fail:
        PyMem_Free(h.p);
        Py_DECREF(tb);
        return NULL;
    }
}

/* pop(): the head batch (returned by head()) was handed to zmq. */
static PyObject *
Outbox_pop(Outbox *self, PyObject *Py_UNUSED(ignored))
{
    Chunk *c = self->head;
    if (c == NULL || c->frames == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "pop() without a sealed head batch");
        return NULL;
    }
    self->held -= c->n;
    self->held_bytes -= c->nbytes;
    self->sent_items += c->n;
    self->sent_messages += 1;
    pop_head(self);
    Py_RETURN_NONE;
}

/* drop_all(): give up everything held (closing); returns the sequence number after the dropped items. */
static PyObject *
Outbox_drop_all(Outbox *self, PyObject *Py_UNUSED(ignored))
{
    long long seq = self->wire_seq;
    while (self->head != NULL) {
        Chunk *c = self->head;
        if (c->kind == K_GAP) {
            seq += c->n;
        } else {
            if (c->frames == NULL) seq += c->n;
            self->dropped += c->n;
        }
        pop_head(self);
    }
    self->held = self->held_bytes = 0;
    forget_open(self);
    return PyLong_FromLongLong(seq);
}

static PyObject *
Outbox_end_seq(Outbox *self, PyObject *Py_UNUSED(ignored))
{
    long long seq = self->wire_seq;
    for (Chunk *c = self->head; c != NULL; c = c->next) {
        if (c->frames == NULL) seq += c->n;
    }
    return PyLong_FromLongLong(seq);
}

static PyObject *
Outbox_wire_seq(Outbox *self, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromLongLong(self->wire_seq);
}

static PyObject *
Outbox_close(Outbox *self, PyObject *Py_UNUSED(ignored))
{
    self->closed = 1;
    Py_RETURN_NONE;
}

/* frontier(): the publish index of the first item still held (every earlier one was sent or dropped). */
static PyObject *
Outbox_frontier(Outbox *self, PyObject *Py_UNUSED(ignored))
{
    Chunk *c = self->head;
    while (c != NULL && c->kind == K_GAP) c = c->next;
    return PyLong_FromLongLong(c != NULL ? c->taken : self->index);
}

/* counters(): (index, sent_items, sent_messages, dropped, held, held_bytes, invalid, late). */
static PyObject *
Outbox_counters(Outbox *self, PyObject *Py_UNUSED(ignored))
{
    return Py_BuildValue("(LLLLLLLL)", self->index, self->sent_items, self->sent_messages, self->dropped,
                         self->held, self->held_bytes, self->invalid, self->late);
}

static int
Outbox_init(Outbox *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"rank", "pid", "incarnation", "batch_max", "max_items", "max_bytes",
                             "max_batch_bytes", "metric_bytes", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "LLLLLLLL", kwlist, &self->rank, &self->pid, &self->incarnation,
                                     &self->batch_max, &self->max_items, &self->max_bytes,
                                     &self->max_batch_bytes, &self->metric_bytes)) {
        return -1;
    }
    self->open_kind = K_GAP;
    return 0;
}

static void
Outbox_dealloc(Outbox *self)
{
    while (self->head != NULL) {
        Chunk *c = self->head;
        self->head = c->next;
        chunk_free(c);
    }
    PyMem_Free(self->scratch.p);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Outbox_log(Outbox *self, PyObject *const *args, Py_ssize_t nargs);

static PyMethodDef Outbox_methods[] = {
    {"event", (PyCFunction)(void (*)(void))Outbox_event, METH_FASTCALL, "Publish an event; see outbox.py."},
    {"log", (PyCFunction)(void (*)(void))Outbox_log, METH_FASTCALL, "Publish an Event object; see below."},
    {"metric", (PyCFunction)(void (*)(void))Outbox_metric, METH_FASTCALL, "Publish a metric; see outbox.py."},
    {"raw", (PyCFunction)(void (*)(void))Outbox_raw, METH_FASTCALL, "Publish an encoded item; see outbox.py."},
    {"invalid", (PyCFunction)(void (*)(void))Outbox_invalid, METH_FASTCALL, "Count unsendable items."},
    {"refused", (PyCFunction)(void (*)(void))Outbox_refused, METH_FASTCALL, "Count refused items."},
    {"head", (PyCFunction)Outbox_head, METH_O, "The first batch's frames, sealed."},
    {"pop", (PyCFunction)Outbox_pop, METH_NOARGS, "The head batch was sent."},
    {"drop_all", (PyCFunction)Outbox_drop_all, METH_NOARGS, "Give up everything held."},
    {"end_seq", (PyCFunction)Outbox_end_seq, METH_NOARGS, "The seq after everything held."},
    {"wire_seq", (PyCFunction)Outbox_wire_seq, METH_NOARGS, "The next sequence number on the wire."},
    {"close", (PyCFunction)Outbox_close, METH_NOARGS, "Count later publishes as late drops."},
    {"frontier", (PyCFunction)Outbox_frontier, METH_NOARGS, "Publish index of the first held item."},
    {"counters", (PyCFunction)Outbox_counters, METH_NOARGS, "The counters as a tuple."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject OutboxType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmstat._pubfast.Outbox",
    .tp_basicsize = sizeof(Outbox),
    .tp_doc = "The publisher's backlog of encoded, batched items (C twin of shmstat.outbox.Outbox).",
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Outbox_init,
    .tp_dealloc = (destructor)Outbox_dealloc,
    .tp_methods = Outbox_methods,
};

/* ------------------------------------------------------------------------------------------ check_data */

/* check_data(data): a copy of ``data`` if it is an exact dict of exact str keys to exact str/float/bool values
 * or int values in int64; None otherwise (the caller then takes the slow path, which also raises the errors). */
static PyObject *
check_data(PyObject *Py_UNUSED(module), PyObject *data)
{
    if (!PyDict_CheckExact(data)) Py_RETURN_NONE;
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    while (PyDict_Next(data, &pos, &k, &v)) {
        PyTypeObject *t = Py_TYPE(v);
        if (!PyUnicode_CheckExact(k)) Py_RETURN_NONE;
        if (t == &PyFloat_Type || t == &PyUnicode_Type || t == &PyBool_Type) continue;
        if (t != &PyLong_Type) Py_RETURN_NONE;
        int overflow = 0;
        long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (overflow) Py_RETURN_NONE;
        if (x == -1 && PyErr_Occurred()) return NULL;
    }
    return PyDict_Copy(data);
}

/* ------------------------------------------------------------------------------------------ naive_local_ns */

/* The UTC offsets of local quarter hours seen so far (direct-mapped; a miss is filled by the Python side, which
 * asks the C library through datetime.timestamp() and calls remember_offset). */
#define OFFSET_SLOTS 256
static struct { long long key; int offset; int valid; } offsets[OFFSET_SLOTS];

static long long
floor_div(long long a, long long b)
{
    long long q = a / b;
    return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

/* Days from 1970-01-01 to the proleptic Gregorian date y-m-d. */
static long long
days_from_civil(long long y, int m, int d)
{
    y -= m <= 2;
    long long era = floor_div(y, 400);
    long long yoe = y - era * 400;
    long long doy = (153 * (m + (m > 2 ? -3 : 9)) + 2) / 5 + d - 1;
    long long doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    return era * 146097 + doe - 719468;
}

static int
local_seconds(PyObject *dt, long long *local_s, long long *key)
{
    long long days = days_from_civil(PyDateTime_GET_YEAR(dt), PyDateTime_GET_MONTH(dt), PyDateTime_GET_DAY(dt));
    *local_s = days * 86400 + PyDateTime_DATE_GET_HOUR(dt) * 3600 + PyDateTime_DATE_GET_MINUTE(dt) * 60
               + PyDateTime_DATE_GET_SECOND(dt);
    *key = floor_div(*local_s, 900) * 2 + PyDateTime_DATE_GET_FOLD(dt);
    return 0;
}

/* naive_local_ns(dt): a naive datetime (local time) as Unix ns, as events._naive_local_ns computes it; None when
 * ``dt`` is not an exact naive datetime or its quarter hour's offset is not known yet. */
static PyObject *
naive_local_ns(PyObject *Py_UNUSED(module), PyObject *dt)
{
    if (!PyDateTime_CheckExact(dt) || PyDateTime_DATE_GET_TZINFO(dt) != Py_None) Py_RETURN_NONE;
    long long local_s, key;
    local_seconds(dt, &local_s, &key);
    size_t slot = (size_t)(key & (OFFSET_SLOTS - 1));
    if (!offsets[slot].valid || offsets[slot].key != key) Py_RETURN_NONE;
    long long ns = ((local_s - offsets[slot].offset) * 1000000LL + PyDateTime_DATE_GET_MICROSECOND(dt)) * 1000LL;
    return PyLong_FromLongLong(ns);
}

/* remember_offset(dt, offset): record the UTC offset (seconds) of ``dt``'s local quarter hour. */
static PyObject *
remember_offset(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *dt;
    int offset;
    if (!PyArg_ParseTuple(args, "O!i", PyDateTimeAPI->DateTimeType, &dt, &offset)) return NULL;
    long long local_s, key;
    local_seconds(dt, &local_s, &key);
    size_t slot = (size_t)(key & (OFFSET_SLOTS - 1));
    offsets[slot].key = key;
    offsets[slot].offset = offset;
    offsets[slot].valid = 1;
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------------------------------ EventBase */

/* The storage and constructor of shmstat.events.Event (the Python class adds the properties): the common case
 * (an exact str name, an exact datetime, plain data) is checked and copied here; anything else goes to the
 * Python checks registered with set_event_checks, which convert or raise exactly as the pure-Python Event does. */
static PyObject *check_name_py, *check_timestamp_py, *check_data_py;

typedef struct {
    PyObject_HEAD
    PyObject *name, *ts, *ts_ns, *data, *nbytes;
} EventBaseObject;

static PyObject *check_data(PyObject *module, PyObject *data);

/* What log_event and the Event class need from the Python side (set_log_state), and interned names. */
static PyObject *ls_event_type, *ls_failed, *ls_attach, *ls_slow, *ls_too_large;
static long long ls_max;
static PyObject *s_outbox, *s_started, *s_start, *s_name;

static int
event_fill(EventBaseObject *self, PyObject *name, PyObject *ts, PyObject *data)
{
    if (check_name_py == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "shmstat._pubfast.set_event_checks was not called");
        return -1;
    }
    PyObject *n = PyUnicode_CheckExact(name) ? Py_NewRef(name) : PyObject_CallOneArg(check_name_py, name);
    if (n == NULL) return -1;
    PyObject *t = PyDateTime_CheckExact(ts) ? Py_NewRef(ts) : PyObject_CallOneArg(check_timestamp_py, ts);
    if (t == NULL) { Py_DECREF(n); return -1; }
    PyObject *d = check_data(NULL, data);
    if (d == Py_None) { Py_DECREF(d); d = PyObject_CallOneArg(check_data_py, data); }
    if (d == NULL) { Py_DECREF(n); Py_DECREF(t); return -1; }
    Py_XSETREF(self->name, n);
    Py_XSETREF(self->ts, t);
    Py_XSETREF(self->ts_ns, Py_NewRef(Py_None));
    Py_XSETREF(self->data, d);
    Py_XSETREF(self->nbytes, PyLong_FromLong(0));
    return self->nbytes == NULL ? -1 : 0;
}

static int
EventBase_init(EventBaseObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"name", "timestamp", "data", NULL};
    PyObject *name, *ts, *data;
    if (kwds == NULL && PyTuple_GET_SIZE(args) == 3) {  /* the common call: positional arguments */
        name = PyTuple_GET_ITEM(args, 0);
        ts = PyTuple_GET_ITEM(args, 1);
        data = PyTuple_GET_ITEM(args, 2);
    }
    else if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO:Event", kwlist, &name, &ts, &data)) return -1;
    return event_fill(self, name, ts, data);
}

/* Calling the Event class registered with set_log_state: Event(name, timestamp, data) is allocated and filled
 * here, as type_call would through tp_new and tp_init, minus the argument tuple. Anything else (keywords, a
 * subclass, an __init__ or __new__ assigned later) goes through type_call. */
static PyObject *
event_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    PyTypeObject *type = (PyTypeObject *)callable;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (callable == ls_event_type && kwnames == NULL && nargs == 3 && type->tp_init == (initproc)EventBase_init
        && type->tp_new == PyType_GenericNew) {
        PyObject *self = type->tp_alloc(type, 0);
        if (self == NULL) return NULL;
        if (event_fill((EventBaseObject *)self, args[0], args[1], args[2]) < 0) {
            Py_DECREF(self);
            return NULL;
        }
        return self;
    }
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    PyObject *tuple = PyTuple_New(nargs), *kwargs = NULL, *res = NULL;
    if (tuple == NULL) return NULL;
    for (Py_ssize_t i = 0; i < nargs; i++) PyTuple_SET_ITEM(tuple, i, Py_NewRef(args[i]));
    if (nkw > 0) {
        if ((kwargs = PyDict_New()) == NULL) goto done;
        for (Py_ssize_t i = 0; i < nkw; i++) {
            if (PyDict_SetItem(kwargs, PyTuple_GET_ITEM(kwnames, i), args[nargs + i]) < 0) goto done;
        }
    }
    res = PyType_Type.tp_call(callable, tuple, kwargs);
done:
    Py_DECREF(tuple);
    Py_XDECREF(kwargs);
    return res;
}

static void
EventBase_dealloc(EventBaseObject *self)
{
    Py_XDECREF(self->name);
    Py_XDECREF(self->ts);
    Py_XDECREF(self->ts_ns);
    Py_XDECREF(self->data);
    Py_XDECREF(self->nbytes);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef EventBase_members[] = {
    {"_name", T_OBJECT_EX, offsetof(EventBaseObject, name), 0, NULL},
    {"_ts", T_OBJECT_EX, offsetof(EventBaseObject, ts), 0, NULL},
    {"_ts_ns", T_OBJECT_EX, offsetof(EventBaseObject, ts_ns), 0, NULL},
    {"_data", T_OBJECT_EX, offsetof(EventBaseObject, data), 0, NULL},
    {"_nbytes", T_OBJECT_EX, offsetof(EventBaseObject, nbytes), 0, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject EventBaseType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmstat._pubfast.EventBase",
    .tp_basicsize = sizeof(EventBaseObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "EventBase(name, timestamp, data)\n--\n\nStorage and constructor of shmstat.events.Event.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)EventBase_init,
    .tp_dealloc = (destructor)EventBase_dealloc,
    .tp_members = EventBase_members,
};

/* Outbox.log(event, limit): event(event._name, event's Unix ns, event._data, event._nbytes, limit) for an Event
 * built on EventBase, reading its fields directly; the Unix ns of a naive timestamp is computed (from a known
 * quarter-hour offset) and cached in the event, and the size is cached in it once queued. -1 when anything is
 * unusual (not an EventBase, an aware timestamp, an unknown offset, data the fast encoder declines): the caller
 * then takes the Python path, which does the same. */
static long long
outbox_log(Outbox *self, PyObject *event, long long limit)
{
    if (!PyObject_TypeCheck(event, &EventBaseType)) return -1;
    EventBaseObject *e = (EventBaseObject *)event;
    if (e->name == NULL || e->data == NULL || e->ts_ns == NULL || e->nbytes == NULL) return -1;
    PyObject *ts_ns = e->ts_ns;
    int made = 0;
    if (ts_ns == Py_None) {
        if (e->ts == NULL) return -1;
        ts_ns = naive_local_ns(NULL, e->ts);
        if (ts_ns == NULL) return -2;
        if (ts_ns == Py_None) {
            Py_DECREF(ts_ns);
            return -1;
        }
        made = 1;
    }
    long long nbytes = PyLong_AsLongLong(e->nbytes);
    if (nbytes == -1 && PyErr_Occurred()) {
        if (made) Py_DECREF(ts_ns);
        return -2;
    }
    long long size = outbox_event(self, e->name, ts_ns, e->data, nbytes, limit);
    if (made) {
        if (size != -2) Py_SETREF(e->ts_ns, ts_ns);
        else Py_DECREF(ts_ns);
    }
    if (size > 0 && size != nbytes) {
        PyObject *n = PyLong_FromLongLong(size);
        if (n == NULL) return -2;
        Py_SETREF(e->nbytes, n);
    }
    return size;
}

static PyObject *
Outbox_log(Outbox *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "log(event, limit)");
        return NULL;
    }
    long long limit = PyLong_AsLongLong(args[1]);
    if (limit == -1 && PyErr_Occurred()) return NULL;
    long long size = outbox_log(self, args[0], limit);
    return size == -2 ? NULL : PyLong_FromLongLong(size);
}

/* set_event_checks(check_name, check_timestamp, check_data): the Python checks for the uncommon arguments. */
static PyObject *
set_event_checks(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *a, *b, *c;
    if (!PyArg_ParseTuple(args, "OOO", &a, &b, &c)) return NULL;
    Py_XSETREF(check_name_py, Py_NewRef(a));
    Py_XSETREF(check_timestamp_py, Py_NewRef(b));
    Py_XSETREF(check_data_py, Py_NewRef(c));
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------------------------------ log_event */

/* log_event(event): shmstat.events.log_event's common case in C (see its docstring for what it promises). The
 * Event class and the Python helpers it needs come from set_log_state; anything but a C Outbox goes to the
 * Python publish path (``slow(event, publisher)``).
 *
 * What it reads on every call (the handlers, the publisher and its outbox, whether the environment was
 * consulted) is a copy of shmstat._state.STATE kept here by sync_log_state, which GlobalState.__setattr__ calls
 * whenever one of those fields is assigned: no attribute lookups on the hot path. */

static PyObject *fs_handlers;  /* STATE.handler_tuple */
static PyObject *fs_pub;       /* STATE.publisher (or None) */
static PyObject *fs_outbox;    /* fs_pub._outbox when it is a C Outbox, else NULL */
static int fs_auto_init_done;  /* STATE.auto_init_done */
static int fs_started;         /* fs_pub._started was seen true (it never goes back) */

static PyObject *
set_log_state(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *a[6];
    if (!PyArg_ParseTuple(args, "OOOOOO", &a[0], &a[1], &a[2], &a[3], &a[4], &a[5])) return NULL;
    if (!PyType_Check(a[0]) || !PyType_IsSubtype((PyTypeObject *)a[0], &EventBaseType)) {
        PyErr_SetString(PyExc_TypeError, "set_log_state: the Event class must derive from EventBase");
        return NULL;
    }
    long long max = PyLong_AsLongLong(a[5]);
    if (max == -1 && PyErr_Occurred()) return NULL;
    PyObject **slots[5] = {&ls_event_type, &ls_failed, &ls_attach, &ls_slow, &ls_too_large};
    for (int i = 0; i < 5; i++) Py_XSETREF(*slots[i], Py_NewRef(a[i]));
    ls_max = max;
    /* Event(name, timestamp, data) without the argument tuple and type_call (see event_vectorcall) */
    ((PyTypeObject *)a[0])->tp_vectorcall = event_vectorcall;
    Py_RETURN_NONE;
}

/* sync_log_state(handler_tuple, publisher, auto_init_done): STATE's fields changed (see above). */
static PyObject *
sync_log_state(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyTuple_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, "sync_log_state(handler_tuple: tuple, publisher, auto_init_done)");
        return NULL;
    }
    int done = PyObject_IsTrue(args[2]);
    if (done < 0) return NULL;
    PyObject *pub = args[1], *outbox = NULL;
    if (pub != Py_None) {
        outbox = PyObject_GetAttr(pub, s_outbox);
        if (outbox == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return NULL;
            PyErr_Clear();
        }
        else if (Py_TYPE(outbox) != &OutboxType) Py_CLEAR(outbox);
    }
    if (pub != fs_pub) fs_started = 0;
    Py_XSETREF(fs_handlers, Py_NewRef(args[0]));
    Py_XSETREF(fs_pub, Py_NewRef(pub));
    Py_XSETREF(fs_outbox, outbox);
    fs_auto_init_done = done;
    Py_RETURN_NONE;
}

static int
run_handlers(PyObject *event)
{
    PyObject *handlers = Py_NewRef(fs_handlers);  /* a handler may (un)register handlers: keep this snapshot */
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(handlers); i++) {
        PyObject *cb = PyTuple_GET_ITEM(handlers, i);
        PyObject *r = PyObject_CallOneArg(cb, event);
        if (r != NULL) {
            Py_DECREF(r);
            continue;
        }
        if (!PyErr_ExceptionMatches(PyExc_Exception)) {  /* KeyboardInterrupt, SystemExit: not the handler's */
            Py_DECREF(handlers);
            return -1;
        }
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        if (tb != NULL && value != NULL) PyException_SetTraceback(value, tb);
        PyObject *done = PyObject_CallFunctionObjArgs(ls_failed, cb, value ? value : Py_None, NULL);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        if (done == NULL) {
            Py_DECREF(handlers);
            return -1;
        }
        Py_DECREF(done);
    }
    Py_DECREF(handlers);
    return 0;
}

/* The publisher's thread runs once anything was queued: start it the first time (pub._start()). */
static int
ensure_started(PyObject *pub)
{
    PyObject *started = PyObject_GetAttr(pub, s_started);
    if (started == NULL) return -1;
    int is_started = PyObject_IsTrue(started);
    Py_DECREF(started);
    if (is_started < 0) return -1;
    if (is_started) {
        if (pub == fs_pub) fs_started = 1;
        return 0;
    }
    PyObject *r = PyObject_CallMethodNoArgs(pub, s_start);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

static PyObject *
publish_event(PyObject *event)
{
    if (fs_pub == Py_None && !fs_auto_init_done) {
        PyObject *attached = PyObject_CallNoArgs(ls_attach);  /* assigns STATE.publisher: fs_* follow */
        if (attached == NULL) return NULL;
        Py_DECREF(attached);
    }
    if (fs_pub == Py_None) Py_RETURN_NONE;
    PyObject *pub = Py_NewRef(fs_pub);
    if (fs_outbox == NULL) {  /* a stand-in publisher, or the pure-Python outbox */
        PyObject *r = PyObject_CallFunctionObjArgs(ls_slow, event, pub, NULL);
        Py_DECREF(pub);
        return r;
    }
    long long size = outbox_log((Outbox *)fs_outbox, event, ls_max);
    if (size == -1) {  /* the fast encoder declined it: the Python path does the rest */
        PyObject *r = PyObject_CallFunctionObjArgs(ls_slow, event, pub, NULL);
        Py_DECREF(pub);
        return r;
    }
    if (size == -2 || (!(fs_started && pub == fs_pub) && ensure_started(pub) < 0)) {
        Py_DECREF(pub);
        return NULL;
    }
    Py_DECREF(pub);
    if (size > ls_max) {
        PyObject *exc = PyObject_CallFunction(ls_too_large, "OL", ((EventBaseObject *)event)->name, size);
        if (exc == NULL) return NULL;
        PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
        Py_DECREF(exc);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
c_log_event(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    if (nargs + nkw != 1 || (nkw == 1 && !_PyUnicode_EqualToASCIIString(PyTuple_GET_ITEM(kwnames, 0), "event"))) {
        PyErr_SetString(PyExc_TypeError, "log_event() takes exactly one argument, event");
        return NULL;
    }
    PyObject *event = args[0];
    if (ls_event_type == NULL || fs_handlers == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "shmstat._pubfast.set_log_state/sync_log_state were not called");
        return NULL;
    }
    if (!PyObject_TypeCheck(event, (PyTypeObject *)ls_event_type)) {
        PyErr_Format(PyExc_TypeError, "log_event expects an Event, not %s", _PyType_Name(Py_TYPE(event)));
        return NULL;
    }
    if (PyTuple_GET_SIZE(fs_handlers) && run_handlers(event) < 0) return NULL;
    return publish_event(event);
}

static PyMethodDef module_methods[] = {
    {"check_data", check_data, METH_O, "A copy of plain event data, or None (see events._check_data)."},
    {"naive_local_ns", naive_local_ns, METH_O, "A naive local datetime as Unix ns, or None (see events)."},
    {"remember_offset", remember_offset, METH_VARARGS, "Record a local quarter hour's UTC offset (see events)."},
    {"set_event_checks", set_event_checks, METH_VARARGS, "Register the Python checks EventBase falls back to."},
    {"set_log_state", set_log_state, METH_VARARGS, "Register what log_event needs (see shmstat.events)."},
    {"sync_log_state", (PyCFunction)(void (*)(void))sync_log_state, METH_FASTCALL,
     "Copy STATE's handler_tuple, publisher and auto_init_done for log_event (see shmstat._state)."},
    {"log_event", (PyCFunction)(void (*)(void))c_log_event, METH_FASTCALL | METH_KEYWORDS,
     "log_event($module, event)\n--\n\n"
     "Pass ``event`` (the same object) to every registered handler, in order, then to the job's collector.\n\n"
     "With no handlers and no job attached this is a no-op; a job configured by the environment is attached on\n"
     "the first call, as by a Stat. A handler's exception is logged and counted, never raised, and the\n"
     "remaining handlers still run; a handler may itself call ``log_event``. Raises TypeError if ``event`` is\n"
     "not an Event and EventTooLargeError if it is to be published and is over shmstat.wire.MAX_EVENT_BYTES\n"
     "(after the local handlers saw it). (The C twin of shmstat.events._py_log_event.)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef pubfast_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "shmstat._pubfast",
    .m_doc = "C publish path of shmstat (optional; shmstat.outbox is the pure-Python fallback).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC
PyInit__pubfast(void)
{
    PyDateTime_IMPORT;
    if (PyDateTimeAPI == NULL) return NULL;
    if (PyType_Ready(&OutboxType) < 0) return NULL;
    if (PyType_Ready(&EventBaseType) < 0) return NULL;
    s_outbox = PyUnicode_InternFromString("_outbox");
    s_started = PyUnicode_InternFromString("_started");
    s_start = PyUnicode_InternFromString("_start");
    s_name = PyUnicode_InternFromString("_name");
    if (!s_outbox || !s_started || !s_start || !s_name) return NULL;
    PyObject *m = PyModule_Create(&pubfast_module);
    if (m == NULL) return NULL;
    Py_INCREF(&EventBaseType);
    if (PyModule_AddObject(m, "EventBase", (PyObject *)&EventBaseType) < 0) {
        Py_DECREF(&EventBaseType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&OutboxType);
    if (PyModule_AddObject(m, "Outbox", (PyObject *)&OutboxType) < 0) {
        Py_DECREF(&OutboxType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
