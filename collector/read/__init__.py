"""Reading a job's closed windows out of its segment and merging them across ranks.

- :mod:`~collector.read.scanner`: one pass over every rank's slots (long windows looked at by
  :mod:`~collector.read.long_windows`, banks read by :mod:`~collector.read.bank_reads`, histograms by
  :mod:`~collector.read.hist_reader`) over the known slots as arrays (:mod:`~collector.read.slot_table`),
  producing a :mod:`~collector.read.scan_result`;
- :mod:`~collector.read.column_merge`: the one merge, a pass's windows merged across writers and ranks on arrays
  (the collector's and ``shmstat top``'s);
- :mod:`~collector.read.columns`: a pass as columns (what every handler receives), with its histograms as
  arrays (:mod:`~collector.read.hist_batch`);
- :mod:`~collector.read.merge`: a window's figures as a record (``Summary``, ``WindowRow``), for the rows that
  are wanted as objects.

The modules are imported by name; ``Columns``, ``WindowRow`` and ``Summary`` are re-exported by :mod:`collector`.
"""

from __future__ import annotations

__all__: list[str] = []
