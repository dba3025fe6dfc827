/* Event data checks, naive local timestamps as Unix ns, and EventBase (the storage of shmstat.publish.events.Event). Part of shmstat/_pubfast.c, which includes it (one compilation unit). */
#ifndef SHMSTAT_EVENT_H
#define SHMSTAT_EVENT_H

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
static int
naive_local_ns_of(PyObject *dt, long long *ns)
{
    if (!PyDateTime_CheckExact(dt) || PyDateTime_DATE_GET_TZINFO(dt) != Py_None) return 0;
    long long local_s, key;
    local_seconds(dt, &local_s, &key);
    size_t slot = (size_t)(key & (OFFSET_SLOTS - 1));
    if (!offsets[slot].valid || offsets[slot].key != key) return 0;
    *ns = ((local_s - offsets[slot].offset) * 1000000LL + PyDateTime_DATE_GET_MICROSECOND(dt)) * 1000LL;
    return 1;
}

static PyObject *
naive_local_ns(PyObject *Py_UNUSED(module), PyObject *dt)
{
    long long ns;
    if (!naive_local_ns_of(dt, &ns)) Py_RETURN_NONE;
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

/* The storage and constructor of shmstat.publish.events.Event (the Python class adds the properties): the common case
 * (an exact str name, an exact datetime, plain data) is checked and copied here; anything else goes to the
 * Python checks registered with set_event_checks, which convert or raise exactly as the pure-Python Event does. */
static PyObject *check_name_py, *check_timestamp_py, *check_data_py;

/* An event logged again unchanged (the same name, timestamp and data objects, the data dict not mutated since) is
 * queued from the bytes it was encoded to the last time. Whether a dict was mutated is its version tag (PEP 509),
 * which Python 3.12 deprecates: there every event is encoded anew. */
#if PY_VERSION_HEX < 0x030C0000
#define EVENT_ENCODED_CACHE 1
#endif

typedef struct {
    PyObject_HEAD
    PyObject *name, *ts, *ts_ns, *data, *nbytes;
    PyObject *enc_name, *enc_ts_ns, *enc_data;  /* what ``enc`` was encoded from (held: never another object at
                                                   the same address) */
    uint64_t enc_version;                       /* enc_data's version tag then */
    Buf enc;                                    /* the encoded item, as outbox_event left it in the scratch buffer */
} EventBaseObject;

static PyObject *check_data(PyObject *module, PyObject *data);

/* What log_event and the Event class need from the Python side (set_log_state), and interned names. */
static PyObject *ls_event_type, *ls_failed, *ls_attach, *ls_slow, *ls_too_large;
static long long ls_max;
static PyObject *s_outbox, *s_started, *s_start;

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
event_clear_fields(EventBaseObject *self)
{
    Py_XDECREF(self->name);
    Py_XDECREF(self->ts);
    Py_XDECREF(self->ts_ns);
    Py_XDECREF(self->data);
    Py_XDECREF(self->nbytes);
    Py_XDECREF(self->enc_name);
    Py_XDECREF(self->enc_ts_ns);
    Py_XDECREF(self->enc_data);
    PyMem_Free(self->enc.p);
}

static void
EventBase_dealloc(EventBaseObject *self)
{
    event_clear_fields(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The deallocator of the Event class registered with set_log_state (which checks that it adds nothing to
 * EventBase: no __dict__, no weak references, no finalizer): what the generic one for a Python subclass does for
 * such a class, without its general steps. A Python subclass of Event keeps the generic one, which calls this one
 * after its own steps (and leaves the type's reference to it, as for any base that is a heap type). */
static void
event_dealloc(PyObject *self)
{
    PyTypeObject *type = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    event_clear_fields((EventBaseObject *)self);
    type->tp_free(self);
    Py_DECREF(type);
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
    .tp_doc = "EventBase(name, timestamp, data)\n--\n\nStorage and constructor of shmstat.publish.events.Event.",
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
    if (Py_TYPE(event) != (PyTypeObject *)ls_event_type && !PyObject_TypeCheck(event, &EventBaseType)) return -1;
    EventBaseObject *e = (EventBaseObject *)event;
    if (e->name == NULL || e->data == NULL || e->ts_ns == NULL || e->nbytes == NULL) return -1;
    long long nbytes = PyLong_AsLongLong(e->nbytes);
    if (nbytes == -1 && PyErr_Occurred()) return -2;
    PyObject *ts_ns = e->ts_ns;
    int made = 0;
    if (ts_ns == Py_None) {
        if (e->ts == NULL) return -1;
        if (nbytes == 0) {  /* logged the first time (mostly the only one): the Unix ns need no int object */
            long long ns;
            if (!naive_local_ns_of(e->ts, &ns)) return -1;
            long long first = outbox_event_at(self, e->name, NULL, ns, e->data, 0, limit);
            if (first > 0) {
                PyObject *n = PyLong_FromLongLong(first);
                if (n == NULL) return -2;
                Py_SETREF(e->nbytes, n);
            }
            return first;
        }
        ts_ns = naive_local_ns(NULL, e->ts);
        if (ts_ns == NULL) return -2;
        if (ts_ns == Py_None) {
            Py_DECREF(ts_ns);
            return -1;
        }
        made = 1;
    }
    long long size = -1;
#ifdef EVENT_ENCODED_CACHE
    PyObject *data = e->data;
    int same = e->enc.len > 0 && nbytes > 0 && !self->closed && e->enc_name == e->name && e->enc_ts_ns == ts_ns
               && e->enc_data == data && PyDict_CheckExact(data)
               && ((PyDictObject *)data)->ma_version_tag == e->enc_version;
    if (same) {  /* logged again unchanged: the bytes of last time (outbox_event would write the same) */
        size = nbytes;
        if (limit <= 0 || size <= limit) {
            if (add_item_from(self, K_EVENT, e->name, NULL, size, e->enc.p, e->enc.len) < 0) size = -2;
        }
    }
    else
#endif
    size = outbox_event(self, e->name, ts_ns, e->data, nbytes, limit);
#ifdef EVENT_ENCODED_CACHE
    /* kept from the second time an event is logged on (nbytes: it was queued before): a fresh event logged once,
     * the common case, pays nothing for it */
    if (!same && nbytes > 0 && size > 0 && (limit <= 0 || size <= limit) && PyDict_CheckExact(data)
        && self->scratch.len > 0) {
        Buf *c = &e->enc;
        c->len = 0;
        if (buf_reserve(c, self->scratch.len) == 0) {
            memcpy(c->p, self->scratch.p, (size_t)self->scratch.len);
            c->len = self->scratch.len;
            Py_XSETREF(e->enc_name, Py_NewRef(e->name));
            Py_XSETREF(e->enc_ts_ns, Py_NewRef(ts_ns));
            Py_XSETREF(e->enc_data, Py_NewRef(data));
            e->enc_version = ((PyDictObject *)data)->ma_version_tag;
        }
        else {
            PyErr_Clear();  /* no room for the copy: the next log encodes again */
        }
    }
#endif
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

#endif /* SHMSTAT_EVENT_H */
