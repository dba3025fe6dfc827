/* Optional C hot path for ``Stat.add``: ``SlotWriter.add`` does exactly what the pure-Python ``add``/``_roll`` of
 * ``shmstat.writer._pywriter.PySlotWriter`` do, on the same bytes of the segment (or of an in-process Stat's buffer).
 *
 * The binary layout and the seqlock protocol are defined in ``shmstat/shm/layout.py`` (the one source of truth);
 * this file takes its constants from the header generated from it (``_c/layout.h``). Bank (64 bytes, 8-byte words, little-endian):
 *   0 seq f64 | 8 wid i64 | 16 sum f64 | 24 min f64 | 32 max f64 | 40 last f64 | 48 last_ts i64 | 56 inc u64
 * ``seq`` is 2 * count as a double, plus 1 while a write is in progress.
 *
 * Memory ordering. Every bank has one writer (this process); readers in other processes copy the bank and
 * accept the copy only if ``seq`` (and ``wid``) read the same before and after and ``seq`` is even. So the
 * writer must make the odd ``seq`` visible before any data word and every data word visible before the even
 * ``seq``. That is the classic seqlock writer (Boehm, "Can seqlocks get along with programming language
 * memory models?", 2012):
 *     seq = odd (relaxed store); release fence; data words (relaxed stores); seq = even (release store).
 * The release fence orders the odd ``seq`` before the later data stores; the release store orders the data
 * before the even ``seq``. All words are stored with __atomic builtins (8-byte aligned, so single untorn
 * stores) so that neither the compiler nor the CPU may reorder, merge or split them. On x86-64 all of this
 * compiles to plain ``mov`` stores (TSO keeps store order); on weaker CPUs the fences emit real barriers.
 * The per-rank counters (nan_count, discarded) and the heartbeat have only this writer too: a relaxed
 * load + store is enough (no locked read-modify-write), exactly like the Python ``q[i] += 1``.
 *
 * The hot path allocates nothing, takes no lock and makes no system call beyond clock_gettime (vDSO).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <float.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "shmstat._fastpath stores native words; the segment layout is little-endian"
#endif

/* The bank (BANK_SIZE, B_* byte offsets) and its histogram (HIST_SIZE, HIST_M, HIST_MAX_SCALE, HI_*, HIST_COUNTS;
 * semantics in shmstat/histogram.py), generated from shmstat/shm/layout.py. A bank's histogram is written only while
 * the bank's seq is odd, so the bank's seqlock covers it. */
#include "_c/layout.h"

static inline void
st_f64(char *p, double v)
{
    __atomic_store((double *)p, &v, __ATOMIC_RELAXED);
}

static inline void
st_f64_release(char *p, double v)
{
    __atomic_store((double *)p, &v, __ATOMIC_RELEASE);
}

static inline void
st_i64(char *p, int64_t v)
{
    __atomic_store_n((int64_t *)p, v, __ATOMIC_RELAXED);
}

/* Single-writer counter: plain load + store, no locked instruction (wraps like a u64). */
static inline void
bump_u64(char *p)
{
    uint64_t n = __atomic_load_n((uint64_t *)p, __ATOMIC_RELAXED);
    __atomic_store_n((uint64_t *)p, n + 1, __ATOMIC_RELAXED);
}

/* Counter shared by several processes (the drop counters): one locked read-modify-write. */
static inline void
add_shared_u64(char *p, uint64_t n)
{
    __atomic_fetch_add((uint64_t *)p, n, __ATOMIC_RELAXED);
}

/* Python's // and % for a positive divisor. */
static inline int64_t
floor_div(int64_t a, int64_t b)
{
    int64_t q = a / b;
    return (a % b != 0 && a < 0) ? q - 1 : q;
}

static inline int64_t
floor_mod(int64_t a, int64_t b)
{
    int64_t r = a % b;
    return r < 0 ? r + b : r;
}

static inline int64_t ld_i64(const char *p) { return __atomic_load_n((const int64_t *)p, __ATOMIC_RELAXED); }
static inline uint32_t ld_u32(const char *p) { return __atomic_load_n((const uint32_t *)p, __ATOMIC_RELAXED); }
static inline void st_u32(char *p, uint32_t v) { __atomic_store_n((uint32_t *)p, v, __ATOMIC_RELAXED); }

/* Position of bucket ``i`` in a sign's ring of HIST_M counts. */
static inline int64_t hist_pos(int64_t i) { return floor_mod(i, HIST_M); }

/* An empty histogram at the highest scale; zeroes only the counts the previous window used (a garbage
 * header means all of them). */
static void
hist_reset(char *h)
{
    for (int side = 0; side < 2; side++) {
        char *range = h + HI_POS_LO + 16 * side;
        char *counts = h + HIST_COUNTS + 4 * HIST_M * side;
        int64_t lo = ld_i64(range), hi = ld_i64(range + 8);
        if (lo <= hi && hi - lo < HIST_M) {
            for (int64_t i = lo; i <= hi; i++) {
                st_u32(counts + 4 * hist_pos(i), 0);
            }
        }
        else if (lo <= hi) {
            for (int64_t j = 0; j < HIST_M; j++) {
                st_u32(counts + 4 * j, 0);
            }
        }
        st_i64(range, INT64_MAX);
        st_i64(range + 8, INT64_MIN);
    }
    st_i64(h + HI_SCALE, HIST_MAX_SCALE);
    st_i64(h + HI_ZERO, 0);
    st_i64(h + HI_POS_INF, 0);
    st_i64(h + HI_NEG_INF, 0);
}

/* Shift one sign's buckets right by ``by`` (a lower scale): counts of merging buckets add up. */
static void
hist_shift_side(char *h, int side, int by)
{
    char *range = h + HI_POS_LO + 16 * side;
    char *counts = h + HIST_COUNTS + 4 * HIST_M * side;
    int64_t lo = ld_i64(range), hi = ld_i64(range + 8);
    if (lo > hi) {
        return;
    }
    uint64_t tmp[HIST_M];
    int64_t nlo = lo >> by, nhi = hi >> by;
    memset(tmp, 0, sizeof(uint64_t) * (size_t)(nhi - nlo + 1));
    for (int64_t i = lo; i <= hi; i++) {
        char *c = counts + 4 * hist_pos(i);
        tmp[(i >> by) - nlo] += ld_u32(c);
        st_u32(c, 0);
    }
    for (int64_t j = nlo; j <= nhi; j++) {
        uint64_t n = tmp[j - nlo];
        st_u32(counts + 4 * hist_pos(j), n > UINT32_MAX ? UINT32_MAX : (uint32_t)n);
    }
    st_i64(range, nlo);
    st_i64(range + 8, nhi);
}

/* Count one sample (not NaN) in the histogram at ``h``; the scale is lowered just enough when needed. An
 * infinity is counted apart (pos_inf / neg_inf) and never changes the scale. */
static void
hist_add(char *h, double v)
{
    if (v == 0.0) {
        st_i64(h + HI_ZERO, ld_i64(h + HI_ZERO) + 1);
        return;
    }
    double m = fabs(v);
    if (m > DBL_MAX) {
        char *n = h + (v > 0 ? HI_POS_INF : HI_NEG_INF);
        st_i64(n, ld_i64(n) + 1);
        return;
    }
    int64_t i8 = (int64_t)ceil(log2(m) * 256.0) - 1;
    int side = v > 0 ? 0 : 1;
    char *range = h + HI_POS_LO + 16 * side;
    int64_t scale = ld_i64(h + HI_SCALE);
    int64_t i = i8 >> (HIST_MAX_SCALE - scale);
    int64_t lo = ld_i64(range), hi = ld_i64(range + 8);
    if (lo > hi) {
        lo = hi = i;
    }
    else if (i < lo || i > hi) {
        int64_t nlo = i < lo ? i : lo, nhi = i > hi ? i : hi;
        int by = 0;
        while ((nhi >> by) - (nlo >> by) >= HIST_M) {
            by++;
        }
        if (by) {
            hist_shift_side(h, 0, by);
            hist_shift_side(h, 1, by);
            scale -= by;
            st_i64(h + HI_SCALE, scale);
            i = i8 >> (HIST_MAX_SCALE - scale);
            lo = ld_i64(range);
            hi = ld_i64(range + 8);
            if (lo > hi) {
                lo = hi = i;
            }
        }
        if (i < lo) {
            lo = i;
        }
        if (i > hi) {
            hi = i;
        }
    }
    st_i64(range, lo);
    st_i64(range + 8, hi);
    char *c = h + HIST_COUNTS + 4 * HIST_M * side + 4 * hist_pos(i);
    uint32_t n = ld_u32(c);
    if (n != UINT32_MAX) {
        st_u32(c, n + 1);
    }
}

