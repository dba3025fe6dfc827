"""The whole job across nodes, live, without Prometheus: node collectors' streams turned into job-wide straggler
and hang events (:mod:`collector.jobwide.watch`: :func:`~collector.jobwide.watch.watch`, re-exported as
``collector.watch``), which ``shmstat top --nodes`` shows."""
