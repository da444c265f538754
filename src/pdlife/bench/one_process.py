"""``pdlife bench``'s one-process part: the churn step against a step where
nothing changes, and with live spans against without, in one process with a
group of one (no collective: the machine's wake-up cost out of the picture).

Each repetition times the three variants back to back, in an order that
turns with the repetition; a ratio is the median of the repetitions' own
ratios (and the ratio of the medians, beside it). The live spans are taken
untimed after each step, as an exporter's thread takes them
(:class:`pdlife.spans.otel.LiveExport`); the garbage they leave is collected
when it is, inside a timed step or not.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pdlife.bench.cases import churn_case
from pdlife.spans.live import LiveSpans

__all__ = ["one_process"]

#: warm-up steps of each variant (sizes the steps' capacities and caches)
WARM = 100


def _ratio(top: list[float], bottom: list[float]) -> dict[str, float]:
    each = np.asarray(top) / np.asarray(bottom)
    return {
        "median": float(np.median(each)),
        "p25": float(np.percentile(each, 25)),
        "p75": float(np.percentile(each, 75)),
        "of_medians": float(np.median(top) / np.median(bottom)),
    }


def _size(n: int, reps: int) -> dict[str, Any]:
    from lifecycle.drive.collective import SingleRank

    coll = SingleRank(0)
    live = LiveSpans("decode", 0, "bench", lead=True)
    spans_step = churn_case(0, n, coll, split=False, spans=live)

    def churn_spans() -> float:
        took: float = spans_step()
        live.take()
        return took

    variants = {
        "quiet": churn_case(0, n, coll, moving=False),
        "churn": churn_case(0, n, coll, split=False),
        "churn_spans": churn_spans,
    }
    names = list(variants)
    for f in variants.values():
        for _ in range(WARM):
            f()
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        turn = rep % len(names)
        for name in names[turn:] + names[:turn]:
            times[name].append(variants[name]())
    out: dict[str, Any] = {f"{k}_us": float(np.median(v) * 1e6) for k, v in times.items()}
    out["churn/quiet"] = _ratio(times["churn"], times["quiet"])
    out["churn_spans/churn"] = _ratio(times["churn_spans"], times["churn"])
    return out


def one_process(sizes: tuple[int, ...], reps: int) -> dict[str, Any]:
    """Per size: the three variants' medians (us) and their ratios."""
    return {str(n): _size(n, reps) for n in sizes}
