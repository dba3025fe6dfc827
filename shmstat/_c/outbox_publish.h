/* The Outbox's caller side: batches per topic, the bounds, and encoding events and metrics. Part of shmstat/_pubfast.c, which includes it (one compilation unit). */
#ifndef SHMSTAT_OUTBOX_PUBLISH_H
#define SHMSTAT_OUTBOX_PUBLISH_H

/* ------------------------------------------------------------------------------------------ Outbox */

typedef struct Chunk {
    struct Chunk *next;
    int kind;               /* K_EVENT.., or K_GAP */
    PyObject *key1, *key2;  /* event: name; metric: group, name; stat/rank: topic (owned references) */
    long long taken;        /* publish index of the first item */
    long long n;            /* items (or dropped items for a gap) */
    long long nbytes;       /* estimated bytes (item_bytes / METRIC_BYTES) */
    /* The message is built in place: ``payload`` is the bytes object that will be sent, ``hdr`` bytes kept for
     * the wire header (its length as guessed when the batch was started), then the ``len`` bytes of the encoded
     * items; until the batch is sealed the object's size is its capacity. Sealing writes the header into the
     * kept bytes (moving the items only when the guess was wrong) instead of copying the items behind it. */
    PyObject *payload;
    Py_ssize_t hdr, len;
    PyObject *frames;       /* (topic, payload) once sealed */
} Chunk;

#define SPARE_MAX 32

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
    Py_ssize_t last_len;    /* the items' bytes of the batch sealed last (a new batch starts with that room) */
    /* The payloads of the last SPARE_MAX sealed batches (references of ours). One that nobody else holds any more
     * (sent and acknowledged, or given up) is reused for a new batch: the memory of a fast flow's messages is
     * then not given back to the C library and taken again (fresh pages, a page fault each) every batch. */
    PyObject *spare[SPARE_MAX];
    int nspare, spare_next;
    int wake_fd;            /* an eventfd written when a message's worth is held (the sender's wake-up), or -1 */
} Outbox;

static void
chunk_free(Chunk *c)
{
    Py_XDECREF(c->key1);
    Py_XDECREF(c->key2);
    Py_XDECREF(c->frames);
    Py_XDECREF(c->payload);
    PyMem_Free(c);
}

/* Remember a sealed batch's payload for reuse (see Outbox.spare); the oldest remembered is forgotten. */
static void
spare_add(Outbox *self, PyObject *payload)
{
    if (self->nspare < SPARE_MAX) {
        self->spare[self->nspare++] = Py_NewRef(payload);
        return;
    }
    Py_SETREF(self->spare[self->spare_next], Py_NewRef(payload));
    self->spare_next = (self->spare_next + 1) % SPARE_MAX;
}

/* A payload of ``size`` bytes for a new batch: a remembered one nobody else holds (resized in place, mostly the
 * same size), else a new one. */
static PyObject *
payload_new(Outbox *self, Py_ssize_t size)
{
    for (int i = 0; i < self->nspare; i++) {
        PyObject *p = self->spare[i];
        if (Py_REFCNT(p) != 1) continue;  /* still queued in zmq, kept for an acknowledgement, or the caller's */
        self->spare[i] = self->spare[--self->nspare];
        if (self->spare_next >= self->nspare) self->spare_next = 0;
        if (PyBytes_GET_SIZE(p) != size && _PyBytes_Resize(&p, size) < 0) {
            PyErr_Clear();
            break;
        }
        return p;
    }
    return PyBytes_FromStringAndSize(NULL, size);
}

static void
spare_clear(Outbox *self)
{
    for (int i = 0; i < self->nspare; i++) Py_DECREF(self->spare[i]);
    self->nspare = self->spare_next = 0;
}

/* The wire header of a batch (the map wire.encode writes: v, k, r, p, i, s, then the items' array header) for
 * ``n`` items from sequence number ``first``, into ``out`` (HEADER_MAX bytes); returns its length. */
