/* Optional C check of the collector's intake: ``check(topic, payload)`` validates one rank message of kind event or
 * metric by walking its msgpack bytes, building no Python object but the answer. ``shmstat.wire.decode`` is the one
 * definition of what is valid; this accepts exactly what it accepts (tests/collector/relay/test_intake.py checks that
 * on random, adversarial and mutated input) and answers with:
 *
 *   a tuple (kind, rank, pid, incarnation, first_seq, n_items)  the message is valid (decode would accept it);
 *   a str, the reason                                           decode would refuse it;
 *   None                                                        undecided: ask decode (stat and rank kinds, a
 *                                                               payload map with a key twice, an event data
 *                                                               value of a type decode refuses, which a later
 *                                                               duplicate key could replace, nesting too deep).
 *
 * What msgpack-python's unpackb (as decode calls it) refuses, this refuses: truncated or trailing bytes, the
 * never-used byte 0xc1, every ext type, strings that are not strict UTF-8 (no surrogates, no overlongs), map keys
 * other than str or bin. Its length limits (bounded by the payload size) cannot be exceeded by a document that
 * fits in the payload, so they need no check of their own.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#include "../shmstat/_c/layout.h" /* MAX_TOPIC, MAX_PAYLOAD, WIRE_VERSION: generated from shmstat/wire/__init__.py */
#define STR_(x) #x
#define STR(x) STR_(x)
#define MAX_DEPTH 512 /* msgpack-python refuses 1024; deeper than this we leave to decode */

enum { OK = 0, BAD, SEM, UNSURE };
/* BAD: msgpack-python refuses the bytes; SEM: they unpack but decode refuses what they hold; UNSURE: ask decode */

typedef struct {
    const uint8_t *p, *end;
    const char *why; /* reason of the first BAD or SEM */
} Rd;

static int
fail(Rd *r, int code, const char *why)
{
    r->why = why;
    return code;
}

static inline uint64_t
be(const uint8_t *p, int n)
{
    uint64_t v = 0;
    for (int i = 0; i < n; i++) {
        v = (v << 8) | p[i];
    }
    return v;
}

/* Strict UTF-8, as Python's decoder: no overlongs, no surrogates, nothing past U+10FFFF. */
static inline int
utf8_ok(const uint8_t *s, size_t n)
{
    size_t i = 0;
    if (n <= 16) { /* the common short key or name: all ASCII? */
        uint8_t any = 0;
        for (size_t j = 0; j < n; j++) any |= s[j];
        if (!(any & 0x80)) return 1;
    }
    while (i < n) {
        while (i + 8 <= n) {
            uint64_t w;
            memcpy(&w, s + i, 8);
            if (w & 0x8080808080808080ULL) break;
            i += 8;
        }
        if (i >= n) break;
        uint8_t c = s[i];
        if (c < 0x80) { i++; continue; }
        if (c >= 0xc2 && c <= 0xdf) {
            if (i + 1 >= n || (s[i + 1] & 0xc0) != 0x80) return 0;
            i += 2;
        }
        else if (c >= 0xe0 && c <= 0xef) {
            if (i + 2 >= n) return 0;
            uint8_t c1 = s[i + 1];
            if ((c1 & 0xc0) != 0x80 || (s[i + 2] & 0xc0) != 0x80) return 0;
            if (c == 0xe0 && c1 < 0xa0) return 0;  /* overlong */
            if (c == 0xed && c1 > 0x9f) return 0;  /* surrogate */
            i += 3;
        }
        else if (c >= 0xf0 && c <= 0xf4) {
            if (i + 3 >= n) return 0;
            uint8_t c1 = s[i + 1];
            if ((c1 & 0xc0) != 0x80 || (s[i + 2] & 0xc0) != 0x80 || (s[i + 3] & 0xc0) != 0x80) return 0;
            if (c == 0xf0 && c1 < 0x90) return 0;  /* overlong */
            if (c == 0xf4 && c1 > 0x8f) return 0;  /* past U+10FFFF */
            i += 4;
        }
        else {
            return 0;
        }
    }
    return 1;
}

/* Reads n bytes of header after the type byte; BAD if the payload ends first. */
static inline int
take(Rd *r, size_t n, const uint8_t **at)
{
    if ((size_t)(r->end - r->p) < n) return fail(r, BAD, "the payload is not a valid msgpack document (truncated)");
    *at = r->p;
    r->p += n;
    return OK;
}

