"""``pdlife bench``'s table costs: adding and removing 10,000 requests (at
once and one by one), and the memory a live request takes."""

from __future__ import annotations

import time
import tracemalloc

import numpy as np

__all__ = ["table_costs"]


def table_costs() -> dict[str, float]:
    from lifecycle import RequestTable

    rooms = np.arange(1, 10_001, dtype=np.uint64)
    add, rem = [], []
    for _ in range(7):
        t = RequestTable(capacity=64)
        t0 = time.perf_counter()
        t.extend(rooms)
        add.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        t.remove_many(rooms)
        t.order()
        rem.append(time.perf_counter() - t0)
    one = RequestTable(capacity=64)
    t0 = time.perf_counter()
    for r in range(1, 10_001):
        one.add(r)
    add_single = time.perf_counter() - t0
    tracemalloc.start()
    t = RequestTable(capacity=1)
    before = tracemalloc.get_traced_memory()[0]
    t.extend(np.arange(1, 16_385, dtype=np.uint64))
    t.order()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return {
        "add_10k_ms": float(np.median(add) * 1e3),
        "remove_10k_ms": float(np.median(rem) * 1e3),
        "add_10k_one_by_one_ms": add_single * 1e3,
        "bytes_per_live_request": (after - before) / 16_384,
    }
