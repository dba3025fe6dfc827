/* log_event in C, and the copy of shmstat.job._state.STATE it reads. Part of shmstat/_pubfast.c, which includes it (one compilation unit). */
#ifndef SHMSTAT_LOG_EVENT_H
#define SHMSTAT_LOG_EVENT_H

/* ------------------------------------------------------------------------------------------ log_event */

/* log_event(event): shmstat.publish.events.log_event's common case in C (see its docstring for what it promises). The
 * Event class and the Python helpers it needs come from set_log_state; anything but a C Outbox goes to the
 * Python publish path (``slow(event, publisher)``).
 *
 * What it reads on every call (the handlers, the publisher and its outbox, whether the environment was
 * consulted) is a copy of shmstat.job._state.STATE kept here by sync_log_state, which GlobalState.__setattr__ calls
 * whenever one of those fields is assigned: no attribute lookups on the hot path. */

static PyObject *fs_handlers;  /* STATE.handler_tuple */
static PyObject *fs_pub;       /* STATE.publisher (or None) */
static PyObject *fs_outbox;    /* fs_pub.outbox when it is a C Outbox, else NULL */
static int fs_auto_init_done;  /* STATE.auto_init_done */
static int fs_started;         /* fs_pub.started was seen true (it never goes back) */

static PyObject *ls_check_name;  /* shmstat.names.check_event_name */

static PyObject *
set_log_state(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *a[7];
    if (!PyArg_ParseTuple(args, "OOOOOOO", &a[0], &a[1], &a[2], &a[3], &a[4], &a[5], &a[6])) return NULL;
    if (!PyType_Check(a[0]) || !PyType_IsSubtype((PyTypeObject *)a[0], &EventBaseType)) {
        PyErr_SetString(PyExc_TypeError, "set_log_state: the Event class must derive from EventBase");
        return NULL;
    }
    long long max = PyLong_AsLongLong(a[5]);
    if (max == -1 && PyErr_Occurred()) return NULL;
    PyObject **slots[5] = {&ls_event_type, &ls_failed, &ls_attach, &ls_slow, &ls_too_large};
    for (int i = 0; i < 5; i++) Py_XSETREF(*slots[i], Py_NewRef(a[i]));
    Py_XSETREF(ls_check_name, Py_NewRef(a[6]));
    ls_max = max;
    /* Event(name, timestamp, data) without the argument tuple and type_call (see event_vectorcall) */
    PyTypeObject *event_type = (PyTypeObject *)a[0];
    event_type->tp_vectorcall = event_vectorcall;
    if (event_type->tp_base == &EventBaseType && (event_type->tp_flags & Py_TPFLAGS_HEAPTYPE)
        && (event_type->tp_flags & Py_TPFLAGS_HAVE_GC) && event_type->tp_basicsize == EventBaseType.tp_basicsize
        && event_type->tp_dictoffset == 0 && event_type->tp_weaklistoffset == 0 && event_type->tp_finalize == NULL
        && event_type->tp_del == NULL && event_type->tp_free == PyObject_GC_Del) {
        event_type->tp_dealloc = event_dealloc;  /* see event_dealloc */
    }
    Py_RETURN_NONE;
}

/* The name rule (shmstat.names) for an event's name: its common case, 1 to MAX_EVENT_NAME_BYTES characters of
 * printable ASCII, is accepted here; anything else goes to shmstat.names.check_event_name, which accepts it or
 * raises exactly as on the pure-Python path. 0 if the name is one, -1 with the exception set if not. */
static int
check_event_name(PyObject *name)
{
    if (PyUnicode_CheckExact(name) && PyUnicode_IS_ASCII(name)) {
        Py_ssize_t n = PyUnicode_GET_LENGTH(name), i = 0;
        const Py_UCS1 *p = PyUnicode_1BYTE_DATA(name);
        while (i < n && p[i] >= 0x20 && p[i] < 0x7f) i++;
        if (i == n && n >= 1 && n <= MAX_EVENT_NAME_BYTES) return 0;
    }
    PyObject *r = PyObject_CallOneArg(ls_check_name, name);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
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

/* The publisher's thread runs once anything was queued: start it the first time (pub.start()). */
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
    PyObject *name = ((EventBaseObject *)event)->name;
    if (name == NULL) {
        PyErr_SetString(PyExc_AttributeError, "_name");
        return NULL;
    }
    /* before any handler sees it; a name this event was already published under passed it then */
    if (name != ((EventBaseObject *)event)->enc_name && check_event_name(name) < 0) return NULL;
    if (PyTuple_GET_SIZE(fs_handlers) && run_handlers(event) < 0) return NULL;
    return publish_event(event);
}

#endif /* SHMSTAT_LOG_EVENT_H */
