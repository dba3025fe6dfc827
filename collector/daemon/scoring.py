"""The one scoring rule: how a rank's figure compares with the median of the ranks it is scored against (a node's,
or the job's), the same code on every surface: the collector's passes (:mod:`collector.daemon.straggler`), a
straggler's cause (:mod:`collector.daemon.cause`), ``top``, ``report`` and the job-wide view
(:mod:`collector.jobwide.watch`). Prior art: NVIDIA's resiliency extension scores ranks the same way (a reference
median over the rank's own) and flags under 0.75."""

from __future__ import annotations

import math

import numpy as np

from shmstat.shm.layout_records import WindowFigures

__all__ = ["figure", "score_against", "score_blocks", "score_ranks"]


def figure(summary: WindowFigures) -> float:
    """The figure a rank is scored on: the window's p50 when the stat keeps a histogram, else its mean."""
    p50 = summary.quantile(0.5)
    return summary.mean if p50 is None else p50


def score_ranks(figures: dict[int, float], higher_is_better: bool = False) -> tuple[float, dict[int, float]]:
    """``(node median, {rank: score})`` for one window's figures by rank, by the very code the collector scores its
    passes with (:func:`score_blocks`); empty when fewer than two ranks have a finite figure, or one is negative.

    A score of 1.0 is the median rank; under 1.0 is worse than the median in the stat's direction. A figure
    of 0 (a rank that spent no time, or produced nothing) scores as well as can be (inf) for a time-like stat
    and 0.0 for a rate; a median of 0 gives every rank 1.0 (nothing to compare against). Ranks whose figure is
    not finite are left out.
    """
    kept = sorted((f, rank) for rank, f in figures.items() if math.isfinite(f))
    f = np.array([x for x, _ in kept], np.float64)
    median, score, keep = score_blocks(np.zeros(len(f), np.int64), f, np.full(len(f), higher_is_better))
    if not keep.all() or not len(f):
        return 0.0, {}
    return float(median[0]), {rank: s for (_, rank), s in zip(kept, score.tolist(), strict=True)}


def score_blocks(b: np.ndarray, f: np.ndarray, higher_is_better: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The straggler rule on arrays, the one implementation every surface uses (the collector's passes, ``top``,
    ``report``; Grafana plots the collector's scores): ``f`` holds figures grouped in blocks (``b``, one block per
    window of a stat, sorted by block then figure) and ``higher_is_better`` each figure's direction. Returns, per
    figure, its block's median and its score (``median / figure``, or ``figure / median`` where higher is better),
    and which figures are scored (their block has two figures or more and none negative)."""
    if not len(b):
        return np.zeros(0), np.zeros(0), np.zeros(0, bool)
    size = np.bincount(b)
    start = np.cumsum(size) - size
    neg = np.bincount(b, weights=(f < 0), minlength=len(size)) > 0
    keep = ((size >= 2) & ~neg)[b]
    half = size // 2
    hi_mid = _f_sorted_at(f, start, size, half)
    lo_mid = _f_sorted_at(f, start, size, np.maximum(half - 1, 0))
    median = np.where(size % 2 == 1, hi_mid, (lo_mid + hi_mid) / 2)[b]
    return median, score_against(median, f, higher_is_better), keep


def score_against(median: np.ndarray, f: np.ndarray, higher_is_better: np.ndarray) -> np.ndarray:
    """The score of each figure ``f`` against its ``median`` (arrays of one length): ``median / figure``, or
    ``figure / median`` where higher is better; a figure of 0 scores inf (0.0 where higher is better), a median of 0
    gives 1.0. :func:`score_blocks` scores with it against each block's own median; the job-wide view
    (:mod:`collector.jobwide.watch`) scores a node's figure with it against the median of every rank of the job."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        safe = np.where(median == 0, 1.0, median)
        return np.where(median == 0, 1.0, np.where(higher_is_better, f / safe,
                                                   np.where(f != 0, median / np.where(f == 0, 1.0, f), np.inf)))


def _f_sorted_at(f: np.ndarray, start: np.ndarray, size: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """Per block: the figure at ``offset`` within the block's sorted figures (``f`` sorted by block then value, each
    block's ``size`` figures from ``start`` on; blocks with no entry give 0.0)."""
    out = np.zeros(len(start))
    # not np.unique: its first call imports numpy.ma, on the loop's thread in a collector's first pass
    present = size > 0
    out[present] = f[start[present] + offset[present]]
    return out
