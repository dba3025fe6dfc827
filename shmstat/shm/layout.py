"""The binary layout of a job's shared-memory segment: the one source of truth for ranks and collector.

All integers and floats are little-endian, every field is 8 bytes and 8-byte aligned (histogram bucket counts
are 4 bytes); banks are 64-byte aligned (one cache line each). ``R`` = max ranks, ``S`` = max stats per rank,
``K`` = banks per slot, ``H`` = stats with percentiles per rank, ``M`` = :data:`HIST_BUCKETS`. The records read out
of it are the values of :mod:`shmstat.shm.layout_records`; the code that moves the bytes is in
:mod:`shmstat.shm.layout_codec`.

::

    offset                         size       region
    0                              256        header
    256                            R*200      rank table        (entry i = local rank i)
    DESC_BASE                      R*S*208    stat descriptors  (rank-major: rank i, stat j)
    BANK_BASE (64-aligned)         R*S*K*64   slots             (rank i, stat j, bank w % K)
    HIST_BASE                      R*H*K*2240 histograms        (rank i, histogram h, bank w % K)
    MARK_BASE                      4*R*40     delivered marks   (one per event sender the collector follows)

    header (256 bytes)
      0  magic            8s   b"SHMSTAT\\0"
      8  layout_version   u64  LAYOUT_VERSION
     16  max_ranks        u64  R
     24  max_stats        u64  S
     32  banks            u64  K
     40  total_size       u64  bytes of the whole segment
     48  created_ns       i64  wall-clock ns at creation
     56  collector_pid    i64  pid of the collector serving the job, 0 if none, -1 when the last one stopped with
                               windows left to emit (ranks then keep the segment for the next collector)
     64  collector_beat   i64  collector heartbeat, wall-clock ns
     72  hist_slots       u64  H
     80  dropped          u64  samples dropped by processes that got no entry of their own (their rank did not fit
                               the table, or its entry was held); atomic adds (several processes)
     88  ranks_refused    u64  rank processes that got no entry
     96  warned           u64  kinds of degradation a process of the job has reported already (bit mask, written
                               under the job lock: the job warns once per kind, not once per worker)
    104  dispatched_ns    i64  wall-clock ns: every window that ended by then may have reached a collector's
                               handlers (written by the collector before it dispatches a pass, so a restarted
                               one knows which windows after its watermark it may be emitting again; 0: none)
    112  entries_epoch    u64  bumped (under the job lock) whenever a rank or writer entry is taken or a stat
                               descriptor published: a collector reads the rank table again only when it moved
    120  overwritten      u64  windows of the job lost to the ring before a collector read them, counted once across
                               collectors: written with the watermarks that move past them (in the same store), so a
                               collector killed before it committed leaves both to the next one, which counts them
    128  reserved ... 256

    rank entry (200 bytes)
      0  state            u64  0 free, 1 active, 2 exited (clean), 3 died (seen dead by the collector)
      8  pid              i64
     16  incarnation      u64  bumped on every registration of this entry (a restarted rank)
     24  rank             i64  global rank
     32  local_rank       i64  index of this entry
     40  world_size       i64
     48  start_ns         i64
     56  heartbeat_ns     i64
     64  nstats           u64  descriptors handed out so far (high-water mark)
     72  nan_count        u64  NaN samples ignored by this rank
     80  discarded        u64  samples discarded because a window reached max_samples
     88  writer_of        u64  0 for a rank; 1 + the local rank whose samples this entry also writes, for a
                               writer entry (a forked child or a spawned worker of that rank: its own slots,
                               summed into its rank's rows by the collector)
     96  nhist            u64  histograms handed out so far (high-water mark, at most H)
    104  dropped          u64  samples of this rank that no slot holds: added to a Stat that got no slot (stat or
                               percentile table full, or a writer of the rank that got no entry), plus the
                               unemitted samples of a dead writer of this rank whose entry was taken over, plus
                               the samples of a window under min_window_ms(K) whose bank still held a window
                               past the slot's emitted_wid (see the window constants below); atomic
                               adds (the rank and its writers), counted on the rank's own entry only
    112  stats_refused    u64  Stats of this rank (or its writers) that got no slot (one per process and stat key)
    120  writers_refused  u64  writer processes of this rank that got no entry
    128  events_end       u64  0, or the sequence number after the last item (event or put metric) this entry's
                               process numbered, written by it as its publisher closed with items no collector had
                               acknowledged; a collector that finds the process gone counts what it did not
                               receive of them as a gap, then sets it to 0 (under the job lock)
    136  events_inc       u64  the incarnation that process published under (a forked worker: its rank's)
    144  phase_seq        u64  the phase word's sequence (even; 0: never written), :mod:`shmstat.shm.phase`
    152  phase            2 copies of (word u64, since_ns i64, step u64): the process's innermost open section
                               (``word`` = 1 + its Stat's descriptor index here, or 0, ``| depth << 32``), since
                               when, the steps counted; copy ``(phase_seq >> 1) & 1`` is the published one

    stat descriptor (208 bytes)
      0  state            u64  0 empty, 1 published (written last, after the other fields)
      8  window_ms        u64  1 .. MAX_WINDOW_MS (2**62 ns); a reader refuses others (0, "negative", 2**62 ms).
                               Over LONG_WINDOW_MS (1 h) each writer's window also closes by count or by the
                               writer's end (see the window constants below)
     16  max_samples      i64
     24  agg_mask         u64  bit (1 << Aggregation value)
     32  emitted_wid      i64  the newest window a collector has emitted; written by the rank once, when it
                               publishes the descriptor, as the window before its first (-1: unknown), so
                               windows lost before any collector emitted one are counted; then by the collector
     40  name_len         u64
     48  group_len        u64
     56  incarnation      u64  incarnation of the rank that published the descriptor
     64  flags            u64  bit 0: higher is better (a rate: a straggler is a rank whose figure is low);
                               bit 1: a wait (a section where the rank waits for others: never scored)
     72  hist             i64  1 + index of the stat's histogram in its rank's histogram table; 0 for none
                               (a stat with a percentile aggregation always has one)
     80  name             80 bytes UTF-8
    160  group            48 bytes UTF-8

    bank (64 bytes)
      0  seq              f64  2 * count, plus 1 while a write is in progress (a seqlock whose even value
                               is the sample count: the writer touches one field less per sample)
      8  wid              i64  window id = wall-clock ns // window ns
     16  sum              f64
     24  min              f64
     32  max              f64
     40  last             f64  last value added
     48  last_ts          i64  wall-clock ns of the last value added
     56  incarnation      u64  incarnation of the rank that wrote this window

    histogram (2240 bytes; one per bank of a stat with percentiles: bank b of histogram h of rank i is at
    HIST_BASE + ((i * H + h) * K + b) * 2240; the semantics are in :mod:`shmstat.histogram`)
      0  scale            i64  the window's scale (starts at 8, lowered when the values' range needs it)
      8  zero             u64  samples equal to 0.0
     16  pos_lo           i64  lowest positive bucket index in use at this scale (pos_lo > pos_hi: none)
     24  pos_hi           i64  highest
     32  neg_lo           i64  lowest bucket index of |v| for negative samples (neg_lo > neg_hi: none)
     40  neg_hi           i64
     48  pos_inf          u64  samples equal to +inf (counted apart: an infinity never lowers the scale)
     56  neg_inf          u64  samples equal to -inf (reserved bytes before, so zero in older segments)
     64  pos              u32[M]  count of positive bucket i at position i mod M (M = 272, so the indices in
                                  use, at most M apart, never share a position)
   1152  neg              u32[M]  the same for negative samples
    Bucket index of v at scale s: ``(ceil(log2(|v|) * 256) - 1) >> (8 - s)`` (OpenTelemetry's index at scale s;
    Prometheus native histograms use that + 1); a bucket i holds (base**i, base**(i+1)], base = 2**(2**-s). At
    most M buckets per sign per window; the scale is lowered just enough when a value would need more. A quantile
    read from a bucket is within (base - 1) / (base + 1) of the exact one: 2.2% at scale 4, 1.1% at 5. A bucket
    counts at most 2**32 - 1 samples of one window (then it saturates). An infinite sample counts in pos_inf or
    neg_inf, never in a bucket (in one, near 2**1024, it would lower the whole window's scale); NaN is not counted
    here (the rank's nan_count).

    delivered mark (40 bytes; ``4 * R`` of them: a job's senders are its ranks and their workers, each
    publishing under its own pid)
      0  pid              i64  the sender's pid; 0 for a free mark (written last when a mark is (re)used)
      8  rank             i64  the sender's rank
     16  incarnation      u64  the sender's incarnation
     24  delivered        u64  the sender's items numbered below this were delivered (events: taken by every
                               events sink, or counted lost there; metrics: handed to the metric handlers):
                               the next collector drops a re-sent item below it and counts a gap above it
     32  origin           u64  the sender's publisher's random id (its re-sync marker carries it): a new process
                               that got a dead sender's pid, rank and incarnation is not taken for it

Concurrency guarantees:

- Every bank has exactly one writer, the process registered for its rank entry; it never takes a lock.
  The writer sets ``seq`` odd, writes ``wid`` (on a reset) and the data fields, then sets ``seq`` even. A
  bank's histogram is written only while that bank's ``seq`` is odd, so it is covered by the same seqlock: a
  reader copies ``seq, wid``, the bank and the histogram, then ``wid, seq`` again.
- A reader copies ``seq, wid``, the data, then ``wid, seq`` again and accepts the copy only when both pairs
  match and ``seq`` is even; otherwise it retries. Re-checking ``wid`` catches a bank reset whose new count
  equals the old one. This relies on stores and loads not being reordered with each other (x86-64 TSO).
- Rank entries and descriptors are allocated under the job lock (``flock``, see ``shmstat.shm._joblock``); a
  descriptor's ``state`` is written last, so a reader that sees ``state == 1`` sees the whole descriptor.
- ``emitted_wid`` (once the descriptor is published) and the delivered marks are written only by the collector
  (the one holding the instance lock); a mark's ``delivered`` is one aligned 8-byte store; everything else in a
  rank's region only by that rank (its phase word by the one process holding the entry, a double-buffered seqlock:
  see :mod:`shmstat.shm.phase`) (but ``events_end``, set to 0 by the collector once its process is gone),
  except the drop counters (header ``dropped``/``ranks_refused``, entry ``dropped``/``stats_refused``/
  ``writers_refused``), which every process of the job adds to with atomic read-modify-writes, and the
  header's ``warned``, written under the job lock.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import names as _names

__all__ = [
    "BANK_SIZE",
    "DEFAULT_BANKS",
    "DEFAULT_HIST_SLOTS",
    "DEFAULT_MAX_RANKS",
    "DEFAULT_MAX_STATS",
    "DESC_SIZE",
    "FLAG_HIGHER_IS_BETTER",
    "FLAG_WAIT",
    "HEADER_SIZE",
    "HIST_BUCKETS",
    "HIST_SIZE",
    "LAYOUT_VERSION",
    "LONG_POLL_MS",
    "LONG_WINDOW_MS",
    "MAGIC",
    "MARKS_PER_RANK",
    "MARK_SIZE",
    "MAX_GRACE_MS",
    "MAX_GROUP_BYTES",
    "MAX_NAME_BYTES",
    "MAX_WINDOW_MS",
    "MAX_WINDOW_NS",
    "RANK_ENTRY_SIZE",
    "RING_BUDGET_MS",
    "Geometry",
    "RankState",
    "min_window_ms",
]

MAGIC = b"SHMSTAT\x00"
LAYOUT_VERSION = 5

HEADER_SIZE = 256
RANK_ENTRY_SIZE = 200
DESC_SIZE = 208
BANK_SIZE = 64
HIST_SIZE = 2240
HIST_BUCKETS = 272  # shmstat.histogram.MAX_BUCKETS
MARK_SIZE = 40
MARKS_PER_RANK = 4
HIST_COUNTS = 64  # byte offset of the positive counts inside a histogram; the negative follow at + 4 * M
FLAG_HIGHER_IS_BETTER = 1
FLAG_WAIT = 2
MAX_NAME_BYTES = _names.MAX_STAT_NAME_BYTES  # 80: the name rule's limits for a stat are these fields' sizes
MAX_GROUP_BYTES = _names.MAX_GROUP_BYTES  # 48

DEFAULT_MAX_RANKS = 64
DEFAULT_MAX_STATS = 512
DEFAULT_BANKS = 4
DEFAULT_HIST_SLOTS = 16

# Window lengths a stat may have. Bank ``w % K`` of window ``w`` is reused by window ``w + K``, which starts
# ``(K - 1)`` windows after ``w`` ended; the collector reads ``w`` once it ended plus its grace. So a window must
# satisfy ``(K - 2) * window >= RING_BUDGET_MS`` with the grace at most ``MAX_GRACE_MS``: the collector then has at
# least ``RING_BUDGET_MS - MAX_GRACE_MS`` (50 ms) plus a whole window to read it, and a writer stalled mid-add can
# be waited for up to K-2 windows.
# A shorter window (down to 1 ms, as torch.monitor takes) is allowed too, but the ring cannot hold it at the
# collector's pace: its writer never overwrites a bank whose window is past the slot's ``emitted_wid`` (which the
# collector commits only once its handlers took the window); a sample whose bank is so held is dropped and counted
# in its rank's ``dropped``, and so is the rest of its window until the collector has emitted what the bank holds.
# Nothing the collector may still read is ever written, so the samples are exact or counted, with no race.
#
# The longest window is 2**62 ns (~146 years; torch.monitor takes any): window ids, starts and ends are int64 ns,
# and with windows and wall-clock times both under 2**62 ns (until 2116) a window's end, at most ``now + window``,
# still fits in int64 (the C writer also saturates it).
# Windows up to ``LONG_WINDOW_MS`` (one hour) close on the wall clock. A longer window closes, for each writer
# (a rank or a worker writing for it), at the first of: ``max_samples`` samples (torch.monitor logs a full window
# at once and discards the window's later adds), the writer's end (its process exited or died), a later window
# of that writer (a rank whose clock stepped), or the wall-clock end. The collector looks for such windows every
# ``LONG_POLL_MS``; each writer's window is emitted once, and its merged row holds the ranks closed by then.
RING_BUDGET_MS = 100
MAX_GRACE_MS = 50
MAX_WINDOW_NS = 1 << 62
MAX_WINDOW_MS = MAX_WINDOW_NS // 1_000_000
LONG_WINDOW_MS = 3600 * 1000
LONG_POLL_MS = 200


def min_window_ms(banks: int) -> int:
    """The shortest window (ms) that ``banks`` banks per slot hold at the collector's pace (see above): a shorter one
    is guarded by its writer (it never overwrites an unemitted window; what it drops it counts)."""
    return max(1, -(-RING_BUDGET_MS // max(1, banks - 2)))


# Bits of a descriptor's aggregation mask (``1 << Aggregation value``: VALUE 0, MEAN 2, COUNT 3, SUM 4, MAX 5,
# MIN 6, as torch.monitor numbers them).
VALID_AGG_MASK = (1 << 0) | (1 << 2) | (1 << 3) | (1 << 4) | (1 << 5) | (1 << 6) | (0xF << 10)
PERCENTILE_BITS = 0xF << 10  # P50, P90, P99, P999: a stat with any keeps a histogram

# Header fields (byte offsets).
H_MAGIC, H_VERSION, H_MAX_RANKS, H_MAX_STATS, H_BANKS, H_TOTAL = 0, 8, 16, 24, 32, 40
H_CREATED, H_COLLECTOR_PID, H_COLLECTOR_BEAT, H_HIST_SLOTS = 48, 56, 64, 72
H_DROPPED, H_RANKS_REFUSED, H_WARNED, H_DISPATCHED, H_ENTRIES_EPOCH = 80, 88, 96, 104, 112
H_OVERWRITTEN = 120

# Rank entry fields (byte offsets inside an entry).
R_STATE, R_PID, R_INCARNATION, R_RANK, R_LOCAL_RANK, R_WORLD = 0, 8, 16, 24, 32, 40
R_START, R_HEARTBEAT, R_NSTATS, R_NAN, R_DISCARDED, R_WRITER_OF, R_NHIST = 48, 56, 64, 72, 80, 88, 96
R_DROPPED, R_STATS_REFUSED, R_WRITERS_REFUSED, R_EVENTS_END, R_EVENTS_INC = 104, 112, 120, 128, 136
R_PHASE_SEQ, R_PHASE, PHASE_COPY_SIZE = 144, 152, 24  # the phase word (shmstat.shm.phase)

# Descriptor fields (byte offsets inside a descriptor).
D_STATE, D_WINDOW_MS, D_MAX_SAMPLES, D_AGG_MASK, D_EMITTED = 0, 8, 16, 24, 32
D_NAME_LEN, D_GROUP_LEN, D_INCARNATION, D_FLAGS, D_HIST, D_NAME, D_GROUP = 40, 48, 56, 64, 72, 80, 160
assert D_NAME + MAX_NAME_BYTES == D_GROUP and D_GROUP + MAX_GROUP_BYTES == DESC_SIZE  # the fields hold the rule

# Histogram header fields (byte offsets inside a histogram).
HI_SCALE, HI_ZERO, HI_POS_LO, HI_POS_HI, HI_NEG_LO, HI_NEG_HI, HI_POS_INF, HI_NEG_INF = 0, 8, 16, 24, 32, 40, 48, 56

# Bank fields, in units of 8 bytes (indices into a float64/int64 view of the bank).
B_SEQ, B_WID, B_SUM, B_MIN, B_MAX, B_LAST, B_TS, B_INC = range(8)
BANK_WORDS = BANK_SIZE // 8

# NumPy dtypes of the fields, for readers that view many records at once (the collector's pass): every 8-byte field
# as its 64 bits, the float ones (a bank's seq, sum, min, max, last) viewed as floats, a histogram's bucket counts.
WORD_DTYPE = "<i8"
FLOAT_WORD_DTYPE = "<f8"
HIST_COUNT_DTYPE = "<u4"

# Delivered mark fields (byte offsets inside a mark).
M_PID, M_RANK, M_INCARNATION, M_DELIVERED, M_ORIGIN = 0, 8, 16, 24, 32


class RankState:
    """Values of a rank entry's ``state`` field."""

    FREE = 0
    ACTIVE = 1
    EXITED = 2
    DIED = 3
    NAMES = {0: "free", 1: "active", 2: "exited", 3: "died"}