typedef struct {
    PyObject_HEAD
    Py_buffer view;      /* the whole segment, held (and so kept mapped) for this object's life */
    int have_view;
    char *slot0;         /* bank 0 of the slot */
    char *bank;          /* bank of the open window (bank 0 before the first roll, as in the Python code) */
    char *nan_p;         /* rank entry: nan_count */
    char *disc_p;        /* rank entry: discarded */
    char *beat_p;        /* rank entry: heartbeat_ns */
    int64_t nbanks;
    int64_t window_ns;
    int64_t incarnation;
    int64_t wend;        /* end (ns, exclusive) of the open window; 0 before the first sample */
    double max2;         /* 2.0 * max_samples, the seq at which the window is full */
    double seq, sum, min, max, last;  /* this process's copy of the open window (never read back) */
    int full_reported;   /* the open window reached max_samples and was reported to on_roll then (torch.monitor
                          * logs a full window at once): the roll reports it no more, count() says 0 */
    int want_last;
    PyObject *on_roll;   /* NULL or callable(count, sum, min, max, last, t), called after the roll is done */
    PyObject *clock;     /* NULL (clock_gettime(CLOCK_REALTIME)) or callable() -> int ns */
    PyObject *on_fork;   /* NULL or callable() that rebind()s this writer in a forked child */
    uint64_t generation; /* fork_generation when this writer was bound to its slot */
    int busy;            /* an add with an injected clock is in progress (the clock call may switch threads) */
    char *hist0;         /* NULL, or bank 0's histogram (a stat with percentiles) */
    char *hist;          /* the open window's histogram (hist0 before the first roll) */
    char *drop_p;        /* NULL, or (drop mode: no slot) a counter that every add bumps atomically instead */
    char *guard_p;       /* NULL, or (a window under the ring's shortest) the slot's emitted_wid: a bank holding a
                          * later window than that is not overwritten */
    char *gdrop_p;       /* with guard_p: the counter a sample that found its bank so held is dropped into */
    int blocked;         /* the open window (wend) found its bank held: its samples are dropped until it is free */
    char *closed_hist;   /* NULL, or (keep_closed_hist) HIST_SIZE bytes: the histogram of the window last reported
                          * with samples, copied before its bank is reused (a one-bank buffer reuses it at once) */
    int have_closed;     /* closed_hist holds a window */
} SlotWriter;

/* Bumped in the child of every fork: a writer bound before the fork must not write its parent's slot. */
static volatile uint64_t fork_generation = 0;

static void
bump_fork_generation(void)
{
    fork_generation++;
}

/* What a roll leaves for on_roll, called once the bank is consistent (and, with an injected clock, once this
 * writer is free again): Python code may switch threads, and another thread may then add to this writer. */
typedef struct {
    int pending;
    long long count;
    double sum, min, max, last;
    long long t;
} Rolled;

static int check_word(const char *what, Py_ssize_t off, Py_ssize_t len, Py_ssize_t size);

/* Convert anything but an exact float like PyFloat_AsDouble (int, bool, float subclasses, __float__,
 * __index__); -1.0 with an error set (TypeError for a non-number) on failure. */
static double
as_double_slow(PyObject *v)
{
    if (PyLong_Check(v)) { /* int and bool, without allocating a float */
        return PyLong_AsDouble(v);
    }
    return PyFloat_AsDouble(v);
}

/* The wall clock in ns; -1 with an error set on failure (only possible with an injected clock). */
static inline int64_t
now_ns(SlotWriter *self)
{
    if (self->clock == NULL) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        return (int64_t)ts.tv_sec * 1000000000LL + (int64_t)ts.tv_nsec;
    }
    PyObject *r = PyObject_CallNoArgs(self->clock);
    if (r == NULL) {
        return -1;
    }
    long long t = PyLong_AsLongLong(r);
    Py_DECREF(r);
    return (int64_t)t;
}

static inline double ld_f64(const char *p) { double v; __atomic_load((const double *)p, &v, __ATOMIC_RELAXED); return v; }

/* keep_closed_hist: the open window's histogram, copied aside as it is reported (PySlotWriter._report). */
static inline void
keep_hist(SlotWriter *self)
{
    if (self->closed_hist != NULL && self->hist0 != NULL) {
        memcpy(self->closed_hist, self->hist, HIST_SIZE);
        self->have_closed = 1;
    }
}

/* A window that just became full is reported now, as torch.monitor logs it (the collector reads it from the bank
 * all the same); a writer without on_roll (none in use) keeps counting it as open. */
static inline void
report_if_full(SlotWriter *self, Rolled *rolled, int64_t t)
{
    if (self->seq >= self->max2 && self->on_roll != NULL) {
        self->full_reported = 1;
        keep_hist(self);
        rolled->pending = 1;
        rolled->count = (long long)self->seq >> 1;
        rolled->sum = self->sum;
        rolled->min = self->min;
        rolled->max = self->max;
        rolled->last = self->last;
        rolled->t = (long long)t;
    }
}

/* The samples (as 2 * count) an earlier writer of this slot left in window ``wid``'s bank ``b``, which this
 * writer continues instead of starting it empty: a rank restarted (or attached again) inside a window keeps the
 * earlier incarnation's samples of that window, which the window's one row then holds. 0.0 when the bank holds
 * another window or nothing. A bank left odd by a writer that died in an add keeps its complete samples. Not
 * for windows over LONG_WINDOW_NS: the earlier writer's end closes those, and the collector emits them apart. */
static double
resumable(const SlotWriter *self, const char *b, int64_t wid)
{
    if (self->window_ns > LONG_WINDOW_NS || ld_i64(b + B_WID) != wid) {
        return 0.0;
    }
    double seq = ld_f64(b + B_SEQ);
    if (!(seq >= 2.0 && seq < 0x1p62)) { /* empty, or garbage (NaN, negative, absurd): started empty */
        return 0.0;
    }
    return 2.0 * floor(seq / 2.0);
}

/* Whether bank ``b``, about to take window ``wid``, holds an earlier window with samples (or a write cut short)
 * that no collector has emitted yet (the guard: past the slot's emitted_wid). Such a bank is not overwritten. */
static inline int
held_unread(const SlotWriter *self, const char *b, int64_t wid)
{
    int64_t old = ld_i64(b + B_WID);
    double seq = ld_f64(b + B_SEQ);
    return old < wid && seq >= 1.0 && seq < 0x1p62 && old > ld_i64(self->guard_p);
}

/* The first sample of this writer into a window an earlier writer left ``kept`` samples in (its bank ``b`` is
 * marked odd, with seq = kept + 1): take the window's figures from the bank and add ``v`` as add_locked() would. */
static int
resume(SlotWriter *self, char *b, double kept, double v, int64_t t, Rolled *rolled)
{
    self->seq = kept;
    self->sum = ld_f64(b + B_SUM);
    self->min = ld_f64(b + B_MIN);
    self->max = ld_f64(b + B_MAX);
    self->last = ld_f64(b + B_LAST);
    if (kept >= self->max2) { /* the earlier writer filled the window already */
        st_f64_release(b + B_SEQ, kept);
        self->full_reported = 1;
        bump_u64(self->disc_p);
        return 0;
    }
    self->sum += v;
    st_f64(b + B_SUM, self->sum);
    if (v < self->min) {
        self->min = v;
        st_f64(b + B_MIN, v);
    }
    if (v > self->max) {
        self->max = v;
        st_f64(b + B_MAX, v);
    }
    if (self->want_last) {
        self->last = v;
        st_f64(b + B_LAST, v);
        st_i64(b + B_TS, t);
    }
    if (self->hist0 != NULL) {
        hist_add(self->hist, v);
    }
    self->seq = kept + 2.0;
    st_f64_release(b + B_SEQ, self->seq);
    st_i64(self->beat_p, t);
    report_if_full(self, rolled, t);
    return 0;
}

/* Slow path, once per window: report the previous window to on_roll, then start the window of ``t``.
 *
 * The new window's bank is marked (odd seq, wid) before the clock is read again: if that second reading is
 * still inside the window, no collector can have closed the window without seeing the mark (it closes a
 * window only once its clock is past the window's end plus a grace, then reads the bank), so the sample is
 * written into a window that is still to be emitted. Otherwise the window ended while this call was
 * descheduled: the bank is left empty and the sample goes to the window of the later reading (a time
 * inside this call as well). The full fence keeps the mark from waiting in the store buffer past the clock
 * reading; it costs ~20 ns, once per window. */
