/* The msgpack writer: a growing byte buffer and the encodings msgpack-python writes. Part of shmstat/_pubfast.c, which includes it (one compilation unit). */
#ifndef SHMSTAT_PACK_H
#define SHMSTAT_PACK_H

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

#endif /* SHMSTAT_PACK_H */