/* What the next object is. */
enum { T_NIL, T_BOOL, T_INT, T_FLOAT, T_STR, T_BIN, T_ARRAY, T_MAP, T_EXT, T_NEVER };

static uint8_t TYPES[256]; /* type of each first byte, filled at import */

static void
init_types(void)
{
    for (int c = 0; c < 256; c++) {
        int t;
        if (c <= 0x7f || c >= 0xe0) t = T_INT;
        else if (c <= 0x8f) t = T_MAP;
        else if (c <= 0x9f) t = T_ARRAY;
        else if (c <= 0xbf) t = T_STR;
        else if (c == 0xc0) t = T_NIL;
        else if (c == 0xc1) t = T_NEVER;
        else if (c <= 0xc3) t = T_BOOL;
        else if (c <= 0xc6) t = T_BIN;
        else if (c <= 0xc9) t = T_EXT;
        else if (c <= 0xcb) t = T_FLOAT;
        else if (c <= 0xd3) t = T_INT;
        else if (c <= 0xd8) t = T_EXT;
        else if (c <= 0xdb) t = T_STR;
        else if (c <= 0xdd) t = T_ARRAY;
        else t = T_MAP;
        TYPES[c] = (uint8_t)t;
    }
}

static inline int
peek(Rd *r, int *t)
{
    if (r->p >= r->end) return fail(r, BAD, "the payload is not a valid msgpack document (truncated)");
    *t = TYPES[*r->p];
    if (*t == T_EXT) return fail(r, BAD, "the payload contains a msgpack ext type, which is refused");
    if (*t == T_NEVER) return fail(r, BAD, "the payload is not a valid msgpack document (byte 0xc1)");
    return OK;
}

/* Reads a str or bin (the caller peeked its type): its bytes, UTF-8 checked for a str. */
static inline int
read_raw(Rd *r, const uint8_t **s, size_t *n)
{
    uint8_t c = *r->p++;
    const uint8_t *h;
    size_t len;
    if (c >= 0xa0 && c <= 0xbf) { /* fixstr, the common case */
        len = c & 0x1f;
        if ((size_t)(r->end - r->p) < len) return fail(r, BAD, "the payload is not a valid msgpack document (truncated)");
        *s = r->p;
        r->p += len;
        *n = len;
        if (!utf8_ok(*s, len)) return fail(r, BAD, "the payload is not a valid msgpack document (a string is not UTF-8)");
        return OK;
    }
    else {
        int w = (c == 0xd9 || c == 0xc4) ? 1 : (c == 0xda || c == 0xc5) ? 2 : 4;
        if (take(r, (size_t)w, &h) != OK) return BAD;
        len = (size_t)be(h, w);
    }
    if (take(r, len, s) != OK) return BAD;
    *n = len;
    if ((c < 0xc4 || c > 0xc6) && !utf8_ok(*s, len)) {
        return fail(r, BAD, "the payload is not a valid msgpack document (a string is not UTF-8)");
    }
    return OK;
}

/* Reads a container header (the caller peeked its type): its number of entries. */
static inline int
read_len(Rd *r, size_t *n)
{
    uint8_t c = *r->p++;
    const uint8_t *h;
    if ((c >= 0x80 && c <= 0x9f)) { *n = c & 0x0f; return OK; }
    int w = (c == 0xdc || c == 0xde) ? 2 : 4;
    if (take(r, (size_t)w, &h) != OK) return BAD;
    *n = (size_t)be(h, w);
    return OK;
}

/* Reads an int (the caller peeked T_INT): *neg and the magnitude-or-value in *u (as int64 when *neg). */
static inline int
read_int(Rd *r, int *neg, uint64_t *u)
{
    uint8_t c = *r->p++;
    const uint8_t *h;
    *neg = 0;
    if (c <= 0x7f) { *u = c; return OK; }
    if (c >= 0xe0) { *neg = 1; *u = (uint64_t)(int64_t)(int8_t)c; return OK; }
    int w = 1 << ((c - 0xcc) & 3);
    if (take(r, (size_t)w, &h) != OK) return BAD;
    uint64_t v = be(h, w);
    if (c <= 0xcf) { *u = v; return OK; }
    int64_t s = w == 1 ? (int8_t)v : w == 2 ? (int16_t)v : w == 4 ? (int32_t)v : (int64_t)v;
    *neg = s < 0;
    *u = (uint64_t)s;
    return OK;
}

