"""``shmstat grafana``: a Grafana dashboard (its JSON model, ready to import) of the series the collectors'
``/metrics`` endpoints export (:mod:`collector.prometheus.exporter`), one Prometheus merging every node.

The model is built here as plain data rather than with a dashboard library: grafanalib is no longer maintained,
and Grafana's own grafana-foundation-sdk is an alpha that needs Python 3.11 (shmstat supports 3.10) and ties the
model to one Grafana version; the few fields used here (panels, targets, template variables) have been stable
across Grafana 9 to 12.

Template variables: ``datasource`` (a Prometheus data source), ``job`` (shmstat jobs seen), ``stat`` (the stat to
draw, e.g. the step time; several may be chosen) and ``node``. Every panel's PromQL is in :data:`PANELS`, with
``$job``, ``$stat``, ``$node`` and ``$__rate_interval`` as Grafana substitutes them; the tests run each one against a
real Prometheus scraping a real collector. GPU figures are the stats of group ``gpu`` (per rank, as every stat).

The panels after the GPU's read what a job with sections (:func:`shmstat.section`) exports: each rank's split of
its time across its sections, and the hang detector's ``shmstat_job_hung`` and
``shmstat_rank_progress_age_seconds``; the node heatmap and the straggler nodes and ranks read the recording rules
of ``shmstat prometheus-rules`` (:mod:`collector.cli.prometheus_rules`: each rank's and each node's score against
the job-wide median), so they are empty in a Prometheus that does not load them (:attr:`Panel.needs` says which).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..daemon.straggler import DEFAULT_THRESHOLD
from .prometheus_rules import DEFAULT_HANG_AFTER_S, HANG_AGE, SCORE

__all__ = ["PANELS", "Panel", "dashboard", "dashboard_json"]

_SEL = 'job=~"$job", node=~"$node"'
_STAT = f'{_SEL}, stat=~"$stat"'
_RATE = "[$__rate_interval]"
_BY_JOB = "job, group, stat"
_BY_RANK = "job, node, group, stat, rank"
_SECTION_SHARE = (f'sum by ({_BY_RANK}) (rate(shmstat_stat_sum_total{{{_SEL}, group="section", rank!=""}}{_RATE})) '
                  "/ 1000")  # ms spent in the section per second: its share of the rank's time
_WAITS = f'shmstat_stat_info{{{_SEL}, group="section", wait="1"}}'


@dataclass(frozen=True)
class Panel:
    """One panel: its title, what it shows, its queries (PromQL, legend) and unit."""

    title: str
    description: str
    queries: tuple[tuple[str, str], ...]
    unit: str = "short"
    gpu: bool = False
    """A panel of the ``gpu`` group: empty on nodes without a GPU."""
    threshold: float | None = None
    """A line at this value: red under it (a score), or red over it with ``high_is_bad`` (an age)."""
    high_is_bad: bool = False
    kind: str = "timeseries"
    """Grafana's panel type: ``timeseries``, or ``status-history`` (one row per series, a cell per time coloured by
    the thresholds: a heatmap of nodes over time)."""
    needs: str = ""
    """What the panel needs besides the collectors' series of any job: ``sections`` (a job with sections),
    ``rules`` (a Prometheus loading ``shmstat prometheus-rules``)."""


PANELS: tuple[Panel, ...] = (
    Panel("Step time, merged (mean per window)",
          "Mean of the chosen stats over every rank of every node: sum of the samples over their count, from the "
          "counters, so nodes merge exactly.",
          ((f"sum by ({_BY_JOB}) (rate(shmstat_stat_sum_total{{{_STAT}, rank=\"\"}}{_RATE})) / "
            f"sum by ({_BY_JOB}) (rate(shmstat_stat_count_total{{{_STAT}, rank=\"\"}}{_RATE}))",
            "{{job}} {{group}}/{{stat}}"),)),
    Panel("Step time per rank (mean)",
          "Each rank's mean of the chosen stats, from its counters.",
          ((f"sum by ({_BY_RANK}) (rate(shmstat_stat_sum_total{{{_STAT}, rank!=\"\"}}{_RATE})) / "
            f"sum by ({_BY_RANK}) (rate(shmstat_stat_count_total{{{_STAT}, rank!=\"\"}}{_RATE}))",
            "{{stat}} {{node}} rank {{rank}}"),)),
    Panel("p50 and p99 (histograms, every node merged)",
          "Quantiles of the chosen stats from the merged histograms (exponential schema 2 boundaries, the same "
          "on every node, so histogram_quantile merges nodes); stats that keep percentiles only.",
          ((f"histogram_quantile(0.5, sum by (le, {_BY_JOB}) (rate(shmstat_stat_hist_bucket{{{_STAT}}}{_RATE})))",
            "p50 {{group}}/{{stat}}"),
           (f"histogram_quantile(0.99, sum by (le, {_BY_JOB}) (rate(shmstat_stat_hist_bucket{{{_STAT}}}{_RATE})))",
            "p99 {{group}}/{{stat}}"))),
    Panel("Straggler score per rank",
          "The collector's own score of each rank in the newest scored window (collector/daemon/straggler.py: "
          "the node's median figure over the rank's, or the rank's over the median for a stat declared "
          f"higher_is_better, such as tokens/s; the figure is the p50, else the mean). Under {DEFAULT_THRESHOLD} "
          "(the line) the rank is slow in that window.",
          ((f'shmstat_stat_straggler_score{{{_STAT}, rank!=""}}', "{{stat}} {{node}} rank {{rank}}"),),
          threshold=DEFAULT_THRESHOLD),
    Panel("Samples per second",
          "Samples added to the chosen stats per second, every rank of every node.",
          ((f"sum by ({_BY_JOB}) (rate(shmstat_stat_count_total{{{_STAT}, rank=\"\"}}{_RATE}))",
            "{{job}} {{group}}/{{stat}}"),), unit="ops"),
    Panel("Events per second",
          "Events and put metrics the collectors relayed per second.",
          ((f"sum by (job) (rate(shmstat_collector_events_relayed_total{{{_SEL}}}{_RATE}))", "events {{job}}"),
           (f"sum by (job) (rate(shmstat_collector_metrics_relayed_total{{{_SEL}}}{_RATE}))",
            "put metrics {{job}}")), unit="ops"),
    Panel("Drops and gaps",
          "What was lost, counted: samples the ranks could not write, windows overwritten before they were read "
          "or torn by a dying writer, numbered items missing in a sender's stream (gaps), events a sink lost, "
          "rows a slow handler lost. All zero in a healthy job.",
          tuple((f"sum by (job) (increase(shmstat_collector_{name}_total{{{_SEL}}}{_RATE}))", f"{name} {{{{job}}}}")
                for name in ("samples_dropped", "windows_overwritten", "windows_torn", "seq_gaps",
                             "events_dropped", "handler_dropped"))),
    Panel("GPU per rank",
          "Every stat of group gpu (utilisation, memory, power, temperature, clocks) per rank: the newest "
          "window's mean. Empty on nodes without a GPU.",
          ((f'shmstat_stat_mean{{{_SEL}, group="gpu", rank!=""}}', "{{stat}} {{node}} rank {{rank}}"),),
          gpu=True),
    Panel("Section split per rank (share of its time)",
          "Each rank's time in each of its sections (shmstat.section): the milliseconds it spent there per second, "
          "so 0.4 is 40% of its time, the split of its steps. Wait sections (a collective, a barrier: the healthy "
          "ranks wait longest) are the series marked (wait). A nested section counts in its parent too.",
          ((f"{_SECTION_SHARE}\nunless on (job, node, group, stat) {_WAITS}", "{{node}} rank {{rank}} {{stat}}"),
           (f"{_SECTION_SHARE}\nand on (job, node, group, stat) {_WAITS}", "{{node}} rank {{rank}} {{stat}} (wait)")),
          unit="percentunit", needs="sections"),
    Panel("Hangs: jobs hung",
          "1 while a node's collector finds the job hung (--hang-after: no rank of the node made progress, no "
          "section left and no step, while one is in a section); the console line and the shmstat.hang event name "
          "the ranks.",
          ((f"max by (job, node) (shmstat_job_hung{{{_SEL}}})", "{{job}} on {{node}}"),), needs="sections"),
    Panel("Hangs: seconds since each rank's last progress",
          "Per rank, the seconds since its phase word last changed (a section entered or left, a step counted), "
          "labelled with the section it is in. In a hang the rank holding the job is the one outside a wait "
          f"section; the line is the default --hang-after ({DEFAULT_HANG_AFTER_S:g} s).",
          ((f'{HANG_AGE}{{{_SEL}, wait!="1"}}', "{{node}} rank {{rank}} in {{section}}"),
           (f'{HANG_AGE}{{{_SEL}, wait="1"}}', "{{node}} rank {{rank}} in {{section}} (wait)")),
          unit="s", threshold=DEFAULT_HANG_AFTER_S, high_is_bad=True, needs="sections"),
    Panel("Node heatmap: each node's score against the job's median",
          "One row per node, one cell per time: the node's worst score over the chosen stats (its ranks' mean "
          "against the job-wide median rank, the rules of shmstat prometheus-rules). Red under "
          f"{DEFAULT_THRESHOLD}: a slow node, even where its ranks equal each other.",
          ((f'min by (job, node) ({SCORE}{{{_STAT}, rank=""}})', "{{node}} ({{job}})"),),
          threshold=DEFAULT_THRESHOLD, kind="status-history", needs="rules"),
    Panel("Straggler nodes and ranks",
          f"Every node and every rank scoring under {DEFAULT_THRESHOLD} against the job-wide median on any scored "
          "stat, sections included (the rules of shmstat prometheus-rules; the stat names the section). Empty "
          "while no node or rank is slow.",
          ((f'{SCORE}{{{_SEL}, rank=""}} < {DEFAULT_THRESHOLD!r}', "node {{node}}: {{group}}/{{stat}}"),
           (f'{SCORE}{{{_SEL}, rank!=""}} < {DEFAULT_THRESHOLD!r}', "{{node}} rank {{rank}}: {{group}}/{{stat}}")),
          threshold=DEFAULT_THRESHOLD, needs="rules"),
)
"""The dashboard's panels, in order."""


