"""Real bytes for byte-moving backends: page patterns, first-token rows, checks."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from pdlife.sim_config import PAGE_BYTES

if TYPE_CHECKING:
    from pdlife.sim import RankRun


def pattern(run: RankRun, room: int, n: int, layer: int, tp: int) -> NDArray[np.uint8]:
    """What prefill TP rank ``tp`` writes into page ``j`` of ``room`` (deterministic)."""
    seed = np.uint64((room * 1_000_003 + layer * 7919 + tp * 104729) & 0xFFFFFFFFFFFFFFFF)
    words = PAGE_BYTES // 8
    grid = np.arange(n * words, dtype=np.uint64).reshape(n, words)
    with np.errstate(over="ignore"):
        vals = (grid + seed) * np.uint64(0x9E3779B97F4A7C15)
    out: NDArray[np.uint8] = vals.view(np.uint8).reshape(n, PAGE_BYTES)
    return out


def fill_pages(run: RankRun, room: int, pages: NDArray[np.int64]) -> None:
    for layer, t in enumerate(run.kv):
        t.numpy()[pages] = pattern(run, room, pages.size, layer, run.side_rank)


def write_first_token(run: RankRun, room: int, slot: int) -> None:
    """The prefill's metadata row (sent to decode): the plan may drop or corrupt it."""
    fault = run.faults_for_decode.metadata_fault(room)
    if fault == "drop_metadata":
        run.meta.clear_room(slot)
        run.meta.tensors["output_ids"][slot, 0] = room % 50000
        return
    owner = room if fault is None else (room ^ 0x5A5A5A5A) or 1
    run.meta.write(slot, owner, {"output_ids": [room % 50000]})


def verify_pages(run: RankRun, room: int) -> None:
    pages = run.pages_of[room]
    for layer, t in enumerate(run.kv):
        got = t.numpy()[pages]
        want = pattern(run, room, pages.size, layer, run.side_rank)
        if not np.array_equal(got, want):
            bad = int(np.flatnonzero((got != want).any(axis=1))[0])
            run.violations.append(
                f"step {run.step_no}: room {room} layer {layer} page {bad}: "
                "decode bytes differ from what prefill wrote"
            )
            return
        run.bytes_checked += got.nbytes


def simulate_remote_write(run: RankRun, room: int, slot: int) -> None:
    """What prefill's metadata write would land (the fake backend moves no bytes)."""
    fault = run.faults.metadata_fault(room)
    if fault == "drop_metadata":
        return
    owner = room if fault is None else (room ^ 0x5A5A5A5A) or 1
    run.meta.write(slot, owner, {"output_ids": [room % 50000]})