static inline int
skip_scalar(Rd *r, int t)
{
    const uint8_t *h;
    uint8_t c = *r->p;
    switch (t) {
    case T_NIL: case T_BOOL: r->p++; return OK;
    case T_INT: { int neg; uint64_t u; return read_int(r, &neg, &u); }
    case T_FLOAT: r->p++; return take(r, c == 0xca ? 4 : 8, &h);
    default: { const uint8_t *s; size_t n; return read_raw(r, &s, &n); } /* T_STR, T_BIN */
    }
}

/* Skips one object of any shape, checking what msgpack-python checks. */
static int
skip(Rd *r, int depth)
{
    int t, rc;
    if ((rc = peek(r, &t)) != OK) return rc;
    if (t != T_ARRAY && t != T_MAP) return skip_scalar(r, t);
    if (depth >= MAX_DEPTH) return UNSURE;
    size_t n;
    if ((rc = read_len(r, &n)) != OK) return rc;
    if (n > (size_t)(r->end - r->p)) return fail(r, BAD, "the payload is not a valid msgpack document (truncated)");
    for (size_t j = 0; j < n; j++) {
        if (t == T_MAP) {
            int kt;
            if ((rc = peek(r, &kt)) != OK) return rc;
            if (kt != T_STR && kt != T_BIN) {
                return fail(r, BAD, "the payload is not a valid msgpack document (a map key is not a str)");
            }
            if ((rc = skip_scalar(r, kt)) != OK) return rc;
        }
        if ((rc = skip(r, depth + 1)) != OK) return rc;
    }
    return OK;
}

/* Reads a str where decode wants one: SEM if the next object is something else (left unread). */
static inline int
want_str(Rd *r, const uint8_t **s, size_t *n, const char *why)
{
    int t, rc;
    if ((rc = peek(r, &t)) != OK) return rc;
    if (t != T_STR) return fail(r, SEM, why);
    return read_raw(r, s, n);
}

static inline int
want_int(Rd *r, int *neg, uint64_t *u, const char *why)
{
    int t, rc;
    if ((rc = peek(r, &t)) != OK) return rc;
    if (t != T_INT) return fail(r, SEM, why);
    return read_int(r, neg, u);
}

static inline int
want_array(Rd *r, size_t want, const char *why)
{
    int t, rc;
    size_t n;
    if ((rc = peek(r, &t)) != OK) return rc;
    if (t != T_ARRAY) return fail(r, SEM, why);
    if ((rc = read_len(r, &n)) != OK) return rc;
    return n == want ? OK : fail(r, SEM, why);
}

/* An event item: [name == rest, ts_ns: int, data: {str: str | int | float | bool}]. */
static int
check_event(Rd *r, const uint8_t *rest, size_t rest_n)
{
    int rc, t, neg;
    const uint8_t *s;
    size_t n, m;
    uint64_t u;
    if ((rc = want_array(r, 3, "an event item is not a [name, ts_ns, data] array")) != OK) return rc;
    if ((rc = want_str(r, &s, &n, "an event item's name does not match its topic")) != OK) return rc;
    if (n != rest_n || memcmp(s, rest, n) != 0) return fail(r, SEM, "an event item's name does not match its topic");
    if ((rc = want_int(r, &neg, &u, "an event item's ts_ns is not an int")) != OK) return rc;
    if ((rc = peek(r, &t)) != OK) return rc;
    if (t != T_MAP) return fail(r, SEM, "an event item's data is not a map");
    if ((rc = read_len(r, &m)) != OK) return rc;
    for (size_t j = 0; j < m; j++) {
        if ((rc = peek(r, &t)) != OK) return rc;
        if (t == T_BIN) return fail(r, SEM, "an event item's data has a key that is not a str");
        if (t != T_STR) return fail(r, BAD, "the payload is not a valid msgpack document (a map key is not a str)");
        if ((rc = read_raw(r, &s, &n)) != OK) return rc;
        if ((rc = peek(r, &t)) != OK) return rc;
        if (t != T_STR && t != T_INT && t != T_FLOAT && t != T_BOOL) return UNSURE; /* a later duplicate key may
                                                                                       replace this value */
        if ((rc = skip_scalar(r, t)) != OK) return rc;
    }
    return OK;
}