#define HEADER_MAX 96
static Py_ssize_t
encode_header(Outbox *self, int kind, long long first, long long n, char *out)
{
    Buf h = {out, 0, HEADER_MAX};  /* at most 1 + 3 + 8 + 4 * 11 + 6 + 5 bytes: never grows */
    const char *k = KIND_NAMES[kind];
    size_t kn = strlen(k);
    h.p[h.len++] = (char)0x87;
    h.p[h.len++] = (char)0xa1;
    h.p[h.len++] = 'v';
    pk_i64(&h, WIRE_VERSION);
    h.p[h.len++] = (char)0xa1;
    h.p[h.len++] = 'k';
    h.p[h.len++] = (char)(0xa0 | (int)kn);
    memcpy(h.p + h.len, k, kn);
    h.len += (Py_ssize_t)kn;
    const char keys[4] = {'r', 'p', 'i', 's'};
    long long vals[4] = {self->rank, self->pid, self->incarnation, first};
    for (int i = 0; i < 4; i++) {
        h.p[h.len++] = (char)0xa1;
        h.p[h.len++] = keys[i];
        pk_i64(&h, vals[i]);
    }
    memcpy(h.p + h.len, "\xa5items", 6);
    h.len += 6;
    pk_array(&h, (Py_ssize_t)n);
    return h.len;
}

/* Room for ``extra`` more bytes of items in ``c``'s payload (grown by doubling; the capacity is the bytes
 * object's size until the batch is sealed). */
static int
chunk_reserve(Chunk *c, Py_ssize_t extra)
{
    Py_ssize_t need = c->hdr + c->len + extra, cap = PyBytes_GET_SIZE(c->payload);
    if (need <= cap) return 0;
    while (cap < need) cap *= 2;
    return _PyBytes_Resize(&c->payload, cap);  /* on failure it is freed and NULL: the caller gives the batch up */
}

/* A batch that takes no more items gives back the room it did not use (the bytes object shrinks in place). */
static void
chunk_trim(Chunk *c)
{
    if (c->payload == NULL || c->frames != NULL) return;
    Py_ssize_t used = c->hdr + c->len;
    if (PyBytes_GET_SIZE(c->payload) - used <= 256) return;
    if (_PyBytes_Resize(&c->payload, used) < 0) PyErr_Clear();  /* payload NULL: sealing counts it as dropped */
}

