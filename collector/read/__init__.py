"""Reading a job's closed windows out of its segment and merging them across ranks.

- :mod:`~collector.read.scanner`: one pass over every rank's slots (long windows looked at by
  :mod:`~collector.read.long_windows`, histograms read by :mod:`~collector.read.hist_reader`) over the known
  slots as arrays (:mod:`~collector.read.slot_table`), producing a :mod:`~collector.read.scan_result`;
- :mod:`~collector.read.merge`: merging windows per row; :mod:`~collector.read.column_merge`: the same on arrays;
- :mod:`~collector.read.columns`: a pass as columns (what columnar handlers receive), with its histograms as
  arrays (:mod:`~collector.read.hist_batch`).

The modules are imported by name; ``Columns``, ``WindowRow``, ``Summary`` and ``merge`` are re-exported by
:mod:`collector`.
"""

from __future__ import annotations

__all__: list[str] = []
