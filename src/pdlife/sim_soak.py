"""Soak admission and RSS samples, slot checks, and naming a dead rank."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

from lifecycle.errors import RankFailure
from pdlife.sim_hooks import (
    rss_mb,
)

if TYPE_CHECKING:
    from pdlife.sim import RankRun


def _paces(run: RankRun) -> bool:
    """This rank's group sets the soak's pace: prefill (DP group 0). Decode and
    the other prefill DP groups follow it, through the store."""
    return run.side == "prefill" and run.place.dp_rank == 0


def soak_allowed(run: RankRun) -> int:
    """How many requests this group may have admitted by now in a soak: prefill
    (group 0) admits on schedule; the others only what it has (agreed in the
    digest), so that every group stops at the same request."""
    if _paces(run):
        return run.step_no * run.work.arrival_rate
    return run._decode_allowed


def soak_words(run: RankRun) -> tuple[int, int]:
    """What the group's first rank says for it in the digest."""
    leader = run.place.tp_rank == 0
    if _paces(run):
        up = time.monotonic() - run._start >= (run.cfg.soak or 0.0)
        return int(up and leader), 0
    if not leader:
        return 0, -1

    def get(key: str, default: int) -> int:
        try:
            return int(run.store.get(key).decode()) if run.store.check([key]) else default
        except Exception:
            return default

    return get("soak/admitted", 0), get("soak/limit", -1)


def soak_agreed(run: RankRun, a: int, b: int) -> None:
    if _paces(run):
        if run.soak_limit is None and a:
            run.soak_limit = run.admitted
            if run.rank == 0:
                run.store.set("soak/limit", str(run.soak_limit))
        if run.rank == 0:
            run.store.set("soak/admitted", str(run.admitted))
    else:
        run._decode_allowed = a
        if b >= 0 and run.admitted >= b:
            run.soak_limit = b


def sample_rss(run: RankRun, force: bool = False) -> None:
    now = time.monotonic()
    if force or now - run._last_rss >= run.cfg.rss_every:
        run._last_rss = now
        # the Python heap beside the RSS: growth in one but not the other is native
        blocks = sys.getallocatedblocks()
        run.rss.add((round(now - run._start, 2), run.finished, round(rss_mb(), 2), blocks))


def check_slots(run: RankRun) -> None:
    a = run.alloc
    if a.in_use + a.available + a.quarantined != a.size:
        run.violations.append(f"step {run.step_no}: slot accounting broken")
    if len(run._slot) != a.in_use:
        run.violations.append(
            f"step {run.step_no}: {a.in_use} slots in use but {len(run._slot)} requests hold one"
        )


def who_died(run: RankRun, e: RankFailure) -> str:
    """Name the ranks of this side whose heartbeat stopped (read twice, a beat apart)."""
    side = run.place.group

    def beats() -> dict[int, int]:
        out = {}
        for r in side:
            try:
                out[r] = int(run.store.get(f"hb/{r}").decode())
            except Exception:
                out[r] = -1
        return out

    first = beats()
    time.sleep(1.0)
    second = beats()
    dead = sorted(
        r for r in side if r != run.rank and second[r] == first[r] and second[r] < run.step_no
    )
    cause = str(e.__cause__ or e).splitlines()[0][:160]
    return (
        f"rank {run.rank} ({run.side}) at step {run.step_no}: the collective failed; "
        f"dead rank(s) {dead or 'unknown'} (last heartbeat step per rank {second}); "
        f"gloo said: {cause}"
    )