/* A metric item: [group: str, name: str, value: int | float | bool, ts: float | int], group/name == rest, no '/' in
 * group. */
static int
check_metric(Rd *r, const uint8_t *rest, size_t rest_n)
{
    int rc, t;
    const uint8_t *g, *s;
    size_t gn, n;
    const char *gn_why = "a metric item's group or name is not a str";
    if ((rc = want_array(r, 4, "a metric item is not a [group, name, value, ts] array")) != OK) return rc;
    if ((rc = want_str(r, &g, &gn, gn_why)) != OK) return rc;
    if ((rc = want_str(r, &s, &n, gn_why)) != OK) return rc;
    if (memchr(g, '/', gn) != NULL) return fail(r, SEM, "a metric item's group holds '/'");
    if (gn + 1 + n != rest_n || memcmp(g, rest, gn) != 0 || rest[gn] != '/' || memcmp(s, rest + gn + 1, n) != 0) {
        return fail(r, SEM, "a metric item's group and name do not match its topic");
    }
    if ((rc = peek(r, &t)) != OK) return rc;
    if (t != T_INT && t != T_FLOAT && t != T_BOOL) return fail(r, SEM, "a metric item's value is not an int, float or bool");
    if ((rc = skip_scalar(r, t)) != OK) return rc;
    if ((rc = peek(r, &t)) != OK) return rc;
    if (t != T_INT && t != T_FLOAT) return fail(r, SEM, "a metric item's ts is not a float");
    return skip_scalar(r, t);
}

static const char *KEYS[7] = {"v", "k", "r", "p", "i", "s", "items"};

