/* The Outbox's thread side: sealing, numbering and handing out batches; counters; the type. Part of shmstat/_pubfast.c, which includes it (one compilation unit). */
#ifndef SHMSTAT_OUTBOX_SEND_H
#define SHMSTAT_OUTBOX_SEND_H

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
        if (c->payload == NULL) {  /* its room could not be had (out of memory): its items are dropped */
            Py_DECREF(tb);
            self->held -= c->n;
            self->held_bytes -= c->nbytes;
            self->dropped += c->n;
            pop_head(self);
            continue;
        }
        char hdr[HEADER_MAX];
        Py_ssize_t h = encode_header(self, c->kind, first, c->n, hdr);
        char *p = PyBytes_AS_STRING(c->payload);
        if (h != c->hdr) {  /* the guess was wrong (a batch of under 16 items, mostly): move the items */
            if (h > c->hdr && h + c->len > PyBytes_GET_SIZE(c->payload)
                && _PyBytes_Resize(&c->payload, h + c->len) < 0) {
                goto fail;
            }
            p = PyBytes_AS_STRING(c->payload);
            memmove(p + h, p + c->hdr, (size_t)c->len);
            c->hdr = h;
        }
        memcpy(p, hdr, (size_t)h);
        if (PyBytes_GET_SIZE(c->payload) != h + c->len && _PyBytes_Resize(&c->payload, h + c->len) < 0) goto fail;
        self->last_len = c->len;
        c->frames = PyTuple_Pack(2, tb, c->payload);
        Py_DECREF(tb);
        if (c->frames == NULL) return NULL;
        spare_add(self, c->payload);
        Py_CLEAR(c->payload);  /* the frames hold it now */
        Py_INCREF(c->frames);
        return c->frames;
    fail:  /* out of memory: the payload is gone (freed by _PyBytes_Resize); its items are dropped next time */
        Py_DECREF(tb);
        self->wire_seq -= c->n;  /* not numbered after all: the next head() drops them and numbers them */
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
    spare_clear(self);
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
    self->wake_fd = -1;
    return 0;
}

/* wake_on_full(fd): write to eventfd ``fd`` (-1: none) whenever the items held reach a message's worth. */
static PyObject *
Outbox_wake_on_full(Outbox *self, PyObject *arg)
{
    long fd = PyLong_AsLong(arg);
    if (fd == -1 && PyErr_Occurred()) return NULL;
    self->wake_fd = fd < 0 ? -1 : (int)fd;
    Py_RETURN_NONE;
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
    spare_clear(self);
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
    {"wake_on_full", (PyCFunction)Outbox_wake_on_full, METH_O, "The eventfd to write when a batch's worth is held."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject OutboxType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmstat._pubfast.Outbox",
    .tp_basicsize = sizeof(Outbox),
    .tp_doc = "The publisher's backlog of encoded, batched items (C twin of shmstat.publish.outbox.Outbox).",
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Outbox_init,
    .tp_dealloc = (destructor)Outbox_dealloc,
    .tp_methods = Outbox_methods,
};

#endif /* SHMSTAT_OUTBOX_SEND_H */
