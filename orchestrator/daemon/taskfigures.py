"""A task's figures, as its worker measured them (taskmeter.py), into its record and its
pool's histograms: the task table (tasktable.py) hands each FIGURES frame here. Loop thread
only, like the table.

A task's FIGURES frame comes just before its answer: the task is still its worker's, and
its end (the answer's) records the figures with it. A task that ended first (cancelled, or
timed out: its end is the loop's, its worker answers once it has stopped it) has its row
saved again with them (not across an upgrade: the next image does not have its record).

A task that ran more than once (``Retry``, ``retry_on``) has the figures of all its attempts
in its record: wall and CPU times added, the peaks the largest of them; its pool's
histograms count each attempt as its worker measured it.
"""

from __future__ import annotations

from typing import Protocol

from .. import taskwire as w
from .taskrecords import Doc, Task


class FigureMetrics(Protocol):
    """What of metrics.Metrics takes a task's figures."""

    def task_figures(self, pool: str, figures: w.Figures) -> None: ...


class RowStore(Protocol):
    """What of store.Store saves a task's row."""

    def save_task(self, rec: Doc) -> None: ...


def attach(task: Task, payload: bytes, metrics: FigureMetrics, store: RowStore | None) -> None:
    """The figures of a FIGURES ``payload`` on ``task`` (its worker's, the one that ran)."""
    figures = w.read_figures(payload)
    if figures is None:
        return  # not a payload of a worker of ours
    metrics.task_figures(task.pool.name, figures)
    before = task.figures
    if before is not None:  # an earlier attempt's
        figures = {"wall": before["wall"] + figures["wall"], "cpu": before["cpu"] + figures["cpu"],
                   "peak_rss": _larger(before["peak_rss"], figures["peak_rss"]),
                   "children_peak_rss": _larger(before["children_peak_rss"], figures["children_peak_rss"])}
    task.figures = figures
    # Ended first (its end is saved): saved again. A task without an end time is the
    # stand-in an upgrade's next image makes for one its worker still answers for: the
    # store's row is the real record, and is left as it is.
    if task.state.terminal and task.ended_at is not None and store is not None:
        store.save_task(task.record())


def _larger(a: int | None, b: int | None) -> int | None:
    """The larger of two peaks, either of which may be unknown."""
    return b if a is None else a if b is None else max(a, b)
