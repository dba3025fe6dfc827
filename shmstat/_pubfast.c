/* Optional C publish path of shmstat (``SHMSTAT_PURE_PYTHON=1`` or no compiler: the pure-Python twins are used).
 * One compilation unit, in parts under shmstat/_c/:
 *
 * - pack.h, outbox_publish.h, outbox_send.h: ``Outbox``, the publisher's bounded, batched, already-encoded
 *   backlog. ``shmstat/publish/outbox.py`` is its pure-Python twin and the reference for its behaviour; both must put the
 *   same bytes on the wire (tests/rank/test_outbox.py checks that on random input). Callers (``log_event``,
 *   ``put_metric``) encode their item here, under the GIL, straight into the msgpack bytes the wire carries, and
 *   add it to the open batch of its topic; the publisher thread only seals whole batches (header + array header
 *   + items) and sends them. Items this fast path does not handle (subclasses of the scalar types, ints past 64
 *   bits, strings that are not valid UTF-8, ...) make ``event``/``metric`` return -1: the Python caller then
 *   validates and encodes them the slow way and hands the bytes to ``raw`` (or ``invalid``). No Outbox method
 *   calls back into Python code, so each is atomic with respect to other threads.
 * - event.h: ``EventBase``, the storage and constructor of ``shmstat.publish.events.Event``, its data check and the
 *   naive-timestamp conversion (tests/rank/test_event_paths.py and test_event_timestamps.py hold them to the Python
 *   twins).
 * - log_event.h: ``log_event`` (twin of ``shmstat.publish.events._py_log_event``); it runs the event handlers.
 * - put_metric.h: ``put_metric``, the common case of the Python put_metric handed to it with the groups its caller
 *   serves in-process (everything else it hands to that Python function).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <datetime.h>
#include <structmember.h>

#include <stdint.h>
#include <string.h>
#include <unistd.h>

/* MAX_OPEN, K_* (KIND_CODES), KIND_NAMES_INIT, ITEM_* (item_bytes), WIRE_VERSION: generated from
 * shmstat/publish/outbox.py, shmstat/publish/item_sizes.py and shmstat/wire/ */
#include "_c/layout.h"

static const char *KIND_NAMES[4] = KIND_NAMES_INIT;

#include "_c/pack.h"
#include "_c/outbox_publish.h"
#include "_c/outbox_send.h"
#include "_c/event.h"
#include "_c/log_event.h"
#include "_c/put_metric.h"

static PyMethodDef module_methods[] = {
    {"check_data", check_data, METH_O, "A copy of plain event data, or None (see events._check_data)."},
    {"naive_local_ns", naive_local_ns, METH_O, "A naive local datetime as Unix ns, or None (see events)."},
    {"remember_offset", remember_offset, METH_VARARGS, "Record a local quarter hour's UTC offset (see events)."},
    {"set_event_checks", set_event_checks, METH_VARARGS, "Register the Python checks EventBase falls back to."},
    {"set_log_state", set_log_state, METH_VARARGS, "Register what log_event needs (see shmstat.publish.events)."},
    {"sync_log_state", (PyCFunction)(void (*)(void))sync_log_state, METH_FASTCALL,
     "Copy STATE's handler_tuple, publisher and auto_init_done for log_event (see shmstat.job._state)."},
    {"log_event", (PyCFunction)(void (*)(void))c_log_event, METH_FASTCALL | METH_KEYWORDS,
     "log_event($module, event)\n--\n\n"
     "Pass ``event`` (the same object) to every registered handler, in order, then to the job's collector.\n\n"
     "With no handlers and no job attached this is a no-op; a job configured by the environment is attached on\n"
     "the first call, as by a Stat. A handler's exception is logged and counted, never raised, and the\n"
     "remaining handlers still run; a handler may itself call ``log_event``. Raises TypeError if ``event`` is\n"
     "not an Event, ConfigError if its name breaks the name rule of shmstat.names (before any handler sees\n"
     "it) and EventTooLargeError if it is to be published and is over shmstat.wire.MAX_EVENT_BYTES\n"
     "(after the local handlers saw it). (The C twin of shmstat.publish.events._py_log_event.)"},
    {"set_metric_state", set_metric_state, METH_VARARGS, "set_metric_state(python, names, groups, local, all_local, default_group)\n--\n\n"
     "Hand put_metric its Python twin (called for every case the C path does not take), the sets of names and\n"
     "groups found valid, the dict whose keys are the groups served in this process (read live), whether every\n"
     "group is, and the default group. Call it again when all_local changes."},
    {"put_metric", (PyCFunction)(void (*)(void))c_put_metric, METH_FASTCALL | METH_KEYWORDS,
     "put_metric($module, /, metric_name, metric_value, metric_group='torchelastic')\n--\n\n"
     "Publish one data point of ``(metric_group, metric_name)`` with the current time.\n\n"
     "The handler is looked up on every call (so a later configure() applies at once). With no handler\n"
     "configured for the group or as default, the point goes to the collector when the process is attached\n"
     "and nowhere otherwise. Raises ConfigError if the name or group breaks the name rule (shmstat.names),\n"
     "whichever handler serves the group. (The common case of the Python twin set_metric_state handed, in C.)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef pubfast_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "shmstat._pubfast",
    .m_doc = "C publish path of shmstat (optional; shmstat.publish.outbox is the pure-Python fallback).",
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
    /* the publisher's public fast-path surface (shmstat.publish.publisher.Publisher.outbox, .started, .start) */
    s_outbox = PyUnicode_InternFromString("outbox");
    s_started = PyUnicode_InternFromString("started");
    s_start = PyUnicode_InternFromString("start");
    if (!s_outbox || !s_started || !s_start) return NULL;
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
