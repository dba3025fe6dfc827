"""The name rule: what a stat, metric or event name and a group may be, for every entry point and every sink.

One rule, checked where a name enters (``Stat``, ``log_event``, ``put_metric`` and ``@prof``,
``elastic.events.record``) and nowhere weakened later, so a name a rank accepts reaches jsonl, the stream topics,
``/metrics``, TensorBoard and OTLP exactly as given, and two different names never end up as one topic or tag:

- a **name** is a ``str`` of 1 to :data:`MAX_NAME_BYTES` (255) bytes in UTF-8 for a put metric or an event, 1 to
  :data:`MAX_STAT_NAME_BYTES` (80) for a stat, with no control character (U+0000-U+001F, U+007F-U+009F), line or
  paragraph separator (U+2028, U+2029), lone surrogate (U+D800-U+DFFF: not UTF-8 at all) or U+FFFD (the mark of
  text already lost in a decoding). Anything else is kept as given: spaces, dots, ``/``, ``:``, ``<locals>``,
  non-ASCII letters, emoji;
- a **group** follows the same rule with 1 to :data:`MAX_GROUP_BYTES` (48) bytes, and is one segment: no ``/``
  (the separator of ``stat/<group>/<name>``, ``metric/<group>/<name>`` and of TensorBoard tags) and no ``=``
  (``--handler GROUP=SPEC``); and it is none of ``*`` (every group, in ``--handler``), ``shmstat`` (the
  collector's own group, :data:`COLLECTOR_GROUP`) or ``rank<N>`` (:func:`rank_segment`: the first segment of
  per-rank TensorBoard tags).

A stat's name and group limits are the sizes of a stat descriptor's fields (:mod:`shmstat.shm.layout` takes them
from here), so nothing is ever truncated; 255 is OpenTelemetry's longest instrument name, and leaves a topic far
under :data:`shmstat.wire.MAX_TOPIC`. The characters refused are those no sink carries as themselves (JSON and
the exposition format escape them or break on them, a lone surrogate has no UTF-8). The rule uses explicit
code-point ranges, not Unicode categories, so every Python version agrees on it.

Why the mappings are one-to-one: a group holds no ``/``, so ``stat/<group>/<name>`` and ``metric/<group>/<name>``
split back at their second ``/``; a TensorBoard tag is ``<group>/<stat>.<aggregation>`` (merged) or
``rank<N>/<group>/<stat>.<aggregation>`` (per rank): its first segment is a group or a rank, never both, and the
aggregation (which holds no dot) is what follows the last dot. Prometheus and OTLP carry group and name as
label or attribute values, which take any text.

A **job id** (a segment's name, a socket's, the third frame of a node collector's messages, Prometheus' ``job``
label) is 1 to :data:`MAX_JOB_LEN` (64) ASCII letters, digits, ``-``, ``_`` or ``.``, not ``.`` or ``..`` and not
ending in ``.lock`` (:func:`is_job_id`; :func:`shmstat.shm.runtime.validate_job` raises with the rule).

A name that breaks the rule raises :class:`~shmstat.errors.ConfigError` at the call, naming the problem and the
rule's page (:data:`RULE_REFERENCE`). A name of the wrong type raises :class:`TypeError` (``put_metric`` and
``elastic.events.record`` first turn a non-``str`` name into its ``str``, as torchelastic passes any object
through).
"""

from __future__ import annotations

import re
from typing import Any, Final

from .errors import ConfigError, see_docs

__all__ = [
    "COLLECTOR_GROUP",
    "KNOWN",
    "MAX_GROUP_BYTES",
    "MAX_JOB_LEN",
    "MAX_NAME_BYTES",
    "MAX_STAT_NAME_BYTES",
    "RULE",
    "RULE_REFERENCE",
    "check_event_name",
    "check_group",
    "check_metric",
    "check_name",
    "group_problem",
    "is_job_id",
    "name_problem",
    "rank_segment",
]

MAX_NAME_BYTES: Final = 255
"""Longest name of a put metric or an event, in UTF-8 bytes."""

MAX_STAT_NAME_BYTES: Final = 80
"""Longest stat name in UTF-8 bytes: the size of a stat descriptor's name field."""

MAX_GROUP_BYTES: Final = 48
"""Longest group in UTF-8 bytes: the size of a stat descriptor's group field."""

MAX_JOB_LEN: Final = 64
"""Longest job id, in characters (ASCII: as many bytes)."""

COLLECTOR_GROUP: Final = "shmstat"
"""The collector's own group (rank CPU and RSS, its counters, straggler scores): no rank may use it."""

RULE: Final = (
    f"a name is 1 to {MAX_NAME_BYTES} bytes of UTF-8 (a stat's 1 to {MAX_STAT_NAME_BYTES}) with no control "
    f"character, line separator, lone surrogate or U+FFFD, and a group is 1 to {MAX_GROUP_BYTES} such bytes with "
    f"no '/' or '=' that is not '*', '{COLLECTOR_GROUP}' or rank<N>"
)
"""The rule in one clause (for documentation and help texts; a refusal names its page instead)."""

RULE_REFERENCE: Final = f"the name rule: {see_docs('reference/name-rule.md')}"
"""How every refusal of a name or group names the rule: its documentation page, not the whole rule (one sentence
stays short)."""

_REFUSED = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff\ufffd]")
_RANK_SEGMENT = re.compile("rank-?[0-9]+")
_JOB_RE = re.compile(rf"[A-Za-z0-9_.\-]{{1,{MAX_JOB_LEN}}}")


