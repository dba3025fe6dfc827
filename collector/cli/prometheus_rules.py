"""``shmstat prometheus-rules``: a Prometheus rules file (recording and alerting rules) over the series every node
collector's ``/metrics`` exports (:mod:`collector.prometheus.exporter`), so one Prometheus scraping every node
scores the whole job: each rank and each node against the job-wide median, by the collector's own straggler rule.

Recording rules (evaluated in order, one group):

- :data:`FIGURE` ``{job, node, group, stat, rank}``: each rank's figure of every stat the straggler rule scores
  (``shmstat_stat_info{scored="1"}``), the very figure the collector scores
  (:func:`collector.daemon.scoring.figure`): its newest window's p50 (``shmstat_stat_p50``) where the stat keeps
  percentiles, else its mean (``shmstat_stat_mean``), while the rank added samples within the last ``interval``
  (a rank that stopped adding, hung or gone, is not scored on its last window), and not while that window had no
  sample (:data:`EMPTY`: a window torn by a writer that died in the middle of an add, which the collector does not
  score either);
- :data:`NODE_MEDIAN` ``{job, node, group, stat}`` (and the target's labels, ``instance``): each node's figure, the
  median of its ranks' figures (what its collector scores them against);
- :data:`MEDIAN` ``{job, group, stat}``: the median of the rank figures across every rank of every node
  (``quantile(0.5)``: the two middle figures' mean for an even count, as the collector's median), for stats on two
  ranks or more;
- :data:`SCORE` ``{job, node, group, stat, [rank]}``: each rank's and each node's score against that median, one
  rule for both: ``median / figure``, or ``figure / median`` where the stat declared ``higher_is_better``
  (``shmstat_stat_info{higher_is_better="1"}``), as :mod:`collector.daemon.straggler` scores a node's ranks. Under
  the threshold: slower than the job's median rank. On a node alone, a rank's score is the collector's
  ``shmstat_stat_straggler_score`` of the same window;
- :data:`COLLECTOR_JOBS` ``{instance, job, node}``: the training jobs each collector target serves, kept while
  the target is down, so that ``ShmstatCollectorDown`` carries the training job (``job``; the scrape job goes in
  ``scrape_job``), as the other alerts do; a target on which no job was ever seen alerts with no ``job``.

Alerting rules: :data:`ALERTS` (their names) -- a slow rank, a slow node, a hang, data lost, a collector down.
``ShmstatHang`` fires for each rank a node collector's hang detector names (:data:`HANG_SUSPECT`: a rank stopped
inside a collective too, whose own series says it waits) and, where no collector sees the whole picture, for a rank
outside a wait section past ``--hang-after`` while a rank of its job waits on any node (:data:`HANG_AGE`); one
alert per rank (``or on (job, node, rank)``: the collector's, with its ``state``, wins). The file is built as plain data
and written by a small YAML emitter (:func:`to_yaml`; the package has no YAML dependency).
"""

from __future__ import annotations

import json
import re
from typing import Any

from shmstat.errors import ConfigError

from ..daemon.straggler import DEFAULT_THRESHOLD, DEFAULT_WINDOWS, MAX_WINDOWS

__all__ = ["ALERTS", "COLLECTOR_JOBS", "DATA_LOST_COUNTERS", "DEFAULT_HANG_AFTER_S", "DEFAULT_INTERVAL_S", "EMPTY",
           "FIGURE", "HANG_AGE", "HANG_SUSPECT", "JOBS_KEPT", "MEDIAN", "NODE_MEDIAN", "SCORE", "rules", "rules_yaml",
           "to_yaml"]

FIGURE = "shmstat:stat_figure"
"""Recording rule: each rank's figure of a scored stat, as the collector scores it (its newest window's p50 where
the stat keeps percentiles, else its mean)."""
NODE_MEDIAN = "shmstat:stat_figure:node_median"
"""Recording rule: each node's figure, the median of its ranks' figures (what its collector scores them against)."""
MEDIAN = "shmstat:stat_figure:job_median"
"""Recording rule: the job-wide median of the per-rank figures."""
SCORE = "shmstat:straggler_score"
"""Recording rule: each rank's and each node's score against the job-wide median (under the threshold: slow)."""
COLLECTOR_JOBS = "shmstat:collector_jobs"
"""Recording rule: 1 per training job each collector target (``instance``) serves, kept while the target is down
(so that ``ShmstatCollectorDown`` names the training jobs it served)."""
JOBS_KEPT = "5m"
"""How far back :data:`COLLECTOR_JOBS` looks for its own last value while a target is down: longer than any rule
evaluation interval."""
EMPTY = "shmstat_stat_window_empty"
"""The exporter's gauge (1, the stat series' labels) of a series whose newest window had no sample (possible only on
a torn window, whose figures are exported as 0): :data:`FIGURE` leaves the rank out, as the collector does."""
HANG_AGE = "shmstat_rank_progress_age_seconds"
"""The hang detector's gauge (labels job, node, rank, section, wait): seconds since the rank last made progress."""
HANG_SUSPECT = "shmstat_hang_suspect_age_seconds"
"""The hang detector's gauge (labels job, node, rank, section, state) of each rank its hang line names, while the
episode lasts: seconds since the rank last made progress."""
ALERTS = ("ShmstatStragglerRank", "ShmstatStragglerNode", "ShmstatHang", "ShmstatDataLost", "ShmstatCollectorDown")
"""The alerting rules, in the file's order."""
DATA_LOST_COUNTERS = ("samples_dropped", "windows_overwritten", "windows_torn", "seq_gaps", "events_dropped",
                      "handler_dropped", "subscriber_items_lost")