static PyObject *
check(PyObject *self, PyObject *args)
{
    Py_buffer tb, pb;
    if (!PyArg_ParseTuple(args, "y*y*:check", &tb, &pb)) return NULL;
    PyObject *res = NULL;
    const char *why = NULL;
    const uint8_t *topic = tb.buf;
    size_t tn = (size_t)tb.len;
    int is_event;
    const uint8_t *rest;
    size_t rest_n;
    if (tn > MAX_TOPIC) { why = "the topic is longer than MAX_TOPIC"; goto done; }
    if (!utf8_ok(topic, tn)) { why = "the topic is not valid UTF-8"; goto done; }
    if (tn >= 6 && memcmp(topic, "event/", 6) == 0) { is_event = 1; rest = topic + 6; rest_n = tn - 6; }
    else if (tn >= 7 && memcmp(topic, "metric/", 7) == 0) { is_event = 0; rest = topic + 7; rest_n = tn - 7; }
    else if ((tn >= 5 && memcmp(topic, "stat/", 5) == 0) || (tn >= 5 && memcmp(topic, "rank/", 5) == 0)) {
        res = Py_None; Py_INCREF(res); goto done;
    }
    else { why = "the topic does not start with event/, metric/, stat/ or rank/"; goto done; }
    if (pb.len > MAX_PAYLOAD) { why = "the payload is larger than MAX_PAYLOAD"; goto done; }

    Rd rd = {pb.buf, (const uint8_t *)pb.buf + pb.len, NULL};
    Rd *r = &rd;
    int rc = OK, t, sem = 0, neg;
    const char *sem_why = NULL;
    unsigned seen = 0;
    int64_t rank = 0;
    uint64_t hv[3] = {0, 0, 0}, u = 0; /* pid, incarnation, seq */
    size_t nkeys, n_items = 0;
    if ((rc = peek(r, &t)) != OK) goto verdict;
    if (t != T_MAP) { rc = fail(r, BAD, "the payload is not a msgpack map"); goto verdict; }
    if ((rc = read_len(r, &nkeys)) != OK) goto verdict;
    for (size_t j = 0; j < nkeys; j++) {
        const uint8_t *k;
        size_t kn;
        if ((rc = peek(r, &t)) != OK) goto verdict;
        if (t != T_STR && t != T_BIN) {
            rc = fail(r, BAD, "the payload is not a valid msgpack document (a map key is not a str)");
            goto verdict;
        }
        if ((rc = read_raw(r, &k, &kn)) != OK) goto verdict;
        int idx = -1;
        if (t == T_STR) {
            for (int q = 0; q < 7; q++) {
                if (strlen(KEYS[q]) == kn && memcmp(KEYS[q], k, kn) == 0) { idx = q; break; }
            }
        }
        if (idx < 0) { rc = fail(r, SEM, "the payload has unknown keys"); goto verdict; }
        if (seen & (1u << idx)) { rc = UNSURE; goto verdict; } /* decode keeps the last value: let it judge */
        seen |= 1u << idx;
        const uint8_t *start = r->p;
        const uint8_t *s;
        size_t n;
        switch (idx) {
        case 0: /* v */
            rc = want_int(r, &neg, &u, "the payload has a wire version other than " STR(WIRE_VERSION));
            if (rc == OK && (neg || u != WIRE_VERSION)) {
                rc = fail(r, SEM, "the payload has a wire version other than " STR(WIRE_VERSION));
            }
            break;
        case 1: /* k */
            rc = want_str(r, &s, &n, "the payload kind does not match the topic prefix");
            if (rc == OK && !(is_event ? (n == 5 && memcmp(s, "event", 5) == 0)
                                       : (n == 6 && memcmp(s, "metric", 6) == 0))) {
                rc = fail(r, SEM, "the payload kind does not match the topic prefix");
            }
            break;
        case 2: /* r */
            rc = want_int(r, &neg, &u, "the payload header is invalid: rank is not an int >= -1");
            if (rc == OK && neg && (int64_t)u < -1) rc = fail(r, SEM, "the payload header is invalid: rank is not an int >= -1");
            if (rc == OK && !neg && u > (uint64_t)INT64_MAX) { rc = UNSURE; }
            rank = (int64_t)u;
            break;
        case 3: case 4: case 5: /* p, i, s */
            rc = want_int(r, &neg, &u, "the payload header is invalid: pid, incarnation or seq is not an int >= 0");
            if (rc == OK && neg) rc = fail(r, SEM, "the payload header is invalid: pid, incarnation or seq is not an int >= 0");
            hv[idx - 3] = u;
            break;
        default: /* items */
            if ((rc = peek(r, &t)) != OK) break;
            if (t != T_ARRAY) { rc = fail(r, SEM, "the payload items are not a non-empty array"); break; }
            if ((rc = read_len(r, &n_items)) != OK) break;
            if (n_items == 0) { rc = fail(r, SEM, "the payload items are not a non-empty array"); break; }
            if (n_items > (size_t)(r->end - r->p)) { rc = fail(r, BAD, "the payload is not a valid msgpack document (truncated)"); break; }
            for (size_t q = 0; q < n_items && rc == OK; q++) {
                rc = is_event ? check_event(r, rest, rest_n) : check_metric(r, rest, rest_n);
            }
        }
        if (rc == SEM) {
            /* decode refuses this value unless a later key replaces it: go on, checking only the bytes */
            if (!sem) { sem = 1; sem_why = r->why; }
            r->p = start;
            rc = skip(r, 1);
        }
        if (rc != OK) goto verdict;
    }
    if (r->p != r->end) { rc = fail(r, BAD, "the payload is not a valid msgpack document (extra bytes)"); goto verdict; }
    if (seen != 0x7f) { rc = fail(r, SEM, "the payload is missing keys"); goto verdict; }
    if (sem) { rc = SEM; r->why = sem_why; goto verdict; }
    res = Py_BuildValue("(sLKKKn)", is_event ? "event" : "metric", (long long)rank, (unsigned long long)hv[0],
                        (unsigned long long)hv[1], (unsigned long long)hv[2], (Py_ssize_t)n_items);
    goto done;
verdict:
    if (rc == UNSURE) { res = Py_None; Py_INCREF(res); }
    else { why = r->why ? r->why : "the payload is not valid"; }
done:
    if (res == NULL && why != NULL) res = PyUnicode_FromString(why);
    PyBuffer_Release(&tb);
    PyBuffer_Release(&pb);
    return res;
}

static PyMethodDef methods[] = {
    {"check", check, METH_VARARGS,
     "check(topic, payload) -> (kind, rank, pid, incarnation, first_seq, n_items) | str | None\n\n"
     "Validate one event or metric message as shmstat.wire.decode would: the header if it is valid, the reason "
     "if decode would refuse it, None when decode must judge (stat and rank kinds, unusual payloads)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "collector._intake", "Optional C check of the collector's intake (see collector/relay/intake.py).",
    -1, methods,
};

PyMODINIT_FUNC
PyInit__intake(void)
{
    init_types();
    return PyModule_Create(&module);
}
