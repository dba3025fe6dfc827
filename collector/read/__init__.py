"""Reading a job's closed windows out of its segment and merging them across ranks.

- :mod:`~collector.read.scanner`: the scanner and its reads: one pass over every rank's slots (the known slots as
  arrays, banks and histograms read with the seqlock on arrays, long windows looked at cheaply), producing a
  ``ScanResult``;
- :mod:`~collector.read.columns`: a pass as columns (what every handler receives), and the one merge that builds
  them, a pass's windows merged across writers and ranks on arrays (the collector's and ``shmstat top``'s);
- :mod:`~collector.read.hist_batch`: many windows' histograms as arrays;
- :mod:`~collector.read.rows`: a row as a record (``WindowRow``: a stat's window with its labels, its figures a
  :class:`shmstat.shm.layout_records.WindowFigures`; ``WindowSpan``), for the rows that are wanted as objects.

The modules are imported by name; ``Columns``, ``WindowRow`` and ``WindowFigures`` are re-exported by
:mod:`collector`.
"""

from __future__ import annotations

__all__: list[str] = []
