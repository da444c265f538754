"""Fault injection hooks for the step (testing).

:class:`ProbabilisticFaults` is the field's failure knob done properly: each
rank draws on its own (MIN still makes the ranks agree), but from a seeded
generator keyed by (seed, rank), so the same seed reproduces the same faults.
:func:`from_env` keeps the field's environment variables working.
Targeted, replayable plans live in :mod:`pdlife.cluster.plan`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np
from numpy.typing import NDArray

from lifecycle.errors import FaultPlanError
from lifecycle.protocols import StepContext
from lifecycle.validate import is_integer

__all__ = ["ProbabilisticFaults", "from_env", "ENV_VARS"]

#: read in this order; the first one set wins
ENV_VARS = ("SGLANG_TEST_DISAGG_FAILURE_PROB", "DISAGGREGATION_TEST_FAILURE_PROB")
SEED_VAR = "PDLIFE_FAULT_SEED"


class ProbabilisticFaults:
    """Each non-terminal request fails on this rank with probability ``prob`` per step."""

    def __init__(self, prob: float, seed: int = 0, rank: int = 0) -> None:
        number = isinstance(prob, (int, float, np.integer, np.floating)) and not isinstance(
            prob, (bool, np.bool_)
        )
        if not number or not 0.0 <= prob <= 1.0:
            raise FaultPlanError("prob", f"must be a number within [0, 1], got {prob!r}")
        for name, v in (("seed", seed), ("rank", rank)):
            if not is_integer(v) or v < 0:
                raise FaultPlanError(name, f"must be a non-negative integer, got {v!r}")
        self.prob = prob
        self.seed = seed
        self.rank = rank
        self._rng = np.random.default_rng([seed, rank])

    def inject(self, ctx: StepContext) -> NDArray[np.bool_]:
        if self.prob == 0.0 or ctx.rooms.size == 0:
            return np.zeros(ctx.rooms.size, dtype=bool)
        hit: NDArray[np.bool_] = self._rng.random(ctx.rooms.size) < self.prob
        return hit


def from_env(rank: int = 0, env: Mapping[str, str] | None = None) -> ProbabilisticFaults | None:
    """The field's failure probability variables as a seeded hook (None if unset or 0).

    The seed comes from ``PDLIFE_FAULT_SEED`` (default 0), so runs that used
    to be unrepeatable become repeatable.
    """
    env = os.environ if env is None else env
    for var in ENV_VARS:
        raw = env.get(var)
        if raw is None or raw == "":
            continue
        try:
            prob = float(raw)
        except ValueError:
            raise FaultPlanError(var, f"must be a probability, got {raw!r}") from None
        if not 0.0 <= prob <= 1.0:  # (nan too)
            raise FaultPlanError(var, f"must be a probability within [0, 1], got {raw!r}")
        if prob == 0.0:
            return None
        seed_raw = env.get(SEED_VAR, "0")
        try:
            seed = int(seed_raw)
        except ValueError:
            raise FaultPlanError(SEED_VAR, f"must be an integer, got {seed_raw!r}") from None
        return ProbabilisticFaults(prob, seed=seed, rank=rank)
    return None
