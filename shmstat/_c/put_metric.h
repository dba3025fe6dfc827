/* put_metric in C: the common case of a metrics API's put_metric. Part of shmstat/_pubfast.c, which includes it after
 * log_event.h (one compilation unit; it reads the same copy of shmstat.job._state.STATE). */
#ifndef SHMSTAT_PUT_METRIC_H
#define SHMSTAT_PUT_METRIC_H

#include <time.h>

/* c_put_metric(metric_name, metric_value, metric_group=<the default group>): the common case of a Python put_metric
 * handed here with its routing (set_metric_state), which holds every rule. A metric of a name and a group found
 * valid before (the sets of shmstat.names.KNOWN), with an int, float or bool value, for a group the caller routes to
 * the collector (no key of ``local``, ``all_local`` false), with the publisher's C Outbox running, is encoded and
 * queued here; every other call is handed, arguments unchanged, to that Python function. So both behave alike by
 * construction: this only skips the Python frame of the common case. This file knows nothing of who serves a group
 * in the caller's process: the caller hands it the groups it keeps and calls set_metric_state again whenever that
 * changes. */

static PyObject *pm_python;        /* the Python put_metric: every call this does not take */
static PyObject *pm_names;         /* shmstat.names.KNOWN[0]: names found valid */
static PyObject *pm_groups;        /* shmstat.names.KNOWN[1]: groups found valid */
static PyObject *pm_local;         /* dict: its keys are the groups served in the caller's process (read live) */
static int pm_all_local;           /* every group is served in the caller's process */
static PyObject *pm_default_group; /* metric_group when not given */

static PyObject *
set_metric_state(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *a[5];
    int all_local;
    if (!PyArg_ParseTuple(args, "OO!O!O!pU", &a[0], &PySet_Type, &a[1], &PySet_Type, &a[2], &PyDict_Type, &a[3],
                          &all_local, &a[4])) {
        return NULL;
    }
    PyObject **slots[5] = {&pm_python, &pm_names, &pm_groups, &pm_local, &pm_default_group};
    for (int i = 0; i < 5; i++) Py_XSETREF(*slots[i], Py_NewRef(a[i]));
    pm_all_local = all_local;
    Py_RETURN_NONE;
}

/* time.time() as a float: the same clock and the same rounding */
static PyObject *
wall_seconds(void)
{
    struct timespec ts;
    if (clock_gettime(CLOCK_REALTIME, &ts) != 0) return PyErr_SetFromErrno(PyExc_OSError);
    return PyFloat_FromDouble((double)((long long)ts.tv_sec * 1000000000LL + ts.tv_nsec) / 1e9);
}

/* 1 if ``key`` is in ``set``, 0 if not or if asking failed (the Python path then says why) */
static int
known(PyObject *set, PyObject *key)
{
    int r = PySet_Contains(set, key);
    if (r < 0) {
        PyErr_Clear();
        return 0;
    }
    return r;
}

static PyObject *
c_put_metric(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    if (pm_python == NULL || fs_handlers == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "shmstat._pubfast.set_metric_state/sync_log_state were not called");
        return NULL;
    }
    if (kwnames != NULL || nargs < 2 || nargs > 3) goto python;
    PyObject *name = args[0], *value = args[1], *group = nargs == 3 ? args[2] : pm_default_group;
    PyTypeObject *vt = Py_TYPE(value);
    if (!PyUnicode_CheckExact(name) || !PyUnicode_CheckExact(group)
        || (vt != &PyFloat_Type && vt != &PyLong_Type && vt != &PyBool_Type)
        || !known(pm_names, name) || !known(pm_groups, group)) {
        goto python;
    }
    if (pm_all_local) goto python;
    if (PyDict_GET_SIZE(pm_local)) {
        PyObject *handler = PyDict_GetItemWithError(pm_local, group);
        if (handler != NULL || PyErr_Occurred()) goto python;
    }
    if (fs_pub == Py_None) {
        if (fs_auto_init_done) Py_RETURN_NONE;  /* not attached: the built-in default drops it */
        goto python;                            /* attach from the environment first */
    }
    if (fs_outbox == NULL) goto python;
    PyObject *pub = Py_NewRef(fs_pub);
    PyObject *ts = wall_seconds();
    if (ts == NULL) {
        Py_DECREF(pub);
        return NULL;
    }
    PyObject *margs[4] = {group, name, value, ts};
    PyObject *r = Outbox_metric((Outbox *)fs_outbox, margs, 4);
    Py_DECREF(ts);
    if (r == NULL || r != Py_None) {  /* an error, or the fast encoder declined it (an int past 64 bits) */
        Py_DECREF(pub);
        if (r == NULL) return NULL;
        Py_DECREF(r);
        goto python;
    }
    if (!(fs_started && pub == fs_pub) && ensure_started(pub) < 0) {
        Py_DECREF(r);
        Py_DECREF(pub);
        return NULL;
    }
    Py_DECREF(pub);
    return r;
python:
    if (PyErr_Occurred()) return NULL;
    return PyObject_Vectorcall(pm_python, args, (size_t)nargs, kwnames);
}

#endif /* SHMSTAT_PUT_METRIC_H */
