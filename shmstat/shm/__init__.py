"""The node's shared memory as both sides see it (ranks write it, the collector and ``shmstat`` read it).

- :mod:`~shmstat.shm.runtime`: job ids, the names of a job's segment and sockets, the owner-only runtime directory;
- :mod:`~shmstat.shm.layout`: the binary layout of a job's segment, the one source of truth for both sides;
- :mod:`~shmstat.shm.layout_records`: those records decoded, as values (header, rank entry, stat descriptor, bank);
- :mod:`~shmstat.shm.layout_codec`: reading and writing that layout's records (header, rank entries, descriptors,
  banks under their seqlock, histograms) and the checks a reader applies to them;
- :mod:`~shmstat.shm.segment`: creating, attaching and listing segments, under the job lock
  (:mod:`~shmstat.shm._joblock`), among only this user's entries of ``/dev/shm`` (:mod:`~shmstat.shm.shm_entries`);
- :mod:`~shmstat.shm.reader`: reading closed windows back out of a segment.

Nothing here knows about events, publishing or writing a stat; the modules are imported by name.
"""

from __future__ import annotations

__all__: list[str] = []