def is_job_id(text: object) -> bool:
    """Whether ``text`` is a ``str`` that follows the job id rule (see the module docstring)."""
    return (isinstance(text, str) and _JOB_RE.fullmatch(text) is not None and text not in (".", "..")
            and not text.endswith(".lock"))


def rank_segment(rank: int) -> str:
    """The first segment of rank ``rank``'s TensorBoard tags: ``rank<N>`` (which no group may be)."""
    return f"rank{rank}"


def name_problem(text: str, limit: int = MAX_NAME_BYTES) -> str | None:
    """What is wrong with ``text`` (a ``str``) as a name of at most ``limit`` bytes, or None if it follows the rule."""
    if not text:
        return "is empty"
    if text.isascii() and text.isprintable():  # U+0020..U+007E only: the common case, at C speed
        size = len(text)
    else:
        bad = _REFUSED.search(text)
        if bad is not None:
            ch = bad.group()
            if "\ud800" <= ch <= "\udfff":
                return f"holds a lone surrogate (U+{ord(ch):04X}), which is not UTF-8"
            if ch == "\ufffd":
                return "holds U+FFFD, the mark of text lost in a decoding"
            if ch in "\u2028\u2029":
                return f"holds the line or paragraph separator U+{ord(ch):04X}"
            return f"holds the control character U+{ord(ch):04X}"
        size = len(text.encode("utf-8"))
    if size > limit:
        return f"is {size} bytes of UTF-8: shorten it to at most {limit}"
    return None


def group_problem(text: str) -> str | None:
    """What is wrong with ``text`` (a ``str``) as a group, or None if it follows the rule."""
    problem = name_problem(text, MAX_GROUP_BYTES)
    if problem is not None:
        return problem
    if "/" in text:
        return "holds '/', the separator of stream topics and TensorBoard tags"
    if "=" in text:
        return "holds '=', which ends the group in --handler GROUP=SPEC"
    if text == "*":
        return "means every group in --handler GROUP=SPEC"
    if text == COLLECTOR_GROUP:
        return "is the collector's own group"
    if _RANK_SEGMENT.fullmatch(text):
        return "reads as rank<N>, the first segment of per-rank TensorBoard tags"
    return None


def _refuse(what: str, text: str, problem: str) -> ConfigError:
    shown = repr(text) if len(text) <= 32 else repr(text[:29]) + "..."
    return ConfigError(f"{what} {shown} {problem} ({RULE_REFERENCE})")


def _as_str(text: Any, what: str) -> str:
    if type(text) is str:
        return text
    if isinstance(text, str):
        return str.__str__(text)
    raise TypeError(f"{what} must be a str, not {type(text).__name__}")


def check_name(text: Any, what: str = "name", limit: int = MAX_NAME_BYTES) -> str:
    """``text`` as a plain ``str`` if it is a name of at most ``limit`` bytes by the rule (a stat's name: pass
    :data:`MAX_STAT_NAME_BYTES`); :class:`ConfigError` naming the rule if not, :class:`TypeError` if it is not a
    ``str``. ``what`` ("Stat name", ...) starts the message."""
    text = _as_str(text, what)
    problem = name_problem(text, limit)
    if problem is not None:
        raise _refuse(what, text, problem)
    return text


def check_group(text: Any, what: str = "group") -> str:
    """``text`` as a plain ``str`` if it is a group by the rule; :class:`ConfigError` naming the rule if not,
    :class:`TypeError` if it is not a ``str``."""
    text = _as_str(text, what)
    problem = group_problem(text)
    if problem is not None:
        raise _refuse(what, text, problem)
    return text


_KNOWN_NAMES: set[str] = set()
_KNOWN_GROUPS: set[str] = set()
_KNOWN_MAX = 4096  # distinct names remembered; past it a set starts over (memory stays bounded)


def _remember(known: set[str], text: Any) -> None:
    if type(text) is str:
        if len(known) >= _KNOWN_MAX:
            known.clear()
        known.add(text)


def check_event_name(name: Any) -> None:
    """Raise :class:`ConfigError` (naming the rule) unless ``name`` is an event name by the rule; ``log_event``
    (both backends) and ``elastic.events.record`` call it. A non-``str`` is checked as its ``str``."""
    if type(name) is str and name in _KNOWN_NAMES:
        return
    check_name(name if isinstance(name, str) else str(name), "event name")
    _remember(_KNOWN_NAMES, name)


def check_metric(name: Any, group: Any) -> None:
    """Raise :class:`ConfigError` (naming the rule) unless ``name`` and ``group`` are a metric name and a group by
    the rule (each checked as its ``str`` if it is not one). Names seen before are found in a set, so the common
    call costs two lookups; ``put_metric`` makes the same lookups inline (:data:`KNOWN`) and calls this on a miss."""
    if not (type(name) is str and name in _KNOWN_NAMES):
        check_name(name if isinstance(name, str) else str(name), "metric name")
        _remember(_KNOWN_NAMES, name)
    if not (type(group) is str and group in _KNOWN_GROUPS):
        check_group(group if isinstance(group, str) else str(group), "metric group")
        _remember(_KNOWN_GROUPS, group)


KNOWN: Final = (_KNOWN_NAMES, _KNOWN_GROUPS)
"""The names (of metrics and events) and the groups found valid so far, for the callers' inline lookups."""