def _variable(name: str, label: str, query: str, *, multi: bool = True) -> dict[str, Any]:
    return {"name": name, "label": label, "type": "query", "datasource": {"type": "prometheus",
                                                                         "uid": "${datasource}"},
            "query": {"query": query, "refId": f"{name}-values"}, "definition": query, "refresh": 2,
            "includeAll": True, "multi": multi, "allValue": ".*", "sort": 1,
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]}}


def _panel(index: int, panel: Panel) -> dict[str, Any]:
    width = 12
    field_defaults: dict[str, Any] = {"unit": panel.unit, "custom": {"drawStyle": "line", "lineWidth": 1,
                                                                    "fillOpacity": 0, "showPoints": "never"}}
    options: dict[str, Any] = {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                               "tooltip": {"mode": "multi", "sort": "desc"}}
    if panel.threshold is not None:
        low, high = ("green", "red") if panel.high_is_bad else ("red", "green")
        field_defaults["thresholds"] = {"mode": "absolute", "steps": [{"color": low, "value": None},
                                                                      {"color": high, "value": panel.threshold}]}
        field_defaults["custom"]["thresholdsStyle"] = {"mode": "line"}
    if panel.kind == "status-history":
        field_defaults["custom"] = {"lineWidth": 0, "fillOpacity": 80}
        field_defaults["color"] = {"mode": "thresholds"}
        options.update({"showValue": "never", "rowHeight": 0.9, "colWidth": 0.9})
    return {
        "id": index + 1, "type": panel.kind, "title": panel.title, "description": panel.description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": width, "x": (index % 2) * width, "y": (index // 2) * 8},
        "fieldConfig": {"defaults": field_defaults, "overrides": []},
        "options": options,
        "targets": [{"refId": chr(ord("A") + i), "datasource": {"type": "prometheus", "uid": "${datasource}"},
                     "expr": expr, "legendFormat": legend, "range": True}
                    for i, (expr, legend) in enumerate(panel.queries)],
    }


