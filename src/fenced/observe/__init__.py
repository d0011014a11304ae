"""Operations: ownership timelines, status figures and Prometheus metrics (docs/operations.md).

* :mod:`fenced.observe.timeline` — merge coordinator and store records into ownership
  intervals, gaps, rejected writes and per-resource figures (pure, plus readers).
* :mod:`fenced.observe.metrics` — Prometheus collectors (needs the ``metrics`` extra:
  ``pip install 'fenced[metrics]'``); imported on demand, not by this package.

This layer sits above :mod:`fenced.coordinator` and :mod:`fenced.fence` and below the command
line; it only reads.
"""

from fenced.core._records import Record, RecordKind
from fenced.observe.timeline import (
    Event,
    Figures,
    Gap,
    Interval,
    Rejection,
    Timeline,
    build_timeline,
    read_timeline,
)

__all__ = [
    "Event",
    "Figures",
    "Gap",
    "Interval",
    "Record",
    "RecordKind",
    "Rejection",
    "Timeline",
    "build_timeline",
    "read_timeline",
]