static int
roll(SlotWriter *self, double v, int64_t t, Rolled *rolled)
{
    if (isnan(v)) {
        bump_u64(self->nan_p);
        return 0;
    }
    if (self->on_roll != NULL && (self->seq != 0.0 || self->wend != 0)) {
        /* Python: ``if seq: core.last = WindowFigures(...)`` / ``elif wend: core.last = WindowFigures()``: an empty
         * previous window is reported as count 0 with zeros. Reported by the caller after the roll. */
        int any = self->seq != 0.0 && !self->full_reported;
        if (any) {
            keep_hist(self); /* before the bank (and with one bank, its histogram) is reused below */
        }
        rolled->pending = 1;
        rolled->count = any ? (long long)self->seq >> 1 : 0;
        rolled->sum = any ? self->sum : 0.0;
        rolled->min = any ? self->min : 0.0;
        rolled->max = any ? self->max : 0.0;
        rolled->last = any ? self->last : 0.0;
        rolled->t = (long long)t;
    }
    self->full_reported = 0;
    int first = self->wend == 0; /* this binding's first window: the bank may hold an earlier writer's samples */
    char *b;
    int64_t wid, wend;
    double kept; /* 2 * the samples an earlier writer of this slot left in the window (0: none, a fresh bank) */
    for (;;) {
        wid = floor_div(t, self->window_ns);
        if (__builtin_mul_overflow(wid + 1, self->window_ns, &wend)) {
            wend = INT64_MAX;
        }
        int64_t k = floor_mod(wid, self->nbanks);
        b = self->slot0 + k * BANK_SIZE;
        if (self->hist0 != NULL) {
            self->hist = self->hist0 + k * HIST_SIZE;
        }
        kept = first ? resumable(self, b, wid) : 0.0;
        if (kept == 0.0 && self->guard_p != NULL && held_unread(self, b, wid)) {
            /* The ring cannot hold this window at the collector's pace: the sample is dropped and counted, and so
             * is every later one of this window until the collector has emitted what the bank holds. */
            add_shared_u64(self->gdrop_p, 1);
            self->wend = wend;
            self->bank = b;
            self->seq = 0.0;
            self->blocked = 1;
            return 0;
        }
        st_f64(b + B_SEQ, kept + 1.0);
        __atomic_thread_fence(__ATOMIC_RELEASE); /* odd seq before the data */
        st_i64(b + B_WID, wid);
        st_i64(b + B_INC, self->incarnation);
        __atomic_thread_fence(__ATOMIC_SEQ_CST); /* the mark visible before the clock is read again */
        int64_t t2 = now_ns(self);
        if (t2 == -1 && self->clock != NULL && PyErr_Occurred()) {
            PyErr_Clear(); /* an injected clock failed: keep the first reading */
            break;
        }
        if (t2 < wend) {
            break;
        }
        if (kept != 0.0) { /* the window ended meanwhile: leave the earlier writer's samples as they were */
            st_f64_release(b + B_SEQ, kept);
            kept = 0.0;
            t = t2;
            continue;
        }
        /* The window ended meanwhile: leave its bank empty (consistent) and start over from the later time. */
        st_f64(b + B_SUM, 0.0);
        st_f64(b + B_MIN, 0.0);
        st_f64(b + B_MAX, 0.0);
        st_f64(b + B_LAST, 0.0);
        st_i64(b + B_TS, 0);
        st_f64_release(b + B_SEQ, 0.0);
        t = t2;
    }
    self->wend = wend;
    self->bank = b;
    if (kept != 0.0) {
        return resume(self, b, kept, v, t, rolled);
    }
    if (self->hist0 != NULL) {
        hist_reset(self->hist);
        hist_add(self->hist, v);
    }
    st_f64(b + B_SUM, v);
    st_f64(b + B_MIN, v);
    st_f64(b + B_MAX, v);
    st_f64(b + B_LAST, v);
    st_i64(b + B_TS, t);
    self->sum = self->min = self->max = self->last = v;
    self->seq = 2.0;
    st_f64_release(b + B_SEQ, 2.0); /* the data before the even seq */
    st_i64(self->beat_p, t);
    if (2.0 >= self->max2 && self->on_roll != NULL) {
        /* max_samples 1: the new window is full at once. The previous one, full too, was reported when it
         * filled, so what ``rolled`` holds is only its empty report, which this one supersedes. */
        self->full_reported = 1;
        keep_hist(self);
        rolled->pending = 1;
        rolled->count = 1;
        rolled->sum = rolled->min = rolled->max = rolled->last = v;
        rolled->t = (long long)t;
    }
    return 0;
}

/* The add itself: 0, or -1 with an error set (only an injected clock can fail). Runs no Python code unless
 * the clock is injected, so with the real clock it is atomic with respect to the other threads (GIL). */
/* An add while the open window's bank is held (see roll()): dropped and counted while it still is; once the
 * collector has emitted what it holds, the window starts there (as a first window: nothing to report); once the
 * window has ended, it is reported empty and the window of ``t`` is started as usual. */
static int
add_blocked(SlotWriter *self, double v, Rolled *rolled)
{
    int64_t t = now_ns(self);
    if (t == -1 && self->clock != NULL && PyErr_Occurred()) {
        return -1;
    }
    if (t < self->wend) {
        if (isnan(v)) {
            bump_u64(self->nan_p);
            return 0;
        }
        if (held_unread(self, self->bank, floor_div(t, self->window_ns))) {
            add_shared_u64(self->gdrop_p, 1);
            return 0;
        }
        self->wend = 0;
    }
    self->blocked = 0;
    return roll(self, v, t, rolled);
}

static int
add_locked(SlotWriter *self, double v, Rolled *rolled)
{
    if (self->blocked) {
        return add_blocked(self, v, rolled);
    }
    /* The open window's bank is marked (odd seq) before the clock is read: a collector that closes this
     * window after the reading below reads the bank after that too, sees the mark and waits for the write,
     * so a rank descheduled between the reading and the write (longer than the collector's grace) still
     * lands its sample in a window that is emitted. No fence between the mark and the reading: the store
     * buffer drains within nanoseconds (and on any preemption) against a grace of milliseconds. Before the
     * first window (wend == 0) the bank is not ours yet and roll() does the marking. */
    double seq = self->seq;
    char *b = self->bank;
    int marked = self->wend != 0;
    if (marked) {
        st_f64(b + B_SEQ, seq + 1.0);
        __atomic_thread_fence(__ATOMIC_RELEASE); /* odd seq before the data */
    }
    int64_t t = now_ns(self);
    if (t == -1 && self->clock != NULL && PyErr_Occurred()) {
        if (marked) {
            st_f64_release(b + B_SEQ, seq);
        }
        return -1;
    }
    if (t >= self->wend) {
        if (marked) {
            st_f64_release(b + B_SEQ, seq); /* the previous window is complete as it was */
        }
        return roll(self, v, t, rolled);
    }
    if (isnan(v)) {
        st_f64_release(b + B_SEQ, seq);
        bump_u64(self->nan_p);
        return 0;
    }
    if (seq >= self->max2) {
        st_f64_release(b + B_SEQ, seq);
        bump_u64(self->disc_p);
        return 0;
    }
    self->sum += v;
    st_f64(b + B_SUM, self->sum);
    if (v < self->min) {
        self->min = v;
        st_f64(b + B_MIN, v);
    }
    else if (v > self->max) {
        self->max = v;
        st_f64(b + B_MAX, v);
    }
    if (self->want_last) {
        self->last = v;
        st_f64(b + B_LAST, v);
        st_i64(b + B_TS, t);
    }
    if (self->hist0 != NULL) {
        hist_add(self->hist, v);
    }
    seq += 2.0;
    self->seq = seq;
    st_f64_release(b + B_SEQ, seq); /* the data before the even seq */
    report_if_full(self, rolled, t);
    return 0;
}

/* add(v) with ``v`` converted: 0, or -1 with an error set (from Python code it calls: on_fork, on_roll, a clock). */
static int
slot_add(SlotWriter *self, double v)
{
    if (self->generation != fork_generation) {
        /* a forked child: bind to a slot of its own before writing anything */
        if (self->on_fork == NULL) {
            self->generation = fork_generation;
        }
        else {
            PyObject *r = PyObject_CallNoArgs(self->on_fork);
            if (r == NULL) {
                return -1;
            }
            Py_DECREF(r);
            if (self->generation != fork_generation) {
                PyErr_SetString(PyExc_RuntimeError, "on_fork did not rebind the writer");
                return -1;
            }
        }
    }
    if (self->drop_p != NULL) {
        add_shared_u64(self->drop_p, 1); /* no slot: the sample is dropped and counted */
        return 0;
    }
    Rolled rolled = {0};
    int rc;
    if (self->clock == NULL) {
        rc = add_locked(self, v, &rolled);
    }
    else {
        /* The injected clock is Python code: another thread may run inside it and add to this writer. */
        while (self->busy) {
            Py_BEGIN_ALLOW_THREADS
            sched_yield();
            Py_END_ALLOW_THREADS
        }
        self->busy = 1;
        rc = add_locked(self, v, &rolled);
        self->busy = 0;
    }
    if (rc < 0) {
        return -1;
    }
    if (rolled.pending && self->on_roll != NULL) {
        PyObject *r = PyObject_CallFunction(self->on_roll, "LddddL", rolled.count, rolled.sum, rolled.min,
                                            rolled.max, rolled.last, rolled.t);
        if (r == NULL) {
            return -1;
        }
        Py_DECREF(r);
    }
    return 0;
}