static void
forget_open(Outbox *self)
{
    for (int i = 0; i < self->nopen; i++) chunk_trim(self->open[i]);
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

/* Add the item encoded in ``src`` (``len`` bytes; usually self->scratch) to the open batch of its topic (or a new
 * one). */
static int
add_item_from(Outbox *self, int kind, PyObject *key1, PyObject *key2, long long size, const char *src,
              Py_ssize_t len)
{
    if (self->held >= self->max_items || self->held_bytes + size > self->max_bytes) {
        return add_gap(self, 1);
    }
    Chunk *c = NULL;
    if (self->open_kind == kind) {
        for (int i = 0; i < self->nopen; i++) {
            Chunk *o = self->open[i];
            if (same_key(o->key1, key1) && same_key(o->key2, key2)) {
                if (o->frames == NULL && o->payload != NULL && o->n < self->batch_max
                    && o->len + len <= self->max_batch_bytes) {
                    c = o;
                } else {  /* full or sealed: a new batch of this topic replaces it in the open set */
                    chunk_trim(o);
                    self->open[i] = self->open[--self->nopen];
                }
                break;
            }
        }
        if (PyErr_Occurred()) return -1;
    }
    if (c == NULL) {
        char hdr[HEADER_MAX];
        /* the header's length as it will most likely be: the sequence number about where the publish index is,
         * and an array of 16 or more items (a batch that ends smaller has its items moved when sealed) */
        Py_ssize_t h = encode_header(self, kind, self->index, self->batch_max >= 16 ? 16 : 1, hdr);
        Py_ssize_t room = self->last_len < 256 ? 256 : self->last_len;
        if (room > self->max_batch_bytes) room = self->max_batch_bytes;
        if (room < len) room = len;
        PyObject *payload = payload_new(self, h + room);
        if (payload == NULL) return -1;
        c = PyMem_Calloc(1, sizeof(Chunk));
        if (c == NULL) {
            Py_DECREF(payload);
            PyErr_NoMemory();
            return -1;
        }
        c->payload = payload;
        c->hdr = h;
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
    if (chunk_reserve(c, len) < 0) {  /* the batch's items are lost with its payload: counted as dropped */
        PyErr_Clear();
        c->payload = NULL;
        for (int i = 0; i < self->nopen; i++) {
            if (self->open[i] == c) {
                self->open[i] = self->open[--self->nopen];
                break;
            }
        }
        return add_gap(self, 1);
    }
    memcpy(PyBytes_AS_STRING(c->payload) + c->hdr + c->len, src, (size_t)len);
    c->len += len;
    c->n += 1;
    c->nbytes += size;
    self->held += 1;
    self->held_bytes += size;
    self->index += 1;
    if (self->wake_fd >= 0 && (self->held == self->batch_max
            || (self->held_bytes >= self->max_batch_bytes && self->held_bytes - size < self->max_batch_bytes))) {
        /* a message's worth is held: the sender goes now, not at the end of its latency budget (a syscall, no
         * Python code: the outbox stays atomic under the GIL) */
        uint64_t one = 1;
        if (write(self->wake_fd, &one, sizeof one) < 0) { /* full or closed: the sender wakes anyway */ }
    }
    return 0;
}

/* Add the item encoded in self->scratch. */
static int
add_item(Outbox *self, int kind, PyObject *key1, PyObject *key2, long long size)
{
    return add_item_from(self, kind, key1, key2, size, self->scratch.p, self->scratch.len);
}

/* Encode and queue an event: its size (as item_bytes estimates it, or ``size`` if given) once queued (or when over
 * ``limit`` > 0: not queued), 0 once the outbox is closed, -1 when the fast encoder declines it, -2 on error. */
static long long
outbox_event_at(Outbox *self, PyObject *name, PyObject *ts, long long ts_ns, PyObject *data, long long size,
                long long limit)
{
    if (self->closed) {
        self->late += 1;
        return 0;
    }
    if (!PyUnicode_CheckExact(name) || !PyDict_CheckExact(data) || (ts != NULL && Py_TYPE(ts) != &PyLong_Type)) {
        return -1;
    }
    Buf *b = &self->scratch;
    b->len = 0;
    int r;
    Py_ssize_t name8 = 0;
    if (buf_reserve(b, 64) < 0) return -2;
    b->p[b->len++] = (char)0x93;
    if ((r = pk_str(b, name, &name8)) != 1) goto fallback;
    if (ts == NULL) {
        if (pk_i64(b, ts_ns) < 0) return -2;
    }
    else if ((r = pk_scalar(b, ts, 0, NULL)) != 1) goto fallback;
    Py_ssize_t nd = PyDict_GET_SIZE(data);
    if (pk_map(b, nd) < 0) return -2;
    /* item_bytes(): ITEM_OVERHEAD + len(name) + ITEM_KEY_BYTES * len(data) + sum(len(key)) + sum(len(str value))
     * in code points, recounted in UTF-8 bytes past ITEM_RECOUNT_BYTES */
    long long est = ITEM_OVERHEAD + PyUnicode_GET_LENGTH(name) + ITEM_KEY_BYTES * (long long)nd;
    long long est8 = ITEM_OVERHEAD + name8 + ITEM_KEY_BYTES * (long long)nd;
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
    if (est > ITEM_RECOUNT_BYTES) est = est8;
    if (size <= 0) size = est;
    if (limit > 0 && size > limit) return size;
    if (add_item(self, K_EVENT, name, NULL, size) < 0) return -2;
    return size;
fallback:
    return r < 0 ? -2 : -1;
}

/* The same, the timestamp an int object. */
static long long
outbox_event(Outbox *self, PyObject *name, PyObject *ts, PyObject *data, long long size, long long limit)
{
    return outbox_event_at(self, name, ts, 0, data, size, limit);
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
    if (add_item_from(self, (int)kind, k1, k2, size, PyBytes_AS_STRING(args[3]), PyBytes_GET_SIZE(args[3])) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* n (args[0], default 1) items published here are dropped, counted and numbered; ``invalid``: because they cannot
 * be sent (else the caller refused them, over a bound). */
static PyObject *
drop_published(Outbox *self, PyObject *const *args, Py_ssize_t nargs, int invalid)
{
    long long n = 1;
    if (nargs > 0 && ((n = PyLong_AsLongLong(args[0])) == -1 && PyErr_Occurred())) return NULL;
    if (self->closed) {
        self->late += n;
        Py_RETURN_NONE;
    }
    if (invalid) self->invalid += n;
    if (add_gap(self, n) < 0) return NULL;
    Py_RETURN_NONE;
}

/* invalid(n=1): n items that cannot be sent were published here: dropped, counted, numbered. */
static PyObject *
Outbox_invalid(Outbox *self, PyObject *const *args, Py_ssize_t nargs)
{
    return drop_published(self, args, nargs, 1);
}

/* refused(n=1): n items refused (over a bound) by the caller: dropped, counted, numbered. */
static PyObject *
Outbox_refused(Outbox *self, PyObject *const *args, Py_ssize_t nargs)
{
    return drop_published(self, args, nargs, 0);
}

#endif /* SHMSTAT_OUTBOX_PUBLISH_H */
