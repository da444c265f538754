"""``pdlife bench``'s one-process part, with a group of one (no collective:
the machine's wake-up cost out of the picture): the churn step against a step
where nothing changes, and with live spans against without; the gated step
(nothing moving) and the three fused gated queues against the hooks they ask.

Each repetition times the variants back to back, in an order that turns
with the repetition; a ratio is the median of the repetitions' own ratios
(and the ratio of the medians, beside it), a difference the difference of
the medians. The live spans are taken untimed after each step, as an
exporter's thread takes them (:class:`pdlife.spans.otel.LiveExport`); the
garbage they leave is collected when it is, inside a timed step or not.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from pdlife.bench.cases import bench_layout, churn_case, gated_queue, hooks_of, three_queues
from pdlife.bench.report import pair_ratios
from pdlife.spans.live import LiveSpans

__all__ = ["one_process"]

#: warm-up steps of each variant (sizes the steps' capacities and caches)
WARM = 100


def _ratio(top: list[float], bottom: list[float]) -> dict[str, float]:
    return {**pair_ratios(top, bottom), "of_medians": float(np.median(top) / np.median(bottom))}


def _size(n: int, reps: int) -> dict[str, Any]:
    from lifecycle.drive.collective import SingleRank

    coll = SingleRank(0)
    live = LiveSpans("decode", 0, "bench", lead=True)
    spans_step = churn_case(0, n, coll, split=False, spans=live)

    def churn_spans() -> float:
        took: float = spans_step()
        live.take()
        return took

    stepper, backend, meta, rooms = gated_queue(0, n, bench_layout())
    fused3, _, hooks3 = three_queues(0, n, bench_layout(), coll)
    variants: dict[str, Callable[[], object]] = {
        "quiet": churn_case(0, n, coll, moving=False),
        "churn": churn_case(0, n, coll, split=False),
        "churn_spans": churn_spans,
        "gated": lambda: stepper.step(coll),
        "hooks": hooks_of(backend, meta, rooms),
        "fused3": fused3,
        "hooks3": hooks3,
    }
    names = list(variants)
    for f in variants.values():
        for _ in range(WARM):
            f()
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        turn = rep % len(names)
        for name in names[turn:] + names[:turn]:
            f = variants[name]
            t0 = time.perf_counter()
            took = f()
            times[name].append(took if isinstance(took, float) else time.perf_counter() - t0)
    out: dict[str, Any] = {f"{k}_us": float(np.median(v) * 1e6) for k, v in times.items()}
    out["churn/quiet"] = _ratio(times["churn"], times["quiet"])
    out["churn_spans/churn"] = _ratio(times["churn_spans"], times["churn"])
    out["gated-hooks_us"] = out["gated_us"] - out["hooks_us"]
    out["fused3-hooks3_us"] = out["fused3_us"] - out["hooks3_us"]
    return out


def one_process(sizes: tuple[int, ...], reps: int) -> dict[str, Any]:
    """Per size: each variant's median (us), the ratios and the differences."""
    return {str(n): _size(n, reps) for n in sizes}
