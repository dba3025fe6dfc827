"""Reading a job's closed windows out of its segment and merging them across ranks.

- :mod:`~collector.read.scanner`: one pass over every rank's slots (long windows looked at by
  :mod:`~collector.read.long_windows`, banks read by :mod:`~collector.read.bank_reads`, histograms by
  :mod:`~collector.read.hist_reader`) over the known slots as arrays (:mod:`~collector.read.slot_table`),
  producing a :mod:`~collector.read.scan_result`;
- :mod:`~collector.read.merge`: a window's figures as a record (``Summary``, ``WindowRow``) and the rules that merge
  two; :mod:`~collector.read.column_merge`: merging a pass's windows on arrays (the collector's and ``shmstat top``'s);
- :mod:`~collector.read.columns`: a pass as columns (what columnar handlers receive), with its histograms as
  arrays (:mod:`~collector.read.hist_batch`).

The modules are imported by name; ``Columns``, ``WindowRow``, ``Summary`` and ``merge`` are re-exported by
:mod:`collector`.
"""

from __future__ import annotations

__all__: list[str] = []
