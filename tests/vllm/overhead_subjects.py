"""What bench_worker_overhead.py times on each TP worker: one iteration of each
path, in a steady state of ``n`` loads in flight.

- :class:`OursLoop`: decode's :class:`~vllm_connector.worker.WorkerSide` with its
  :class:`~vllm_connector.agreement.WorkerAgreement` over the TP group, on this
  library's connector: a decode rank and its prefill peer on the simulated
  network (:mod:`transport.testing.simnet`), whose handles are the connector's
  own. Prefill's sends are started a few each iteration, so each load stays in
  flight for ``life`` iterations; the timed call is ``finished()``.
- :class:`CountingLoop`: the count-based path for the same ``n`` and finish
  rate: a worker that keeps one transfer handle per load and polls each handle
  every iteration (as NIXL's worker does), its finished set carried in vLLM's
  own ``KVConnectorOutput`` and ``ModelRunnerOutput``, and vLLM's
  ``KVOutputAggregator`` over the outputs of both workers (timed on rank 0,
  where the engine runs it).

Both sides are deterministic: every worker of the group runs the same seeded
network and starts the same loads, as a TP group's workers are told the same
requests by the scheduler.
"""

from __future__ import annotations

import collections
import copy
import time
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray

from buffers import MetadataBuffers, MetadataLayout
from lifecycle import SingleRank, StepConfig, TorchCollective
from lifecycle.drive.collective import Pending
from transport.connector.config import ConnectorConfig
from transport.connector.handles import ConnectorReceiver, ConnectorSender
from transport.layout import kv_args_for
from transport.testing.simnet import SimNet, SimRank
from vllm_connector.agreement import Ended, WorkerAgreement
from vllm_connector.params import TransferParams
from vllm_connector.scheduler import Load, Meta, Send
from vllm_connector.worker import WorkerSide

__all__ = ["CountingLoop", "OursLoop", "SizedCollective"]

#: KV pages per request, and bytes per page (the bytes are real; their number is
#: not what is measured)
PAGES, PAGE_BYTES = 2, 64
#: virtual-clock ticks of the simulated network between two iterations: enough
#: for the sends started this iteration to land, most of them
TICKS = 4
_LAYOUT = MetadataLayout(hidden_size=32, hidden_dtype=torch.float32, max_top_logprobs=16)


class SizedCollective(TorchCollective):
    """The TP group's collective, noting what each reduce of the step sends and
    how long it took from its launch until it landed (a started reduce's time
    includes the step's work done while it is in flight)."""

    def __init__(self, group: Any = None) -> None:
        super().__init__(group)
        self.reduces = 0
        self._sent: tuple[Any, int] = (np.dtype(np.uint8), 0)
        self.seconds = 0.0

    @property
    def sent(self) -> tuple[str, int]:
        """The dtype's name and the size of the last reduce's buffer."""
        return self._sent[0].name, self._sent[1]

    def _saw(self, buf: NDArray[Any]) -> None:
        # (inside the timed call: a dtype's name is computed by a Python property)
        self.reduces += 1
        self._sent = (buf.dtype, buf.size)

    def all_reduce_min(self, buf: NDArray[Any]) -> None:
        self._saw(buf)
        t = time.perf_counter()
        try:
            super().all_reduce_min(buf)
        finally:
            self.seconds += time.perf_counter() - t

    def start_all_reduce_min(self, buf: NDArray[Any]) -> Pending:
        self._saw(buf)
        return _Timed(super().start_all_reduce_min(buf), self, time.perf_counter())


class _Timed:
    """A started reduce whose wait adds the time since its launch to the collective's."""

    def __init__(self, work: Pending, owner: SizedCollective, began: float) -> None:
        self.work, self.owner, self.began = work, owner, began

    def then(self, fn: Any) -> None:
        work: Any = self.work  # (a torch reduce offers then(); Pending need not)
        work.then(fn)

    def wait(self) -> None:
        try:
            self.work.wait()
        finally:
            self.owner.seconds += time.perf_counter() - self.began


class _Spent:
    """Seconds spent in a kind of call, summed."""

    def __init__(self) -> None:
        self.seconds = 0.0


class _Spending:
    """Seconds the decode handles spent handing pages over and releasing."""

    def __init__(self) -> None:
        self.handoff = self.release = 0.0


class _TimedReceiver(ConnectorReceiver):
    """The connector's decode handle; the time its page hand-off (telling prefill
    where to write) takes is summed apart: the transfer's own work, which
    ``finished()`` calls (its release is timed by :func:`_time_release`)."""

    def __init__(self, manager: SimRank, room: int, epoch: int, spent: _Spending) -> None:
        super().__init__(manager, room, epoch)
        self._spent = spent

    def send_metadata(self, *args: Any, **kwargs: Any) -> None:
        t = time.perf_counter()
        try:
            super().send_metadata(*args, **kwargs)
        finally:
            self._spent.handoff += time.perf_counter() - t