static PyObject *
SlotWriter_add(SlotWriter *self, PyObject *arg)
{
    double v;
    if (PyFloat_CheckExact(arg)) {
        v = PyFloat_AS_DOUBLE(arg);
    }
    else {
        v = as_double_slow(arg); /* raises TypeError on a non-number before anything is touched */
        if (v == -1.0 && PyErr_Occurred()) {
            return NULL;
        }
    }
    if (slot_add(self, v) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* Point the writer at a slot of its buffer (offsets checked by the caller), starting from an empty window. */
static void
bind_slot(SlotWriter *self, Py_ssize_t slot0, long long incarnation, Py_ssize_t nan_off, Py_ssize_t disc_off,
          Py_ssize_t beat_off, Py_ssize_t hist0)
{
    char *base = (char *)self->view.buf;
    self->slot0 = self->bank = base + slot0;
    self->hist0 = self->hist = hist0 >= 0 ? base + hist0 : NULL;
    self->nan_p = base + nan_off;
    self->disc_p = base + disc_off;
    self->beat_p = base + beat_off;
    self->incarnation = incarnation;
    self->wend = 0;
    self->seq = self->sum = self->min = self->max = self->last = 0.0;
    self->full_reported = 0;
    self->busy = 0;
    self->generation = fork_generation;
    self->drop_p = NULL;
    self->guard_p = self->gdrop_p = NULL;
    self->blocked = 0;
}

/* rebind(slot0, incarnation, nan_off, discarded_off, heartbeat_off, hist0=-1): write another slot of the same
 * buffer from now on (a forked child's own), starting from an empty window. */
static PyObject *
SlotWriter_rebind(SlotWriter *self, PyObject *args)
{
    Py_ssize_t slot0, nan_off, disc_off, beat_off, hist0 = -1;
    long long incarnation;
    if (!PyArg_ParseTuple(args, "nLnnn|n:rebind", &slot0, &incarnation, &nan_off, &disc_off, &beat_off, &hist0)) {
        return NULL;
    }
    Py_ssize_t len = self->view.len;
    if (check_word("slot0", slot0, len, self->nbanks * BANK_SIZE) < 0 || check_word("nan_off", nan_off, len, 8) < 0
        || check_word("discarded_off", disc_off, len, 8) < 0 || check_word("heartbeat_off", beat_off, len, 8) < 0
        || (hist0 >= 0 && check_word("hist0", hist0, len, self->nbanks * HIST_SIZE) < 0)) {
        return NULL;
    }
    bind_slot(self, slot0, incarnation, nan_off, disc_off, beat_off, hist0);
    Py_RETURN_NONE;
}

/* drop(counter_off): drop mode (the process has no slot for this stat): from now on every add (after the value
 * is checked) only adds 1 to the u64 at ``counter_off`` atomically, until a rebind(). */
static PyObject *
SlotWriter_drop(SlotWriter *self, PyObject *arg)
{
    Py_ssize_t off = PyLong_AsSsize_t(arg);
    if (off == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (check_word("counter_off", off, self->view.len, 8) < 0) {
        return NULL;
    }
    self->drop_p = (char *)self->view.buf + off;
    self->wend = 0;
    self->blocked = 0;
    self->seq = self->sum = self->min = self->max = self->last = 0.0;
    self->generation = fork_generation;
    Py_RETURN_NONE;
}

/* guard(emitted_off, dropped_off): a window under the ring's shortest: from now on a window whose bank holds a
 * later window than the i64 at ``emitted_off`` (the slot's emitted_wid) is not written there; its samples are
 * added to the u64 at ``dropped_off`` (atomically) until the collector has emitted that window. Until a rebind(). */
static PyObject *
SlotWriter_guard(SlotWriter *self, PyObject *args)
{
    Py_ssize_t emitted_off, dropped_off;
    if (!PyArg_ParseTuple(args, "nn:guard", &emitted_off, &dropped_off)) {
        return NULL;
    }
    if (check_word("emitted_off", emitted_off, self->view.len, 8) < 0
        || check_word("dropped_off", dropped_off, self->view.len, 8) < 0) {
        return NULL;
    }
    self->guard_p = (char *)self->view.buf + emitted_off;
    self->gdrop_p = (char *)self->view.buf + dropped_off;
    Py_RETURN_NONE;
}

/* add_u64(buf, offset, n): add ``n`` to the u64 at byte ``offset`` of ``buf`` with one atomic read-modify-write
 * (the drop counters, which several processes bump). */
static PyObject *
fastpath_add_u64(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *buf;
    Py_ssize_t off;
    unsigned long long n;
    if (!PyArg_ParseTuple(args, "OnK:add_u64", &buf, &off, &n)) {
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(buf, &view, PyBUF_WRITABLE) < 0) {
        return NULL;
    }
    if (((uintptr_t)view.buf) % 8 != 0 || check_word("offset", off, view.len, 8) < 0) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_ValueError, "buf is not 8-byte aligned");
        }
        PyBuffer_Release(&view);
        return NULL;
    }
    add_shared_u64((char *)view.buf + off, (uint64_t)n);
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

static PyObject *
SlotWriter_state(SlotWriter *self, PyObject *Py_UNUSED(ignored))
{
    return Py_BuildValue("(ddddd)", self->seq, self->sum, self->min, self->max, self->last);
}

static PyObject *
SlotWriter_get_count(SlotWriter *self, void *Py_UNUSED(closure))
{
    int64_t t = now_ns(self);
    if (t == -1 && self->clock != NULL && PyErr_Occurred()) {
        return NULL;
    }
    return PyLong_FromLongLong(t < self->wend && !self->full_reported ? ((long long)self->seq >> 1) : 0);
}

static PyObject *
SlotWriter_get_closed_hist(SlotWriter *self, void *Py_UNUSED(closure))
{
    if (!self->have_closed) {
        Py_RETURN_NONE;
    }
    return PyBytes_FromStringAndSize(self->closed_hist, HIST_SIZE);
}

static PyObject *
SlotWriter_get_keep_closed_hist(SlotWriter *self, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(self->closed_hist != NULL);
}

static PyObject *
SlotWriter_get_wend(SlotWriter *self, void *Py_UNUSED(closure))
{
    return PyLong_FromLongLong(self->wend);
}

static int
check_word(const char *what, Py_ssize_t off, Py_ssize_t len, Py_ssize_t size)
{
    if (off < 0 || off % 8 != 0 || size > len || off > len - size) {
        PyErr_Format(PyExc_ValueError, "%s %zd is not an 8-byte aligned offset of %zd bytes inside a buffer of %zd",
                     what, off, size, len);
        return -1;
    }
    return 0;
}

static PyObject *
SlotWriter_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"buf", "slot0", "nbanks", "window_ns", "incarnation", "max_samples", "want_last",
                             "nan_off", "discarded_off", "heartbeat_off", "on_roll", "clock", "on_fork", "hist0",
                             "keep_closed_hist", NULL};
    PyObject *buf, *on_roll = Py_None, *clock = Py_None, *on_fork = Py_None;
    Py_ssize_t slot0, nbanks, nan_off, disc_off, beat_off, hist0 = -1;
    long long window_ns, incarnation, max_samples;
    int want_last, keep_closed_hist = 0;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OnnLLLpnnn|OOOn$p:SlotWriter", kwlist, &buf, &slot0, &nbanks,
                                     &window_ns, &incarnation, &max_samples, &want_last, &nan_off, &disc_off,
                                     &beat_off, &on_roll, &clock, &on_fork, &hist0, &keep_closed_hist)) {
        return NULL;
    }
    if (on_roll != Py_None && !PyCallable_Check(on_roll)) {
        PyErr_SetString(PyExc_TypeError, "on_roll must be callable or None");
        return NULL;
    }
    if (clock != Py_None && !PyCallable_Check(clock)) {
        PyErr_SetString(PyExc_TypeError, "clock must be callable or None");
        return NULL;
    }
    if (on_fork != Py_None && !PyCallable_Check(on_fork)) {
        PyErr_SetString(PyExc_TypeError, "on_fork must be callable or None");
        return NULL;
    }
    if (nbanks < 1 || window_ns < 1 || max_samples < 1) {
        PyErr_Format(PyExc_ValueError, "nbanks (%zd), window_ns (%lld) and max_samples (%lld) must be at least 1",
                     nbanks, window_ns, max_samples);
        return NULL;
    }
    SlotWriter *self = (SlotWriter *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    if (PyObject_GetBuffer(buf, &self->view, PyBUF_WRITABLE) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    self->have_view = 1;
    Py_ssize_t len = self->view.len;
    if (((uintptr_t)self->view.buf) % 8 != 0) {
        PyErr_SetString(PyExc_ValueError, "buf is not 8-byte aligned");
        Py_DECREF(self);
        return NULL;
    }
    if (nbanks > PY_SSIZE_T_MAX / BANK_SIZE || check_word("slot0", slot0, len, nbanks * BANK_SIZE) < 0
        || check_word("nan_off", nan_off, len, 8) < 0 || check_word("discarded_off", disc_off, len, 8) < 0
        || check_word("heartbeat_off", beat_off, len, 8) < 0
        || (hist0 >= 0 && (nbanks > PY_SSIZE_T_MAX / HIST_SIZE || check_word("hist0", hist0, len, nbanks * HIST_SIZE) < 0))) {
        if (!PyErr_Occurred()) {
            PyErr_Format(PyExc_ValueError, "nbanks %zd is too large", nbanks);
        }
        Py_DECREF(self);
        return NULL;
    }
    self->nbanks = nbanks;
    self->window_ns = window_ns;
    self->max2 = 2.0 * (double)max_samples;
    bind_slot(self, slot0, incarnation, nan_off, disc_off, beat_off, hist0);
    self->want_last = want_last;
    if (keep_closed_hist) {
        self->closed_hist = PyMem_Malloc(HIST_SIZE);
        if (self->closed_hist == NULL) {
            Py_DECREF(self);
            return PyErr_NoMemory();
        }
    }
    if (on_roll != Py_None) {
        self->on_roll = Py_NewRef(on_roll);
    }
    if (clock != Py_None) {
        self->clock = Py_NewRef(clock);
    }
    if (on_fork != Py_None) {
        self->on_fork = Py_NewRef(on_fork);
    }
    return (PyObject *)self;
}

static int
SlotWriter_traverse(SlotWriter *self, visitproc visit, void *arg)
{
    /* view.obj is deliberately not visited: to the collector, the exported memoryview then looks
     * referenced from outside, so it is never cleared (memoryview's tp_clear drops its buffer, and with it the
     * mapping, even while exports exist) before this object is gone and has released its export. */
    Py_VISIT(self->on_roll);
    Py_VISIT(self->clock);
    Py_VISIT(self->on_fork);
    return 0;
}

static int
SlotWriter_clear(SlotWriter *self)
{
    /* The buffer is kept until dealloc: add stays memory-safe even on a cleared object. */
    Py_CLEAR(self->on_roll);
    Py_CLEAR(self->clock);
    Py_CLEAR(self->on_fork);
    return 0;
}

static void
SlotWriter_dealloc(SlotWriter *self)
{
    PyObject_GC_UnTrack(self);
    SlotWriter_clear(self);
    if (self->have_view) {
        self->have_view = 0;
        PyBuffer_Release(&self->view);
    }
    PyMem_Free(self->closed_hist);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef SlotWriter_methods[] = {
    {"add", (PyCFunction)SlotWriter_add, METH_O, "add(v): add a sample to the open window (see Stat.add)."},
    {"rebind", (PyCFunction)SlotWriter_rebind, METH_VARARGS,
     "rebind(slot0, incarnation, nan_off, discarded_off, heartbeat_off): write another slot from now on."},
    {"drop", (PyCFunction)SlotWriter_drop, METH_O,
     "drop(counter_off): no slot; every add from now on only adds 1 to the counter at counter_off (atomic)."},
    {"guard", (PyCFunction)SlotWriter_guard, METH_VARARGS,
     "guard(emitted_off, dropped_off): never overwrite a window past the emitted_wid at emitted_off; drop and count."},
    {"state", (PyCFunction)SlotWriter_state, METH_NOARGS,
     "state() -> (seq, sum, min, max, last): this writer's copy of the open window (for tests)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef SlotWriter_getset[] = {
    {"count", (getter)SlotWriter_get_count, NULL, "Samples in the open window (0 once the window has ended).",
     NULL},
    {"wend", (getter)SlotWriter_get_wend, NULL, "End (ns, exclusive) of the open window; 0 before any sample.",
     NULL},
    {"keep_closed_hist", (getter)SlotWriter_get_keep_closed_hist, NULL,
     "Whether each report with samples keeps the reported window's histogram bytes in closed_hist.", NULL},
    {"closed_hist", (getter)SlotWriter_get_closed_hist, NULL,
     "With keep_closed_hist: the histogram bytes of the window last reported with samples (None before any).",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject SlotWriterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmstat._fastpath.SlotWriter",
    .tp_doc = PyDoc_STR("SlotWriter(buf, slot0, nbanks, window_ns, incarnation, max_samples, want_last, nan_off, "
                        "discarded_off, heartbeat_off, on_roll=None, clock=None, on_fork=None, hist0=-1, *, "
                        "keep_closed_hist=False)\n\n"
                        "Writes one stat's samples into its slot of a shmstat segment (offsets in bytes)."),
    .tp_basicsize = sizeof(SlotWriter),
    .tp_itemsize = 0,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = SlotWriter_new,
    .tp_dealloc = (destructor)SlotWriter_dealloc,
    .tp_traverse = (traverseproc)SlotWriter_traverse,
    .tp_clear = (inquiry)SlotWriter_clear,
    .tp_methods = SlotWriter_methods,
    .tp_getset = SlotWriter_getset,
};

/* ---------------------------------------------------------------------------------------------------------------
 * Sections (shmstat.writer.sections): the C twin of a section's enter and exit, and of the phase word's writer
 * (shmstat.shm.phase.PhaseWriter, the pure-Python twin: the same bytes). The GIL serialises the threads of this
 * process while this code runs (it never releases it), so the phase word needs no lock here; Python code may run
 * only inside the Stat's add (on_fork, on_roll), after the section's stack entry is popped and before the phase
 * word is written. Anything unusual (a record of an earlier epoch, a CUDA section, a Stat on the Python writer)
 * is handed to the Python methods ``_enter_py``/``_exit_py`` before anything is changed.
 * ------------------------------------------------------------------------------------------------------------ */

static inline int64_t
mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* time.monotonic_ns() */
    return (int64_t)ts.tv_sec * 1000000000LL + (int64_t)ts.tv_nsec;
}

static inline int64_t
wall_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts); /* time.time_ns() */
    return (int64_t)ts.tv_sec * 1000000000LL + (int64_t)ts.tv_nsec;
}

typedef struct {
    PyObject_HEAD
    Py_buffer view;   /* the segment, held for this object's life */
    int have_view;
    char *seq_p;      /* the entry's phase_seq */
    char *copy0;      /* its first phase copy (the second follows at PHASE_COPY_SIZE) */
    uint64_t seq, step, word;
    int64_t since;    /* wall-clock ns */
    int64_t offset;   /* monotonic ns + offset = wall-clock ns (read once, as the Python writer does) */
    long pid;
} PhaseWriter;

/* Fill the copy phase_seq does not name, then publish it with one release store of the next even sequence. */
static inline void
phase_publish(PhaseWriter *self)
{
    uint64_t seq = self->seq + 2;
    char *c = self->copy0 + ((seq >> 1) & 1) * PHASE_COPY_SIZE;
    __atomic_store_n((uint64_t *)c, self->word, __ATOMIC_RELAXED);
    __atomic_store_n((int64_t *)(c + 8), self->since, __ATOMIC_RELAXED);
    __atomic_store_n((uint64_t *)(c + 16), self->step, __ATOMIC_RELAXED);
    __atomic_store_n((uint64_t *)self->seq_p, seq, __ATOMIC_RELEASE); /* the copy before the sequence */
    self->seq = seq;
}

static inline void
phase_enter(PhaseWriter *self, uint64_t ident, uint64_t depth, int64_t mono)
{
    self->word = ident | depth << 32;
    self->since = mono + self->offset;
    phase_publish(self);
}

/* PhaseWriter(buf, base): the writer of the phase word of the rank entry at byte ``base`` of ``buf``; goes on from
 * the sequence an earlier process of the entry left, and publishes "outside every section" at once. */
static PyObject *
PhaseWriter_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"buf", "base", NULL};
    PyObject *buf;
    Py_ssize_t base;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "On:PhaseWriter", kwlist, &buf, &base)) {
        return NULL;
    }
    PhaseWriter *self = (PhaseWriter *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    if (PyObject_GetBuffer(buf, &self->view, PyBUF_WRITABLE) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    self->have_view = 1;
    if (((uintptr_t)self->view.buf) % 8 != 0) {
        PyErr_SetString(PyExc_ValueError, "buf is not 8-byte aligned");
        Py_DECREF(self);
        return NULL;
    }
    if (base > PY_SSIZE_T_MAX - R_PHASE || check_word("phase_seq", base + R_PHASE_SEQ, self->view.len, 8) < 0
        || check_word("phase", base + R_PHASE, self->view.len, 2 * PHASE_COPY_SIZE) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    char *b = (char *)self->view.buf + base;
    self->seq_p = b + R_PHASE_SEQ;
    self->copy0 = b + R_PHASE;
    uint64_t seq = __atomic_load_n((uint64_t *)self->seq_p, __ATOMIC_RELAXED);
    self->seq = seq + (seq & 1);
    self->offset = wall_ns() - mono_ns();
    self->pid = (long)getpid();
    phase_enter(self, 0, 0, mono_ns());
    return (PyObject *)self;
}

static void
PhaseWriter_dealloc(PhaseWriter *self)
{
    if (self->have_view) {
        PyBuffer_Release(&self->view);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* enter(ident, depth, mono_ns): publish section ``ident`` (0: none) at ``depth``, there since ``mono_ns``. */
static PyObject *
PhaseWriter_enter(PhaseWriter *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "enter(ident, depth, mono_ns) takes 3 arguments");
        return NULL;
    }
    unsigned long long ident = PyLong_AsUnsignedLongLong(args[0]);
    unsigned long long depth = PyLong_AsUnsignedLongLong(args[1]);
    long long mono = PyLong_AsLongLong(args[2]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (ident > 0xffffffffULL || depth > 0xffffffffULL) {
        PyErr_SetString(PyExc_ValueError, "ident and depth are u32");
        return NULL;
    }
    phase_enter(self, ident, depth, mono);
    Py_RETURN_NONE;
}

/* step(): count one step (the section and its since stay). */
static PyObject *
PhaseWriter_step(PhaseWriter *self, PyObject *Py_UNUSED(ignored))
{
    self->step++;
    phase_publish(self);
    Py_RETURN_NONE;
}

static PyObject *
PhaseWriter_get_pid(PhaseWriter *self, void *Py_UNUSED(closure))
{
    return PyLong_FromLong(self->pid);
}

static PyMethodDef PhaseWriter_methods[] = {
    {"enter", (PyCFunction)(void (*)(void))PhaseWriter_enter, METH_FASTCALL,
     "enter(ident, depth, mono_ns): publish section ident (0: none) at depth, there since mono_ns."},
    {"step", (PyCFunction)PhaseWriter_step, METH_NOARGS, "step(): count one step."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef PhaseWriter_getset[] = {
    {"pid", (getter)PhaseWriter_get_pid, NULL, "The process that created this writer.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject PhaseWriterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmstat._fastpath.PhaseWriter",
    .tp_doc = PyDoc_STR("PhaseWriter(buf, base)\n\nWrites the phase word of the rank entry at byte base of buf "
                        "(the C twin of shmstat.shm.phase.PhaseWriter)."),
    .tp_basicsize = sizeof(PhaseWriter),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PhaseWriter_new,
    .tp_dealloc = (destructor)PhaseWriter_dealloc,
    .tp_methods = PhaseWriter_methods,
    .tp_getset = PhaseWriter_getset,
};

/* What one section name writes through in this process and epoch (the base of sections._Record). */
typedef struct {
    PyObject_HEAD
    PyObject *writer;  /* the Stat's C SlotWriter, or NULL: the Python methods run */
    PyObject *phase;   /* a PhaseWriter, or NULL (no entry: nothing to publish) */
    uint64_t ident;
    long long epoch;
} RecordCore;

static int
RecordCore_traverse(RecordCore *self, visitproc visit, void *arg)
{
    Py_VISIT(self->writer);
    Py_VISIT(self->phase);
    return 0;
}

static int
RecordCore_clear(RecordCore *self)
{
    Py_CLEAR(self->writer);
    Py_CLEAR(self->phase);
    return 0;
}

static void
RecordCore_dealloc(RecordCore *self)
{
    PyObject_GC_UnTrack(self);
    RecordCore_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* _bind_c(writer, phase, ident, epoch): what the C enter and exit use (writer and phase may be None). */
static PyObject *
RecordCore_bind(RecordCore *self, PyObject *args)
{
    PyObject *writer, *phase;
    unsigned long long ident;
    long long epoch;
    if (!PyArg_ParseTuple(args, "OOKL:_bind_c", &writer, &phase, &ident, &epoch)) {
        return NULL;
    }
    if ((writer != Py_None && !PyObject_TypeCheck(writer, &SlotWriterType))
        || (phase != Py_None && !PyObject_TypeCheck(phase, &PhaseWriterType))) {
        PyErr_SetString(PyExc_TypeError, "writer must be a SlotWriter or None, phase a PhaseWriter or None");
        return NULL;
    }
    Py_XSETREF(self->writer, writer == Py_None ? NULL : Py_NewRef(writer));
    Py_XSETREF(self->phase, phase == Py_None ? NULL : Py_NewRef(phase));
    self->ident = ident & 0xffffffffULL;
    self->epoch = epoch;
    Py_RETURN_NONE;
}

static PyMethodDef RecordCore_methods[] = {
    {"_bind_c", (PyCFunction)RecordCore_bind, METH_VARARGS,
     "_bind_c(writer, phase, ident, epoch): what the C enter and exit write through."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject RecordCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmstat._fastpath.RecordCore",
    .tp_doc = PyDoc_STR("The C part of a section's record: its Stat's writer, the phase writer, its ident."),
    .tp_basicsize = sizeof(RecordCore),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)RecordCore_dealloc,
    .tp_traverse = (traverseproc)RecordCore_traverse,
    .tp_clear = (inquiry)RecordCore_clear,
    .tp_methods = RecordCore_methods,
};

/* A thread's open sections, innermost last: (record, monotonic ns at enter, id). The ids tell an entry a hook
 * opened (sections.section._open) from a later one after it was closed. */
typedef struct {
    PyObject_HEAD
    Py_ssize_t n, cap;
    PyObject **recs;
    int64_t *t0;
    uint64_t *ids;
    uint64_t next_id;
} Stack;

static int
stack_push(Stack *self, PyObject *rec, int64_t t)
{
    if (self->n == self->cap) {
        Py_ssize_t cap = self->cap ? 2 * self->cap : 16;
        PyObject **recs = PyMem_Realloc(self->recs, cap * sizeof(PyObject *));
        if (recs == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        self->recs = recs;
        int64_t *t0 = PyMem_Realloc(self->t0, cap * sizeof(int64_t));
        if (t0 == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        self->t0 = t0;
        uint64_t *ids = PyMem_Realloc(self->ids, cap * sizeof(uint64_t));
        if (ids == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        self->ids = ids;
        self->cap = cap;
    }
    self->recs[self->n] = Py_NewRef(rec);
    self->t0[self->n] = t;
    self->ids[self->n] = ++self->next_id;
    self->n++;
    return 0;
}

static int
Stack_traverse(Stack *self, visitproc visit, void *arg)
{
    for (Py_ssize_t i = 0; i < self->n; i++) {
        Py_VISIT(self->recs[i]);
    }
    return 0;
}

static int
Stack_clear(Stack *self)
{
    Py_ssize_t n = self->n;
    self->n = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_CLEAR(self->recs[i]);
    }
    return 0;
}

static void
Stack_dealloc(Stack *self)
{
    PyObject_GC_UnTrack(self);
    Stack_clear(self);
    PyMem_Free(self->recs);
    PyMem_Free(self->t0);
    PyMem_Free(self->ids);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* push(rec, mono_ns) -> id */
static PyObject *
Stack_push(Stack *self, PyObject *args)
{
    PyObject *rec;
    long long t;
    if (!PyArg_ParseTuple(args, "OL:push", &rec, &t)) {
        return NULL;
    }
    if (stack_push(self, rec, t) < 0) {
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(self->ids[self->n - 1]);
}

/* Remove entry ``i``: (rec, mono_ns) of it. */
static PyObject *
stack_remove_at(Stack *self, Py_ssize_t i)
{
    PyObject *rec = self->recs[i];
    int64_t t0 = self->t0[i];
    for (Py_ssize_t j = i + 1; j < self->n; j++) {
        self->recs[j - 1] = self->recs[j];
        self->t0[j - 1] = self->t0[j];
        self->ids[j - 1] = self->ids[j];
    }
    self->n--;
    PyObject *out = Py_BuildValue("(OL)", rec, (long long)t0);
    Py_DECREF(rec);
    return out;
}

/* remove(id) -> (rec, mono_ns) of the entry removed, or None when it is not open (closed already) */
static PyObject *
Stack_remove(Stack *self, PyObject *arg)
{
    unsigned long long id = PyLong_AsUnsignedLongLong(arg);
    if (id == (unsigned long long)-1 && PyErr_Occurred()) {
        return NULL;
    }
    for (Py_ssize_t i = self->n - 1; i >= 0; i--) {
        if (self->ids[i] == id) {
            return stack_remove_at(self, i);
        }
    }
    Py_RETURN_NONE;
}

/* pop() -> (rec, mono_ns) of the innermost entry, or None when none is open */
static PyObject *
Stack_pop(Stack *self, PyObject *Py_UNUSED(ignored))
{
    if (self->n == 0) {
        Py_RETURN_NONE;
    }
    return stack_remove_at(self, self->n - 1);
}

/* top() -> (rec, mono_ns) of the innermost entry, or None */
static PyObject *
Stack_top(Stack *self, PyObject *Py_UNUSED(ignored))
{
    if (self->n == 0) {
        Py_RETURN_NONE;
    }
    return Py_BuildValue("(OL)", self->recs[self->n - 1], (long long)self->t0[self->n - 1]);
}

static Py_ssize_t
Stack_len(Stack *self)
{
    return self->n;
}

static PyMethodDef Stack_methods[] = {
    {"push", (PyCFunction)Stack_push, METH_VARARGS, "push(rec, mono_ns) -> id: open an entry."},
    {"remove", (PyCFunction)Stack_remove, METH_O,
     "remove(id) -> (rec, mono_ns), or None when that entry is not open."},
    {"pop", (PyCFunction)Stack_pop, METH_NOARGS, "pop() -> (rec, mono_ns) of the innermost entry, or None."},
    {"top", (PyCFunction)Stack_top, METH_NOARGS, "top() -> (rec, mono_ns) of the innermost entry, or None."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods Stack_as_sequence = {
    .sq_length = (lenfunc)Stack_len,
};

static PyTypeObject StackType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmstat._fastpath.Stack",
    .tp_doc = PyDoc_STR("A thread's open sections, innermost last (thread_stack() gives this thread's)."),
    .tp_basicsize = sizeof(Stack),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)Stack_dealloc,
    .tp_traverse = (traverseproc)Stack_traverse,
    .tp_clear = (inquiry)Stack_clear,
    .tp_methods = Stack_methods,
    .tp_as_sequence = &Stack_as_sequence,
};

/* Each thread's Stack lives in its thread-state dict (freed with the thread state); this OS thread's is remembered
 * here (borrowed: the dict holds it) with the unique id of the thread state it was found in. Not the dict's
 * address: an OS thread that gets a new thread state per callback (PyGILState_Ensure from a C thread: gloo's and
 * NCCL's callback threads leave DDP's all-reduce section there) may get the new dict at the freed one's address,
 * and the freed Stack with it. A forked child's thread keeps its thread state, id and all. */
static PyObject *stack_key;  /* the key of the thread-state dict */
static __thread uint64_t t_state_id;  /* 0: none remembered (thread state ids start at 1) */
static __thread Stack *t_stack;

static Stack *
thread_stack(void)
{
    uint64_t state_id = PyThreadState_GetID(PyThreadState_Get());
    if (state_id == t_state_id && t_stack != NULL) {
        return t_stack;
    }
    PyObject *d = PyThreadState_GetDict();
    if (d == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "no thread state dict");
        return NULL;
    }
    PyObject *st = PyDict_GetItemWithError(d, stack_key);
    if (st == NULL) {
        if (PyErr_Occurred()) {
            return NULL;
        }
        st = PyType_GenericNew(&StackType, NULL, NULL);
        if (st == NULL) {
            return NULL;
        }
        int rc = PyDict_SetItem(d, stack_key, st);
        Py_DECREF(st);
        if (rc < 0) {
            return NULL;
        }
    }
    if (!PyObject_TypeCheck(st, &StackType)) {
        PyErr_SetString(PyExc_TypeError, "the thread's section stack is not a Stack");
        return NULL;
    }
    t_state_id = state_id;
    t_stack = (Stack *)st;
    return t_stack;
}

static PyObject *
fastpath_thread_stack(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored))
{
    Stack *st = thread_stack();
    return st == NULL ? NULL : Py_NewRef((PyObject *)st);
}

/* The section epoch (shmstat.job._state.SECTION_EPOCH, a one-item list bumped by init/shutdown/fork). */
static PyObject *epoch_list;

static inline int
epoch_is(long long epoch)
{
    if (epoch_list == NULL || !PyList_CheckExact(epoch_list) || PyList_GET_SIZE(epoch_list) < 1) {
        return 0;
    }
    PyObject *e = PyList_GET_ITEM(epoch_list, 0);
    int overflow;
    long long now = PyLong_AsLongLongAndOverflow(e, &overflow);
    if (now == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return !overflow && now == epoch;
}

static PyObject *
fastpath_section_epoch(PyObject *Py_UNUSED(module), PyObject *arg)
{
    if (!PyList_CheckExact(arg)) {
        PyErr_SetString(PyExc_TypeError, "section_epoch takes the epoch's one-item list");
        return NULL;
    }
    Py_XSETREF(epoch_list, Py_NewRef(arg));
    Py_RETURN_NONE;
}

/* A record the C path can write through: of the current epoch, with a C writer. */
static inline int
fast_record(PyObject *r)
{
    RecordCore *rec = (RecordCore *)r;
    return r != NULL && rec->writer != NULL && epoch_is(rec->epoch);
}

/* The base of sections.section: its record, and the C __enter__ / __exit__. */
typedef struct {
    PyObject_HEAD
    PyObject *rec;  /* NULL/None, or a RecordCore (sections._Record) */
} SectionCore;

static PyObject *enter_py_name, *exit_py_name;

/* Enter ``self``: 0, or -1 with an error set. What the C path does not take goes to the Python ``_enter_py``. */
static inline int
section_enter(SectionCore *self)
{
    PyObject *rec = self->rec;
    if (rec == NULL || !PyObject_TypeCheck(rec, &RecordCoreType) || !fast_record(rec)) {
        PyObject *r = PyObject_CallMethodNoArgs((PyObject *)self, enter_py_name);
        if (r == NULL) {
            return -1;
        }
        Py_DECREF(r);
        return 0;
    }
    Stack *st = thread_stack();
    if (st == NULL) {
        return -1;
    }
    int64_t t = mono_ns();
    if (stack_push(st, rec, t) < 0) {
        return -1;
    }
    PyObject *phase = ((RecordCore *)rec)->phase;
    if (phase != NULL) {
        phase_enter((PhaseWriter *)phase, ((RecordCore *)rec)->ident, (uint64_t)st->n, t);
    }
    return 0;
}

/* Leave the innermost section of this thread (entered through ``self``): 0, or -1 with an error set. Called with
 * no error pending. */
static inline int
section_exit(SectionCore *self)
{
    int64_t t = mono_ns();
    Stack *st = thread_stack();
    if (st == NULL) {
        return -1;
    }
    Py_ssize_t n = st->n;
    if (n == 0) {
        return 0; /* entered in another process (a fork inside the section): nothing of it is ours */
    }
    PyObject *rec = st->recs[n - 1];
    if (!PyObject_TypeCheck(rec, &RecordCoreType) || !fast_record(rec)
        || (n > 1 && (!PyObject_TypeCheck(st->recs[n - 2], &RecordCoreType)
                      || !epoch_is(((RecordCore *)st->recs[n - 2])->epoch)))) {
        PyObject *r = PyObject_CallMethodNoArgs((PyObject *)self, exit_py_name);
        if (r == NULL) {
            return -1;
        }
        Py_DECREF(r);
        return 0;
    }
    int64_t t0 = st->t0[n - 1];
    st->n = --n; /* popped: the reference to rec is now ours */
    RecordCore *r = (RecordCore *)rec;
    PyObject *phase = Py_XNewRef(r->phase);
    uint64_t ident = 0;
    int64_t since = t;
    if (n > 0) { /* read before the add: its Python code (on_roll) may run another thread's sections, not ours */
        ident = ((RecordCore *)st->recs[n - 1])->ident;
        since = st->t0[n - 1];
    }
    int rc = slot_add((SlotWriter *)r->writer, (double)(t - t0) / 1e6);
    if (phase != NULL) {
        phase_enter((PhaseWriter *)phase, ident, (uint64_t)n, since);
        Py_DECREF(phase);
    }
    Py_DECREF(rec);
    return rc;
}

static PyObject *
SectionCore_enter(SectionCore *self, PyObject *Py_UNUSED(ignored))
{
    if (section_enter(self) < 0) {
        return NULL;
    }
    return Py_NewRef((PyObject *)self);
}

static PyObject *
SectionCore_exit(SectionCore *self, PyObject *const *Py_UNUSED(args), Py_ssize_t Py_UNUSED(nargs))
{
    if (section_exit(self) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static int
SectionCore_traverse(SectionCore *self, visitproc visit, void *arg)
{
    Py_VISIT(self->rec);
    return 0;
}

static int
SectionCore_clear(SectionCore *self)
{
    Py_CLEAR(self->rec);
    return 0;
}

static void
SectionCore_dealloc(SectionCore *self)
{
    PyObject_GC_UnTrack(self);
    SectionCore_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
SectionCore_get_rec(SectionCore *self, void *Py_UNUSED(closure))
{
    return Py_NewRef(self->rec != NULL ? self->rec : Py_None);
}

static int
SectionCore_set_rec(SectionCore *self, PyObject *value, void *Py_UNUSED(closure))
{
    if (value != NULL && value != Py_None && !PyObject_TypeCheck(value, &RecordCoreType)) {
        PyErr_SetString(PyExc_TypeError, "_rec must be a RecordCore or None");
        return -1;
    }
    Py_XSETREF(self->rec, value == NULL || value == Py_None ? NULL : Py_NewRef(value));
    return 0;
}

static PyMethodDef SectionCore_methods[] = {
    {"__enter__", (PyCFunction)SectionCore_enter, METH_NOARGS, "Enter the section (C path)."},
    {"__exit__", (PyCFunction)(void (*)(void))SectionCore_exit, METH_FASTCALL, "Leave the section (C path)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef SectionCore_getset[] = {
    {"_rec", (getter)SectionCore_get_rec, (setter)SectionCore_set_rec, "The record (None before the first enter).",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject SectionCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmstat._fastpath.SectionCore",
    .tp_doc = PyDoc_STR("The C base of shmstat.section: __enter__ and __exit__ (the Python _enter_py/_exit_py run "
                        "what they do not)."),
    .tp_basicsize = sizeof(SectionCore),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)SectionCore_dealloc,
    .tp_traverse = (traverseproc)SectionCore_traverse,
    .tp_clear = (inquiry)SectionCore_clear,
    .tp_methods = SectionCore_methods,
    .tp_getset = SectionCore_getset,
};

/* SectionFunction(section, fn): what ``@section(...)`` makes of a function on the C path: calling it enters the
 * section, calls ``fn`` with the arguments as they came (vectorcall: no tuple, no dict) and leaves the section, also
 * when ``fn`` raises (the exception goes on unchanged; one the exit raises takes it as its context, as after a
 * ``with``). So a decorated call costs the section's enter and exit and one C call, no ``with`` statement. Like a
 * function it binds as a method (a method descriptor: ``obj.f(x)`` calls it with ``obj`` first, no bound method
 * made), keeps what ``functools.update_wrapper`` sets in its ``__dict__``, and pickles by reference. A generator or
 * coroutine function is called like any other: the section times the call that makes the generator, as the Python
 * path does. */
typedef struct {
    PyObject_HEAD
    PyObject *section;  /* a SectionCore (a shmstat.section) */
    PyObject *fn;
    PyObject *dict;
    vectorcallfunc vectorcall;
} SectionFunction;

static PyObject *
SectionFunction_vectorcall(SectionFunction *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    SectionCore *sec = (SectionCore *)self->section;
    if (section_enter(sec) < 0) {
        return NULL;
    }
    PyObject *res = PyObject_Vectorcall(self->fn, args, nargsf, kwnames);
    if (res != NULL) {
        if (section_exit(sec) < 0) {
            Py_DECREF(res);
            return NULL;
        }
        return res;
    }
    /* As a with statement does: the exit runs with fn's exception as the one being handled, so an error raised in
     * it takes that one as its context (and code in it sees it as sys.exception()). */
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL) {
        PyException_SetTraceback(value, tb);
    }
    PyObject *handled = PyErr_GetHandledException();
    PyErr_SetHandledException(value);
    int rc = section_exit(sec);
    PyErr_SetHandledException(handled);
    Py_XDECREF(handled);
    if (rc == 0) {
        PyErr_Restore(type, value, tb);
    }
    else {
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
    }
    return NULL;
}

static PyObject *
SectionFunction_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"section", "fn", NULL};
    PyObject *section, *fn;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO:SectionFunction", kwlist, &section, &fn)) {
        return NULL;
    }
    if (!PyObject_TypeCheck(section, &SectionCoreType) || !PyCallable_Check(fn)) {
        PyErr_SetString(PyExc_TypeError, "SectionFunction(section, fn) takes a section and a callable");
        return NULL;
    }
    SectionFunction *self = (SectionFunction *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->section = Py_NewRef(section);
    self->fn = Py_NewRef(fn);
    self->vectorcall = (vectorcallfunc)SectionFunction_vectorcall;
    return (PyObject *)self;
}

static int
SectionFunction_traverse(SectionFunction *self, visitproc visit, void *arg)
{
    Py_VISIT(self->section);
    Py_VISIT(self->fn);
    Py_VISIT(self->dict);
    return 0;
}

static int
SectionFunction_clear(SectionFunction *self)
{
    Py_CLEAR(self->section);
    Py_CLEAR(self->fn);
    Py_CLEAR(self->dict);
    return 0;
}

static void
SectionFunction_dealloc(SectionFunction *self)
{
    PyObject_GC_UnTrack(self);
    SectionFunction_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* As a function: looked up on an instance, a method bound to it; on the class, itself. */
static PyObject *
SectionFunction_descr_get(PyObject *self, PyObject *obj, PyObject *Py_UNUSED(type))
{
    if (obj == NULL || obj == Py_None) {
        return Py_NewRef(self);
    }
    return PyMethod_New(self, obj);
}

static PyObject *
SectionFunction_repr(SectionFunction *self)
{
    return PyUnicode_FromFormat("<%R around %R>", self->section, self->fn);
}

/* Pickled by reference, as a function is: its module's attribute __qualname__. */
static PyObject *
SectionFunction_reduce(SectionFunction *self, PyObject *Py_UNUSED(ignored))
{
    return PyObject_GetAttrString((PyObject *)self, "__qualname__");
}

static PyMethodDef SectionFunction_methods[] = {
    {"__reduce__", (PyCFunction)SectionFunction_reduce, METH_NOARGS, "Pickled by reference (its __qualname__)."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef SectionFunction_members[] = {
    {"__section__", T_OBJECT, offsetof(SectionFunction, section), READONLY, "The section each call runs in."},
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(SectionFunction, vectorcall), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef SectionFunction_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject SectionFunctionType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmstat._fastpath.SectionFunction",
    .tp_doc = PyDoc_STR("SectionFunction(section, fn)\n\nfn, each call of it run inside section (the C path of "
                        "@shmstat.section(...) on a function)."),
    .tp_basicsize = sizeof(SectionFunction),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_new = SectionFunction_new,
    .tp_dealloc = (destructor)SectionFunction_dealloc,
    .tp_traverse = (traverseproc)SectionFunction_traverse,
    .tp_clear = (inquiry)SectionFunction_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(SectionFunction, vectorcall),
    .tp_descr_get = SectionFunction_descr_get,
    .tp_repr = (reprfunc)SectionFunction_repr,
    .tp_dictoffset = offsetof(SectionFunction, dict),
    .tp_methods = SectionFunction_methods,
    .tp_members = SectionFunction_members,
    .tp_getset = SectionFunction_getset,
};

/* NullContext(timed=False): a context manager of this module's kind (a C type, METH_NOARGS __enter__, METH_FASTCALL
 * __exit__, like SectionCore) that does nothing, or with ``timed`` only reads the monotonic clock at enter and exit:
 * what a ``with`` on a C type costs, the floor scripts/bench.py prices a section against. */
typedef struct {
    PyObject_HEAD
    int timed;
    int64_t t0, last_ns;
} NullContext;

static PyObject *
NullContext_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"timed", NULL};
    int timed = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|p:NullContext", kwlist, &timed)) {
        return NULL;
    }
    NullContext *self = (NullContext *)type->tp_alloc(type, 0);
    if (self != NULL) {
        self->timed = timed;
    }
    return (PyObject *)self;
}

static PyObject *
NullContext_enter(NullContext *self, PyObject *Py_UNUSED(ignored))
{
    if (self->timed) {
        self->t0 = mono_ns();
    }
    return Py_NewRef((PyObject *)self);
}

static PyObject *
NullContext_exit(NullContext *self, PyObject *const *Py_UNUSED(args), Py_ssize_t Py_UNUSED(nargs))
{
    if (self->timed) {
        self->last_ns = mono_ns() - self->t0;
    }
    Py_RETURN_NONE;
}

static PyObject *
NullContext_get_last(NullContext *self, void *Py_UNUSED(closure))
{
    return PyLong_FromLongLong(self->last_ns);
}

static PyMethodDef NullContext_methods[] = {
    {"__enter__", (PyCFunction)NullContext_enter, METH_NOARGS, "Enter (nothing, or a clock reading)."},
    {"__exit__", (PyCFunction)(void (*)(void))NullContext_exit, METH_FASTCALL, "Leave (nothing, or a clock reading)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef NullContext_getset[] = {
    {"last_ns", (getter)NullContext_get_last, NULL, "timed: the ns between the last enter and exit.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject NullContextType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmstat._fastpath.NullContext",
    .tp_doc = PyDoc_STR("NullContext(timed=False)\n\nA C context manager that does nothing (timed: reads the "
                        "monotonic clock at enter and exit): the floor of a section's cost in scripts/bench.py."),
    .tp_basicsize = sizeof(NullContext),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_new = NullContext_new,
    .tp_methods = NullContext_methods,
    .tp_getset = NullContext_getset,
};

static PyMethodDef fastpath_functions[] = {
    {"thread_stack", (PyCFunction)fastpath_thread_stack, METH_NOARGS,
     "thread_stack() -> Stack: this thread's open sections (shared by the C and Python enter/exit)."},
    {"section_epoch", (PyCFunction)fastpath_section_epoch, METH_O,
     "section_epoch(list): the one-item list whose item is the current section epoch."},
    {"add_u64", (PyCFunction)fastpath_add_u64, METH_VARARGS,
     "add_u64(buf, offset, n): add n to the u64 at byte offset of buf with one atomic read-modify-write."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef fastpath_module = {
    PyModuleDef_HEAD_INIT,
    .m_methods = fastpath_functions,
    .m_name = "shmstat._fastpath",
    .m_doc = "C hot path of an attached shmstat Stat (optional; the pure-Python path is the fallback).",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__fastpath(void)
{
    if (PyType_Ready(&SlotWriterType) < 0 || PyType_Ready(&PhaseWriterType) < 0 || PyType_Ready(&RecordCoreType) < 0
        || PyType_Ready(&StackType) < 0 || PyType_Ready(&SectionCoreType) < 0
        || PyType_Ready(&SectionFunctionType) < 0
        || PyType_Ready(&NullContextType) < 0) {
        return NULL;
    }
    stack_key = PyUnicode_InternFromString("shmstat_section_stack");
    enter_py_name = PyUnicode_InternFromString("_enter_py");
    exit_py_name = PyUnicode_InternFromString("_exit_py");
    if (stack_key == NULL || enter_py_name == NULL || exit_py_name == NULL) {
        return NULL;
    }
    if (pthread_atfork(NULL, NULL, bump_fork_generation) != 0) {
        PyErr_SetString(PyExc_RuntimeError, "pthread_atfork failed");
        return NULL;
    }
    PyObject *m = PyModule_Create(&fastpath_module);
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddObjectRef(m, "SlotWriter", (PyObject *)&SlotWriterType) < 0
        || PyModule_AddObjectRef(m, "PhaseWriter", (PyObject *)&PhaseWriterType) < 0
        || PyModule_AddObjectRef(m, "RecordCore", (PyObject *)&RecordCoreType) < 0
        || PyModule_AddObjectRef(m, "Stack", (PyObject *)&StackType) < 0
        || PyModule_AddObjectRef(m, "SectionCore", (PyObject *)&SectionCoreType) < 0
        || PyModule_AddObjectRef(m, "SectionFunction", (PyObject *)&SectionFunctionType) < 0
        || PyModule_AddObjectRef(m, "NullContext", (PyObject *)&NullContextType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