@dataclass(frozen=True)
class Geometry:
    """Capacities of a segment and the offsets they imply; the only place offsets are computed."""

    max_ranks: int = DEFAULT_MAX_RANKS
    max_stats: int = DEFAULT_MAX_STATS
    banks: int = DEFAULT_BANKS
    hist_slots: int = DEFAULT_HIST_SLOTS
    """Stats per rank that may keep percentiles (each has a histogram per bank)."""

    @property
    def desc_base(self) -> int:
        """Byte offset of the descriptor region."""
        return HEADER_SIZE + self.max_ranks * RANK_ENTRY_SIZE

    @property
    def bank_base(self) -> int:
        """Byte offset of the slot region (64-byte aligned)."""
        end = self.desc_base + self.max_ranks * self.max_stats * DESC_SIZE
        return (end + 63) // 64 * 64

    @property
    def hist_base(self) -> int:
        """Byte offset of the histogram region (64-byte aligned: the bank region is a multiple of 64)."""
        return self.bank_base + self.max_ranks * self.max_stats * self.banks * BANK_SIZE

    @property
    def mark_base(self) -> int:
        """Byte offset of the delivered marks (after the histograms)."""
        return self.hist_base + self.max_ranks * self.hist_slots * self.banks * HIST_SIZE

    @property
    def max_marks(self) -> int:
        """Delivered marks in the segment (senders whose delivered watermark survives the collector)."""
        return self.max_ranks * MARKS_PER_RANK

    def mark_offset(self, index: int) -> int:
        """Byte offset of delivered mark ``index``."""
        return self.mark_base + index * MARK_SIZE

    @property
    def total_size(self) -> int:
        """Size in bytes of the whole segment."""
        return self.mark_base + self.max_marks * MARK_SIZE

    def hist_offset(self, local_rank: int, hist: int) -> int:
        """Byte offset of bank 0's histogram of histogram ``hist`` of a rank; bank ``b``'s follows at
        ``b * HIST_SIZE``."""
        return self.hist_base + (local_rank * self.hist_slots + hist) * self.banks * HIST_SIZE

    def rank_offset(self, local_rank: int) -> int:
        """Byte offset of a rank entry."""
        return HEADER_SIZE + local_rank * RANK_ENTRY_SIZE

    def desc_offset(self, local_rank: int, stat: int) -> int:
        """Byte offset of a stat descriptor."""
        return self.desc_base + (local_rank * self.max_stats + stat) * DESC_SIZE

    def slot_offset(self, local_rank: int, stat: int) -> int:
        """Byte offset of bank 0 of a slot; bank ``b`` follows at ``b * BANK_SIZE``."""
        return self.bank_base + (local_rank * self.max_stats + stat) * self.banks * BANK_SIZE

    def rank_slots_span(self, local_rank: int) -> tuple[int, int]:
        """Byte range ``(start, end)`` of all banks of one rank (what the rank pre-faults)."""
        start = self.slot_offset(local_rank, 0)
        return start, start + self.max_stats * self.banks * BANK_SIZE

    def rank_hist_span(self, local_rank: int) -> tuple[int, int]:
        """Byte range ``(start, end)`` of all histograms of one rank (pre-faulted with its banks)."""
        start = self.hist_offset(local_rank, 0)
        return start, start + self.hist_slots * self.banks * HIST_SIZE