def dashboard(*, title: str = "shmstat", uid: str = "shmstat-jobs") -> dict[str, Any]:
    """The dashboard's JSON model (Grafana's import format) as a dict: the template variables and one
    time-series panel per entry of :data:`PANELS`."""
    return {
        "title": title, "uid": uid, "tags": ["shmstat"], "timezone": "browser", "schemaVersion": 39,
        "editable": True, "graphTooltip": 1, "refresh": "10s", "time": {"from": "now-30m", "to": "now"},
        "description": "shmstat jobs: step time merged and per rank, percentiles, straggler scores, events, "
                       "drops and gaps, GPUs, sections, hangs, nodes (from the collectors' Prometheus endpoints "
                       "and the rules of shmstat prometheus-rules; shmstat grafana)",
        "templating": {"list": [
            {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0},
            _variable("job", "job", "label_values(shmstat_stat_count_total, job)"),
            _variable("stat", "stat", 'label_values(shmstat_stat_count_total{job=~"$job"}, stat)'),
            _variable("node", "node", 'label_values(shmstat_stat_count_total{job=~"$job"}, node)'),
        ]},
        "annotations": {"list": []},
        "panels": [_panel(i, p) for i, p in enumerate(PANELS)],
    }


def dashboard_json(*, title: str = "shmstat", uid: str = "shmstat-jobs") -> str:
    """:func:`dashboard` as indented JSON text (what ``shmstat grafana`` prints)."""
    return json.dumps(dashboard(title=title, uid=uid), indent=2)