"""The ``shmstat_collector_<name>_total`` counters that count something lost: ``ShmstatDataLost`` when one grows."""
DEFAULT_INTERVAL_S = 60
"""The default interval: a rank is scored while it added samples within the last minute."""
DEFAULT_HANG_AFTER_S = 30.0
"""The default hang threshold: a rank that made no progress for this long while another rank of its job waits."""

_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SCRAPE_JOB = re.compile(r"[A-Za-z0-9_.:/-]+")


def rules(*, threshold: float = DEFAULT_THRESHOLD, windows: int = DEFAULT_WINDOWS,
          interval_s: int = DEFAULT_INTERVAL_S, hang_after_s: float = DEFAULT_HANG_AFTER_S,
          scrape_job: str = "shmstat") -> dict[str, Any]:
    """The rules file as data (Prometheus' rule file format). A rank or node is alerted on once its score stays
    under ``threshold`` for ``windows`` intervals of ``interval_s`` seconds (the alerts' ``for:``);
    ``scrape_job`` is the ``job_name`` of the scrape configuration of the collectors (whose ``up`` says one is
    down)."""
    if not 0 < threshold < 1:
        raise ConfigError(f"--threshold must be between 0 and 1 (exclusive), got {threshold}")
    if not 1 <= windows <= MAX_WINDOWS:
        raise ConfigError(f"--windows must be between 1 and {MAX_WINDOWS}, got {windows}")
    if interval_s < 1:
        raise ConfigError(f"--interval must be 1 second or more, got {interval_s}")
    if not hang_after_s > 0:
        raise ConfigError(f"--hang-after must be positive, got {hang_after_s}")
    if not _SCRAPE_JOB.fullmatch(scrape_job):
        raise ConfigError(f"--scrape-job {scrape_job!r} is not a scrape job name (letters, digits, _.:/-)")
    rate = f"[{interval_s}s]"
    slow_for = f"{windows * interval_s}s"
    hib = 'shmstat_stat_info{higher_is_better="1"}'
    up = f'up{{job="{scrape_job}"}}'
    records = [
        {"record": FIGURE,
         "expr": '(shmstat_stat_p50{rank!=""} or shmstat_stat_mean{rank!=""})\n'
                 f'and on (job, node, group, stat, rank) (increase(shmstat_stat_count_total{{rank!=""}}{rate}) > 0)\n'
                 'and on (job, node, group, stat) shmstat_stat_info{scored="1"}\n'
                 f'unless on (job, node, group, stat, rank) {EMPTY}'},
        {"record": NODE_MEDIAN,
         "expr": f"quantile without (rank) (0.5, {FIGURE})"},
        {"record": MEDIAN,
         "expr": f"quantile by (job, group, stat) (0.5, {FIGURE})\n"
                 f"and on (job, group, stat) (count by (job, group, stat) ({FIGURE}) > 1)"},
        {"record": SCORE,
         "expr": f"(\n  {MEDIAN} / on (job, group, stat) group_right () ({FIGURE} or {NODE_MEDIAN})\n"
                 f"  unless on (job, group, stat) {hib}\n)\nor\n"
                 f"(\n  ({FIGURE} or {NODE_MEDIAN}) / on (job, group, stat) group_left {MEDIAN}\n"
                 f"  and on (job, group, stat) {hib}\n)"},
        {"record": COLLECTOR_JOBS,
         "expr": f"group by (instance, job, node) (shmstat_collector_windows_emitted_total)\n"
                 f"or (last_over_time({COLLECTOR_JOBS}[{JOBS_KEPT}]) and on (instance) ({up} == 0))"},
    ]
    lost = "\nor ".join(f'label_replace(increase(shmstat_collector_{name}_total{rate}) > 0, "counter", "{name}", '
                        '"", "")' for name in DATA_LOST_COUNTERS)
    down = (f'label_replace(\n  {up[:-1]}, node!=""}} == 0\n'
            f'  or label_replace({up[:-1]}, node=""}} == 0, "node", "$1", "instance", "(.+):[0-9]+"),\n'
            '  "scrape_job", "$1", "job", "(.+)"\n)')
    alerts = [
        {"alert": "ShmstatStragglerRank", "expr": f'{SCORE}{{rank!=""}} < {threshold!r}',
         "for": slow_for, "keep_firing_for": slow_for,
         "labels": {"severity": "warning"},
         "annotations": {
             "summary": "Rank {{ $labels.rank }} on {{ $labels.node }} is slow on {{ $labels.group }}/"
                        "{{ $labels.stat }} (job {{ $labels.job }})",
             "description": "Its score against the job-wide median rank is {{ $value | printf \"%.3f\" }} "
                            f"(under {threshold!r} for {slow_for})."}},
        {"alert": "ShmstatStragglerNode", "expr": f'{SCORE}{{rank=""}} < {threshold!r}',
         "for": slow_for, "keep_firing_for": slow_for,
         "labels": {"severity": "warning"},
         "annotations": {
             "summary": "Node {{ $labels.node }} is slow on {{ $labels.group }}/{{ $labels.stat }} "
                        "(job {{ $labels.job }})",
             "description": "Its median rank against the job-wide median rank scores "
                            "{{ $value | printf \"%.3f\" }} "
                            f"(under {threshold!r} for {slow_for}), even where its ranks equal each other."}},
        {"alert": "ShmstatHang",
         "expr": f"{HANG_SUSPECT}\nor on (job, node, rank)\n"
                 f'(\n  {HANG_AGE}{{wait!="1"}} > {hang_after_s!r}\n'
                 f'  and on (job) (count by (job) ({HANG_AGE}{{wait="1"}}) > 0)\n)',
         "labels": {"severity": "critical"},
         "annotations": {
             "summary": "Rank {{ $labels.rank }} on {{ $labels.node }} holds job {{ $labels.job }} in section "
                        "\"{{ $labels.section }}\"",
             "description": "No progress for {{ $value | printf \"%.0f\" }} s"
                            "{{ if $labels.state }}; the collector of {{ $labels.node }} names it "
                            "({{ $labels.state }}).{{ else }} outside a wait section while other ranks of the job "
                            "wait.{{ end }}"}},
        {"alert": "ShmstatDataLost", "expr": lost,
         "labels": {"severity": "warning"},
         "annotations": {
             "summary": "Collector of {{ $labels.node }} counted {{ $labels.counter }} (job {{ $labels.job }})",
             "description": f"shmstat_collector_{{{{ $labels.counter }}}}_total grew by "
                            f"{{{{ $value | printf \"%.0f\" }}}} in {interval_s}s."}},
        {"alert": "ShmstatCollectorDown",
         "expr": f"{down}\n  * on (instance) group_right (scrape_job) {COLLECTOR_JOBS}\n"
                 f'or label_replace(\n  {down}\n  unless on (instance) {COLLECTOR_JOBS},\n  "job", "", "", ""\n)',
         "for": f"{interval_s}s",
         "labels": {"severity": "critical"},
         "annotations": {
             "summary": "The shmstat collector of {{ $labels.node }} is not scraped ({{ $labels.instance }})",
             "description": "Prometheus could not scrape it for "
                            f"{interval_s}s: that node's ranks are not seen."}},
    ]
    return {"groups": [{"name": "shmstat-records", "rules": records},
                       {"name": "shmstat-alerts", "rules": alerts}]}