def _time_release(rank: SimRank, spent: _Spending) -> None:
    """The decode connector's batch calls that release drained handles
    (:func:`~transport.connector.handles.clear_drained`), timed into ``spent.release``."""
    for name in ("drained_many", "clear_many"):
        call = getattr(rank, name)

        def timed(reqs: Any, call: Any = call) -> Any:
            t = time.perf_counter()
            try:
                return call(reqs)
            finally:
                spent.release += time.perf_counter() - t

        setattr(rank, name, timed)


class _DecodeHandles:
    """Decode's connector, handing out timed receivers."""

    def __init__(self, rank: SimRank, spent: _Spending) -> None:
        self.rank, self.spent = rank, spent

    def sender(self, room: int, epoch: int = 0) -> ConnectorSender:
        return self.rank.sender(room, epoch)

    def receiver(self, room: int, epoch: int = 0) -> ConnectorReceiver:
        return _TimedReceiver(self.rank, room, epoch, self.spent)


class _TimedAgreement(WorkerAgreement):
    """The worker agreement; the time its step (with the reduce) takes is summed."""

    def __init__(self, *args: Any, spent: _Spent, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._spent = spent

    def step(self) -> Ended:
        t = time.perf_counter()
        try:
            return super().step()
        finally:
            self._spent.seconds += time.perf_counter() - t


class OursLoop:
    """``n`` loads in flight on decode's worker side; ``n // life`` end each iteration."""

    def __init__(self, n: int, life: int, rank: int, collective: SizedCollective) -> None:
        self.n, self.k = n, max(1, n // life)
        self.collective = collective
        self.slots = n + 4 * self.k + 8  # pages are reused round-robin
        self.net = SimNet(seed=n)  # the same on every worker of the group
        ranks: dict[str, SimRank] = {}
        #: the buffers the network writes to by address: held as long as the loop
        self.buffers: list[tuple[torch.Tensor, MetadataBuffers]] = []
        for role in ("prefill", "decode"):
            kv = torch.zeros((self.slots * PAGES, PAGE_BYTES), dtype=torch.uint8)
            meta = MetadataBuffers(4, _LAYOUT)
            self.buffers.append((kv, meta))
            cfg = ConnectorConfig(role=role, tp_rank=0, store_port=1)  # (no store: simulated)
            ranks[role] = self.net.add(kv_args_for([kv], meta.buf_infos(), 0), cfg)
        self.handles_spent, self.step_spent = _Spending(), _Spent()
        _time_release(ranks["decode"], self.handles_spent)
        self.decode = WorkerSide(
            _DecodeHandles(ranks["decode"], self.handles_spent),
            _TimedAgreement(
                rank, ranks["decode"].core, collective, StepConfig(), spent=self.step_spent
            ),
        )
        prefill, self.decode_rank = ranks["prefill"], ranks["decode"]
        self.prefill = WorkerSide(prefill, WorkerAgreement(0, prefill.core, SingleRank()))
        self.seq = 0
        self.unserved: collections.deque[int] = collections.deque()  # loads prefill has not begun
        self.to_start = n
        self.last: dict[str, float] = {}
        self.started: dict[str, float] = {}

    def _blocks(self, i: int) -> tuple[tuple[int, ...], ...]:
        s = (i % self.slots) * PAGES
        return (tuple(range(s, s + PAGES)),)

    def prepare(self) -> None:
        """Before the timed call: the scheduler's new loads (as many as ended last
        time) started by decode's ``start_load_kv``, timed apart (``started``);
        then, untimed, prefill begins the oldest ``k`` sends, the network runs,
        prefill reports."""
        loads = {}
        for _ in range(self.to_start):
            i, self.seq = self.seq, self.seq + 1
            remote = TransferParams(1 + i, 0, "prefill", f"p{i}", "127.0.0.1", 1, 1, ())
            loads[f"d{i}"] = Load(1 + i, 0, self._blocks(i), remote)
            # decode's pages are this load's now: a write of another lands as a violation
            self.net.fence.assign(self.decode_rank, self._blocks(i)[0], 1 + i, 0)
            self.unserved.append(i)
        # timed apart: decode's start_load_kv (the new loads begun, and the page
        # lists of the loads the last get_finished found ready)
        self.handles_spent.handoff = 0.0
        t = time.perf_counter()
        self.decode.start(Meta(loads=loads))
        self.started = {
            "start": time.perf_counter() - t,
            "start_handoff": self.handles_spent.handoff,
        }
        sends = {}
        for _ in range(min(self.k, len(self.unserved))):
            i = self.unserved.popleft()
            sends[f"p{i}"] = Send(1 + i, 0, self._blocks(i))
        self.prefill.start(Meta(sends=sends))
        for _ in range(TICKS):
            self.net.step()
        self.prefill.finished()
        # the network's records of what landed and was handled (for tests'
        # checks) would grow with every iteration, and each write scans them
        self.net.flights = [f for f in self.net.flights if not f.done]
        self.net.handled.clear()

    def iterate(self) -> float:
        """Timed: one ``finished()`` of decode's worker side (seconds)."""
        self.handles_spent.handoff = self.handles_spent.release = 0.0
        self.step_spent.seconds = 0.0
        reduces, live = self.collective.reduces, len(self.decode.live)
        self.collective.seconds = 0.0
        t = time.perf_counter()
        report = self.decode.finished()
        took = time.perf_counter() - t
        self.to_start = len(report.recving)
        self.last = {
            "handoff": self.handles_spent.handoff,
            "release": self.handles_spent.release,
            "step": self.step_spent.seconds,
            "reduce": self.collective.seconds,
            "finished": float(len(report.recving)),
            "reduces": float(self.collective.reduces - reduces),
            "in_flight": float(live),
            "violations": float(len(self.net.fence.violations)),
            **self.started,
        }
        return took


class _Transfers:
    """A transfer engine's handles, as a NIXL-like worker sees them: each is
    polled by handle ("PROC" until its bytes landed, then "DONE")."""

    def __init__(self) -> None:
        self.state: dict[int, str] = {}
        self.next = 0

    def transfer(self) -> int:
        h, self.next = self.next, self.next + 1
        self.state[h] = "PROC"
        return h

    def check_xfer_state(self, handle: int) -> str:
        return self.state[handle]

    def release_xfer_handle(self, handle: int) -> None:
        del self.state[handle]


class CountingLoop:
    """The count-based path for ``n`` loads in flight, ``n // life`` ending each
    iteration. On the last worker of the group one load in four ends an
    iteration later than on the others (workers do not finish in step), so
    the aggregator holds counts across iterations, as it does in service."""

    def __init__(self, n: int, life: int, rank: int, world: int) -> None:
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        self.output_cls, self.runner_cls = KVConnectorOutput, ModelRunnerOutput
        self.n, self.life, self.k = n, life, max(1, n // life)
        self.late = rank == world - 1 and world > 1
        self.engine = _Transfers()
        self.recving: dict[str, list[int]] = {}
        self.due: dict[int, list[int]] = collections.defaultdict(list)
        self.it = self.seq = 0
        self.aggregator = KVOutputAggregator(world) if rank == 0 else None
        self.started = 0.0
        for _ in range(life):  # the steady state: loads started over the last `life` iterations
            self.prepare()

    def prepare(self) -> None:
        """Before the timed call: the scheduler's ``k`` new loads start (as in
        ``start_load_kv``), timed apart (``started``); the loads due now land."""
        t = time.perf_counter()
        for _ in range(self.k):
            i, self.seq = self.seq, self.seq + 1
            h = self.engine.transfer()
            self.recving[f"d{i}"] = [h]
            self.due[self.it + self.life + (1 if self.late and i % 4 == 0 else 0)].append(h)
        #: the time its start_load_kv took (each new load's transfer begun)
        self.started = time.perf_counter() - t
        for h in self.due.pop(self.it, ()):
            self.engine.state[h] = "DONE"
        self.it += 1

    def report(self) -> Any:
        """Timed: this worker's report, as vLLM's worker hands it to the engine: the
        loads whose every handle is done, in a ``ModelRunnerOutput``."""
        done: set[str] = set()
        for rid, handles in list(self.recving.items()):
            left = [h for h in handles if self._pending(h)]
            if left:
                self.recving[rid] = left
            else:
                done.add(rid)
                del self.recving[rid]
        out = self.output_cls(
            finished_sending=None,
            finished_recving=done or None,
            failed_recving=set(),
            invalid_block_ids=set(),
        )
        return self.runner_cls.with_kv_conn_output_only(out)

    def _pending(self, handle: int) -> bool:
        if self.engine.check_xfer_state(handle) == "DONE":
            self.engine.release_xfer_handle(handle)
            return False
        return True

    def aggregate(self, outputs: list[Any]) -> tuple[float, int]:
        """Timed, on rank 0: vLLM's aggregator over every worker's output (seconds,
        and how many loads it reported finished)."""
        assert self.aggregator is not None
        # (vLLM's empty output is one shared object, which aggregate() writes into)
        outputs = [copy.copy(outputs[0]), *outputs[1:]]
        t = time.perf_counter()
        out = self.aggregator.aggregate(outputs, output_rank=0)
        took = time.perf_counter() - t
        kv = out.kv_connector_output if out is not None else None
        return took, len(kv.finished_recving or ()) if kv is not None else 0
