"""Stragglers: how each rank compares with the node, per closed window of a stat present on two ranks or more.

A rank's figure is its window's p50 when the stat keeps percentiles, else its mean. Its score is
``median over ranks / figure`` for a stat where higher is worse (a time: the slow rank scores under 1), and
``figure / median`` for one that declared ``higher_is_better`` (a rate). Prior art: NVIDIA's resiliency extension
scores ranks the same way and flags under 0.75.
"""

from __future__ import annotations

import statistics

from .merge import Summary

__all__ = ["DEFAULT_THRESHOLD", "DEFAULT_WINDOWS", "figure", "score_ranks"]

DEFAULT_THRESHOLD = 0.75
"""A rank scoring under this is slow for that window."""
DEFAULT_WINDOWS = 3
"""Consecutive slow windows before a rank is reported a straggler."""


def figure(summary: Summary) -> float:
    """The figure a rank is scored on: the window's p50 when the stat keeps a histogram, else its mean."""
    p50 = summary.quantile(0.5)
    return summary.mean if p50 is None else p50


def score_ranks(figures: dict[int, float], higher_is_better: bool = False) -> tuple[float, dict[int, float]]:
    """``(node median, {rank: score})`` for one window's figures by rank; empty when fewer than two ranks.

    A score of 1.0 is the median rank; under 1.0 is worse than the median in the stat's direction. A figure
    of 0 (a rank that spent no time, or produced nothing) scores as well as can be (inf) for a time-like stat
    and 0.0 for a rate; a median of 0 gives every rank 1.0 (nothing to compare against).
    """
    if len(figures) < 2:
        return 0.0, {}
    median = statistics.median(figures.values())
    scores: dict[int, float] = {}
    for rank, value in figures.items():
        if median == 0:
            scores[rank] = 1.0
        elif higher_is_better:
            scores[rank] = value / median
        else:
            scores[rank] = median / value if value != 0 else float("inf")
    return median, scores