def rules_yaml(**options: Any) -> str:
    """:func:`rules` as YAML text (what ``shmstat prometheus-rules`` prints)."""
    head = "# shmstat prometheus-rules: load with rule_files in prometheus.yml; check with promtool check rules\n"
    return head + to_yaml(rules(**options))


def to_yaml(value: Any, indent: int = 0) -> str:
    """Dicts, lists, strings and numbers as block YAML: strings double-quoted as JSON writes them (a YAML
    double-quoted scalar), those holding line breaks as literal blocks."""
    return "".join(line + "\n" for line in _lines(value, indent))


def _lines(value: Any, indent: int) -> list[str]:
    pad = " " * indent
    out: list[str] = []
    if isinstance(value, dict):
        for key, item in value.items():
            name = key if _PLAIN_KEY.fullmatch(key) else _scalar(key)
            out.extend(_entry(f"{pad}{name}:", item, indent))
    elif isinstance(value, list):
        for item in value:
            nested = _lines(item, indent + 2) if isinstance(item, (dict, list)) and item else None
            if nested:
                out.append(f"{pad}- {nested[0][indent + 2:]}")
                out.extend(nested[1:])
            else:
                out.extend(_entry(f"{pad}-", item, indent))
    else:
        out.append(pad + _scalar(value))
    return out


def _entry(prefix: str, item: Any, indent: int) -> list[str]:
    if isinstance(item, (dict, list)) and item:
        return [prefix, *_lines(item, indent + 2)]
    if isinstance(item, str) and "\n" in item:
        body = " " * (indent + 2)
        return [f"{prefix} |-", *(body + line if line else "" for line in item.split("\n"))]
    return [f"{prefix} {_scalar(item)}"]


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, dict):
        return "{}"
    if isinstance(value, list):
        return "[]"
    return json.dumps(str(value))
