"""Stand-ins that let SGLang 0.5.23's own PD queues run on CPU gloo ranks.

The queue classes and the scheduler mixin methods are SGLang's
(``DecodePreallocQueue``, ``DecodeTransferQueue``,
``SchedulerDisaggregationDecodeMixin.process_decode_queue``,
``PrefillBootstrapQueue``, ``SchedulerDisaggregationPrefillMixin``), and so are
the request (``Req``), the decode request-to-token pool and the token
allocator. Stood in, with exactly what those code paths touch:

- the transfer connection: :class:`Receiver` / :class:`Sender` (returned by
  ``get_kv_class``) and :class:`KVManager`, whose poll values follow a
  :class:`Spec` scripted per rank and per iteration; :meth:`Rig.transport`
  lands each request's metadata row (its room and first token) when the
  script says so;
- the staging handler (:class:`StagingHandler`), scripted the same way;
- the scheduler (:class:`DecodeScheduler`, :class:`PrefillScheduler`: SGLang's
  mixins with the attributes their methods read), the tree cache, the output
  streamer, and the runtime context (``get_parallel`` / ``get_disagg``);
- the prefill forward pass: a bootstrapped request gets a KV row and sends its
  KV, then enters the inflight queue, as ``process_batch_result_disagg_prefill``
  does.

Each scenario runs twice in a rank: with SGLang's utils functions, then with
ours patched into the modules that import them (:func:`our_names`). After
every iteration a record of what each queue holds, popped and aborted is kept;
the tests compare the records.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from array import array
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

HOST = "10.0.0.1"  # a real (non-fake) bootstrap host: the metadata gate reads the row
PORT = 8998
META_ROWS = 8
TOKENS = 1024

#: a value for both ranks, or (rank 0's, rank 1's); None: never
Per = Any


def at(value: Per, rank: int) -> Any:
    return value[rank] if isinstance(value, tuple) else value


def reached(when: int | None, now: int) -> bool:
    return when is not None and now >= when


@dataclasses.dataclass
class Spec:
    """One request's script. Iterations are the loop's (0, 1, ...); a tuple is per rank."""

    room: int
    arrive: int = 0
    hs: Per = 1  # handshake done: the peer is known (WaitingForInput)
    done: Per = 3  # KV written (Success), once the destination was sent
    land: Per = "done"  # decode: the metadata row lands (default: with the KV)
    fail: Per = None  # the connection reports Failed from here
    abort: Per = None  # an AbortReq for it is handled at this iteration (per rank)
    pp_abort: bool = False  # the AbortReq also marks it aborted (the pp_size > 1 branch)
    reject: bool = False  # arrives already aborted (set_finish_with_abort at intake)
    staged: bool = False  # decode: the receiver requires staging
    scatter: Per = 0  # decode: the staging scatter is done from here
    stage_fail: Per = None  # decode: the staging handler reports a timeout from here
    wrong_room: Per = None  # decode: the row lands carrying this room instead
    raise_at: Per = None  # the connection's poll raises from here
    drain: Per = (1, 2)  # decode: iterations from the abort notice to prefill's drain ack

    def get(self, name: str, rank: int) -> Any:
        v = at(getattr(self, name), rank)
        if v == "done":
            return at(self.done, rank)
        return v


# -- the runtime context ----------------------------------------------------------------


def disagg_config() -> Any:
    return types.SimpleNamespace(
        disaggregation_decode_host_receive_threshold=1.0,
        disaggregation_decode_enable_radix_cache=False,
        disaggregation_decode_allocation_policy="early",
        disaggregation_decode_enable_offload_kvcache=False,
        disaggregation_decode_polling_interval=1,
        disaggregation_enable_kv_checksum=False,
        disaggregation_transfer_backend="mooncake",
        optimistic_prefill_attempts=0,
    )


def memory_config() -> Any:
    return types.SimpleNamespace(disable_radix_cache=True)


def parallel_context(rank: int, tp_group: Any) -> Any:
    return types.SimpleNamespace(
        tp_rank=rank,
        attn_tp_rank=rank,
        pp_rank=0,
        pp_size=1,
        attn_tp_group=types.SimpleNamespace(cpu_group=tp_group),
    )


@contextlib.contextmanager
def patched(pairs: list[tuple[Any, str, Any]]) -> Iterator[None]:
    """Set ``module.name = value`` for each pair; put the old values back after."""
    old = [(m, n, getattr(m, n)) for m, n, _ in pairs]
    try:
        for m, n, v in pairs:
            setattr(m, n, v)
        yield
    finally:
        for m, n, v in reversed(old):
            setattr(m, n, v)


def our_names(module: Any) -> list[str]:
    """Every name ``module`` imports from SGLang's utils that ``field.utils`` provides."""
    import sglang.srt.disaggregation.utils as sgl

    import field.utils as ours

    return sorted(
        n
        for n in ours.__all__
        if hasattr(sgl, n) and hasattr(module, n) and getattr(module, n) is getattr(sgl, n)
    )


# -- the transfer connection ----------------------------------------------------------


class Rig:
    """One run of one scenario on one rank: the clock, the scripts and what happened."""

    def __init__(self, rank: int, specs: list[Spec]) -> None:
        self.rank = rank
        self.now = 0
        self.specs = {s.room: s for s in specs}
        self.links: dict[int, Any] = {}  # room -> its receiver or sender
        self.reqs: dict[int, Any] = {}  # room -> Req
        self.streamed: list[int] = []
        self.released: list[int] = []
        self.retired: list[int] = []
        self.finished: list[tuple[int, str]] = []
        self.kv_manager = KVManager(self)
        self.buffers: Any = None

    def spec(self, room: int, name: str) -> Any:
        return self.specs[room].get(name, self.rank)

    def transport(self) -> None:
        """Land the metadata rows whose time has come (decode side)."""
        for room, link in self.links.items():
            idx = getattr(link, "metadata_index", None)
            if idx is None or link.landed or link.cleared:
                continue
            if reached(self.spec(room, "land"), self.now):
                wrong = self.spec(room, "wrong_room")
                self.buffers.output_ids[idx, 0] = room % 1000 + 7
                self.buffers.cached_tokens[idx, 0] = 0
                self.buffers.bootstrap_room[idx, 0] = room if wrong is None else wrong
                link.landed = True


class KVManager:
    """The connection's manager, as the queues and receivers read it."""

    enable_deferred_decode_kv_release = True
    is_dummy_cp_rank = False

    def __init__(self, rig: Rig) -> None:
        self.rig = rig
        self.kv_args = types.SimpleNamespace(state_types=[])
        self.prefill_info_table = {
            f"{HOST}:{PORT}": types.SimpleNamespace(dp_size=1, follow_bootstrap_room=False)
        }
        self.sent: list[tuple[int, int, int]] = []  # (room, metadata row, pages)

    def is_abort_release_safe(self, room: int, required_acks: int) -> bool:
        link = self.rig.links[room]
        return link.notified_at is not None and reached(
            link.notified_at + self.rig.spec(room, "drain"), self.rig.now
        )

    def clear_deferred_abort_state(self, room: int) -> None:
        pass


class _Link:
    """What receivers and senders share: the scripted poll."""

    def __init__(self, mgr: KVManager, bootstrap_room: int) -> None:
        from sglang.srt.disaggregation.base import KVPoll

        self.kv_mgr = mgr
        self.rig = mgr.rig
        self.bootstrap_room = bootstrap_room
        self.KVPoll = KVPoll
        self.metadata_index: int | None = None
        self.inited = False
        self.sent = False
        self.aborted = False
        self.cleared = False
        self.landed = False
        self.abort_notified = False
        self.notified_at: int | None = None
        self.bootstrap_infos = [None]
        self.conclude_state = None
        self.rig.links[bootstrap_room] = self

    def _is(self, name: str) -> bool:
        return reached(self.rig.spec(self.bootstrap_room, name), self.rig.now)

    def poll(self) -> int:
        kv = self.KVPoll
        if self._is("raise_at"):
            raise RuntimeError(f"room {self.bootstrap_room}: the connection's poll raised")
        if self.aborted or self._is("fail"):
            return kv.Failed
        if not self.inited or not self._is("hs"):
            return kv.Bootstrapping
        if not self.sent:
            return kv.WaitingForInput
        return kv.Success if self._is("done") else kv.Transferring

    def failure_exception(self) -> None:
        raise RuntimeError(f"room {self.bootstrap_room}: transfer failed (stand-in)")

    def abort(self) -> None:
        self.aborted = True
        self.ensure_abort_notified()

    def ensure_abort_notified(self, force_arm: bool = False) -> None:
        if not self.abort_notified:
            self.abort_notified = True
            self.notified_at = self.rig.now

    def clear(self) -> None:
        self.cleared = True


class Receiver(_Link):
    """Decode side: Bootstrapping until ``init`` and the handshake, WaitingForInput
    until ``send_metadata``, Transferring until the KV is written, then Success."""

    supports_host_destination = False

    def __init__(
        self, mgr: KVManager, bootstrap_addr: str, bootstrap_room: int, prefill_dp_rank: Any = None
    ) -> None:
        super().__init__(mgr, bootstrap_room)
        self.require_staging = bool(self.rig.specs[bootstrap_room].staged)

    def init(self, prefill_dp_rank: int) -> None:
        self.inited = True

    def send_metadata(
        self, kv_indices: Any, aux_index: Any = None, state_indices: Any = None, **kw: Any
    ) -> None:
        self.metadata_index = int(aux_index)
        self.sent = True
        self.kv_mgr.sent.append((self.bootstrap_room, int(aux_index), len(kv_indices)))


class Sender(_Link):
    """Prefill side: Bootstrapping until the decode peer is known, WaitingForInput
    until the KV is sent, Transferring until decode has it, then Success."""

    def __init__(
        self,
        mgr: KVManager,
        bootstrap_addr: str,
        bootstrap_room: int,
        req_has_disagg_prefill_dp_rank: bool = False,
    ) -> None:
        super().__init__(mgr, bootstrap_room)
        self.inited = True  # the handshake starts when prefill's sender is built

    def init(self, num_kv_indices: int, aux_index: Any = None) -> None:
        self.metadata_index = aux_index

    def send(self, kv_indices: Any, state_indices: Any = None, num_kv_tokens: Any = None) -> None:
        self.sent = True

    def pop_decode_prefix_len(self) -> int:
        return 0

    def get_transfer_metric(self) -> Any:
        from sglang.srt.disaggregation.base.conn import KVTransferMetric

        return KVTransferMetric()


def get_kv_class(transfer_backend: Any, class_type: Any) -> Any:
    """The connection classes for every backend: the scripted stand-ins."""
    return {"RECEIVER": Receiver, "SENDER": Sender}[class_type.name]


class StagingHandler:
    """The decode staging handler, scripted per rank: done from ``scatter``,
    timed out from ``stage_fail``."""

    def __init__(self, rig: Rig) -> None:
        self.rig = rig
        self.rooms: set[int] = set()
        self.advanced: list[tuple[int, int]] = []

    def is_done(self, decode_req: Any) -> bool:
        return reached(self.rig.spec(decode_req.req.bootstrap_room, "scatter"), self.rig.now)

    def advance_scatter(self, decode_req: Any) -> None:
        self.advanced.append((self.rig.now, decode_req.req.bootstrap_room))

    def is_failed(self, decode_req: Any) -> bool:
        return reached(self.rig.spec(decode_req.req.bootstrap_room, "stage_fail"), self.rig.now)

    def register_decode_req(self, room: int, decode_req: Any) -> None:
        self.rooms.add(room)

    def is_staging_room(self, room: int) -> bool:
        return room in self.rooms

    def unregister_decode_req(self, room: int) -> None:
        self.rooms.discard(room)


# -- the scheduler's parts ----------------------------------------------------------------


class TreeCache:
    """Takes a finished request's KV row (``claim_kv_row``) and records finishes."""

    def __init__(self, rig: Rig, req_to_token_pool: Any = None) -> None:
        self.rig = rig
        self.req_to_token_pool = req_to_token_pool

    def supports_mamba(self) -> bool:
        return False

    def claim_kv_row(self, req: Any) -> bool:
        if self.req_to_token_pool is not None:
            self.req_to_token_pool.free(req)
        req.kv.req_pool_idx = None
        req.kv.mark_kv_released()
        self.rig.released.append(req.bootstrap_room)
        return True

    def finish(self, handle: Any, outcome: Any) -> None:
        self.rig.finished.append((int(handle.rid[1:]), outcome.name))

    def maybe_hand_to_session(self, req: Any) -> None:
        pass

    def unlock(self, lock: Any) -> None:
        pass


class Streamer:
    def __init__(self, rig: Rig) -> None:
        self.rig = rig

    def stream_output(self, reqs: list[Any], return_logprob: bool, skip_req: Any = None) -> None:
        self.rig.streamed.extend(r.bootstrap_room for r in reqs)


def _scheduler_common(s: Any, rig: Rig) -> None:
    s.rig = rig
    s.scheduler_stage_metrics = None
    s.output_streamer = Streamer(rig)
    s.metrics_reporter = types.SimpleNamespace(enable_metrics=False)
    s.waiting_queue = []
    s.random_seed = 0


def make_req(spec: Spec) -> Any:
    """SGLang's own ``Req``, for this spec's room (rid ``r<room>``)."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req(
        f"r{spec.room}",
        "",
        array("q", [11, 12, 13, 14]),
        SamplingParams(max_new_tokens=8),
        bootstrap_host=HOST,
        bootstrap_port=PORT,
        bootstrap_room=spec.room,
        vocab_size=1000,
    )
    if spec.reject:
        req.set_finish_with_abort("rejected at intake")
    return req


def abort_record(reqs: dict[int, Any]) -> list[tuple[int, str, int | None]]:
    """(room, reason class, status code) of every request finished by an abort."""
    out = []
    for room, req in sorted(reqs.items()):
        reason = req.finished_reason
        if reason is not None and type(reason).__name__ in ("FINISH_ABORT", "FinishAbort"):
            code = getattr(reason, "status_code", None)
            out.append((room, type(reason).__name__, None if code is None else int(code)))
    return out


# -- decode ----------------------------------------------------------------------------------


def decode_classes() -> tuple[type, type]:
    from sglang.srt.disaggregation.decode import (
        DecodePreallocQueue,
        SchedulerDisaggregationDecodeMixin,
    )

    class Prealloc(DecodePreallocQueue):
        """SGLang's queue; only its transfer-engine manager is the stand-in."""

        def _init_kv_manager(self) -> Any:
            return self.scheduler.rig.kv_manager

    class DecodeScheduler(SchedulerDisaggregationDecodeMixin):
        def __init__(self, rig: Rig) -> None:
            _scheduler_common(self, rig)
            self.enable_decode_hicache = False
            self.enable_hisparse = False
            self.enable_lora = False
            self.enable_priority_scheduling = False
            self.running_batch = types.SimpleNamespace(reqs=[])
            self.last_batch = None
            self.batch_result_processor = types.SimpleNamespace(
                _maybe_update_reasoning_tokens=lambda req, token: None
            )
            self.spec_algorithm = types.SimpleNamespace(is_none=lambda: True)
            self.tp_worker = types.SimpleNamespace(is_hybrid_swa=False)

        def retire_unadmitted_request(self, req: Any) -> None:
            self.rig.retired.append(req.bootstrap_room)

    return Prealloc, DecodeScheduler


def run_decode(
    rank: int,
    specs: list[Spec],
    impl: Any,
    group: Any,
    iterations: int,
    *,
    staging: bool = False,
) -> list[dict[str, Any]]:
    """Run the decode scheduler's queue step for ``iterations`` iterations; a record per iteration.

    ``impl`` is the module whose ``MetadataBuffers`` and ``ReqToMetadataIdxAllocator``
    the scheduler builds (SGLang's utils or ``field.utils``)."""
    import sglang.srt.disaggregation.decode as decode
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    prealloc_cls, scheduler_cls = decode_classes()
    rig = Rig(rank, specs)
    sched = scheduler_cls(rig)
    meta = impl.MetadataBuffers(META_ROWS, 16, torch.float32, 16)
    rig.buffers = meta
    slots = impl.ReqToMetadataIdxAllocator(META_ROWS)
    rows = decode.DecodeReqToTokenPool(8, 64, "cpu", False, 8)
    kv_pool = types.SimpleNamespace(page_size=1)
    tokens = TokenToKVPoolAllocator(TOKENS, torch.float16, "cpu", kv_pool, False)
    tree = TreeCache(rig, rows)
    transfer = decode.DecodeTransferQueue(slots, meta, sched, tree)
    prealloc = prealloc_cls(
        rows,
        tokens,
        None,
        slots,
        meta,
        sched,
        transfer,
        tree,
        0,
        PORT,
        TOKENS,
        4,
        decode.TransferBackend.MOONCAKE,
    )
    sched.disagg_decode_prealloc_queue = prealloc
    sched.disagg_decode_transfer_queue = transfer
    handler = None
    if staging:  # as _init_staging_handler does, with the stand-in handler
        handler = StagingHandler(rig)
        prealloc.enable_staging = transfer.enable_staging = True
        transfer.staging_handler = handler

    records = []
    for it in range(iterations):
        rig.now = it
        rig.transport()
        for spec in specs:
            if spec.arrive == it:
                req = rig.reqs[spec.room] = make_req(spec)
                prealloc.add(req)
        _decode_aborts(rig, prealloc, transfer, decode.prepare_abort)
        sched.process_decode_queue()
        popped = list(sched.waiting_queue)
        sched.waiting_queue.clear()
        records.append(
            {
                "it": it,
                "popped": [(r.bootstrap_room, r.output_ids[-1]) for r in popped],
                "prealloc": [dr.req.bootstrap_room for dr in prealloc.queue],
                "transfer": [dr.req.bootstrap_room for dr in transfer.queue],
                "deferred": [e[0].req.bootstrap_room for e in transfer._deferred_releases],
                "aborted": abort_record(rig.reqs),
                "retired": list(rig.retired),
                "streamed": list(rig.streamed),
                "released": list(rig.released),
                "metadata_rows_free": slots.available_size(),
                "kv_rows_free": rows.available_size(),
                "kv_tokens_free": tokens.available_size(),
                "sent": list(rig.kv_manager.sent),
                "staging_advanced": [] if handler is None else list(handler.advanced),
            }
        )
    return records


def _decode_aborts(rig: Rig, prealloc: Any, transfer: Any, prepare_abort: Callable) -> None:
    """The decode branch of the scheduler's abort_request, for the rooms whose AbortReq
    this rank handles now."""
    rooms = {room for room in rig.specs if rig.spec(room, "abort") == rig.now}
    for decode_req in prealloc.queue:
        if decode_req.req.bootstrap_room in rooms:
            decode_req.kv_receiver.abort()
            if rig.specs[decode_req.req.bootstrap_room].pp_abort:
                prepare_abort(decode_req.req, "Aborted by AbortReq.")
    for decode_req in transfer.queue:
        if decode_req.req.bootstrap_room in rooms:
            decode_req.kv_receiver.abort()


def gate_on_index(rank: int, index: Any, impl: Any) -> tuple[str, Any]:
    """``DecodeTransferQueue._poll_with_metadata_gate`` for one request whose receiver
    reports Success, whose ``metadata_buffer_index`` is ``index``, while the last row
    holds another request's landed room. ("statuses", [...]) or ("raised", type name)."""
    import sglang.srt.disaggregation.decode as decode

    _, scheduler_cls = decode_classes()
    spec = Spec(room=4242, hs=0, done=0)
    rig = Rig(rank, [spec])
    sched = scheduler_cls(rig)
    meta = impl.MetadataBuffers(4, 16, torch.float32, 16)
    meta.bootstrap_room[3, 0] = 777  # another request's row, landed
    transfer = decode.DecodeTransferQueue(impl.ReqToMetadataIdxAllocator(4), meta, sched, None)
    receiver = Receiver(rig.kv_manager, f"{HOST}:{PORT}", spec.room)
    receiver.init(0)
    receiver.send_metadata(np.zeros(1, dtype=np.int32), 0)
    transfer.queue = [
        decode.DecodeRequest(req=make_req(spec), kv_receiver=receiver, metadata_buffer_index=index)
    ]
    try:
        statuses = transfer._poll_with_metadata_gate()
    except Exception as e:
        return ("raised", type(e).__name__)
    return ("statuses", [int(s) for s in statuses])


# -- prefill ----------------------------------------------------------------------------------


def prefill_classes() -> tuple[type, type]:
    from sglang.srt.disaggregation.prefill import (
        PrefillBootstrapQueue,
        SchedulerDisaggregationPrefillMixin,
    )
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestOutcome

    class Bootstrap(PrefillBootstrapQueue):
        """SGLang's queue; only its transfer-engine manager is the stand-in."""

        def _init_kv_manager(self) -> Any:
            return self.scheduler.rig.kv_manager

    class PrefillScheduler(SchedulerDisaggregationPrefillMixin):
        def __init__(self, rig: Rig, tp_group: Any, cp_group: Any, slots: Any) -> None:
            _scheduler_common(self, rig)
            self.attn_tp_cpu_group = tp_group
            self.attn_cp_cpu_group = cp_group
            self.disagg_prefill_inflight_queue = []
            self.disagg_prefill_pending_chunk_rids = set()
            self.req_to_metadata_buffer_idx_allocator = slots
            self.tree_cache = TreeCache(rig)
            self.processed_tokens_counter = 0
            self.kv_shard_widening = 1
            self.token_to_kv_pool_allocator = types.SimpleNamespace(page_size=1)
            self.tp_worker = types.SimpleNamespace(
                model_runner=types.SimpleNamespace(effective_logical_max_total_num_tokens=TOKENS)
            )
            self.req_to_token_pool = types.SimpleNamespace(available_size=lambda: 8)

        def _release_aborted_request(self, req: Any) -> None:
            # the Scheduler's: drop the cache-side state (no multimodal inputs, no session here)
            self.tree_cache.finish(req.cache_request_handle, CacheRequestOutcome.ABORT)

        def retire_unadmitted_request(self, req: Any) -> None:
            self.rig.retired.append(req.bootstrap_room)

    return Bootstrap, PrefillScheduler


def run_prefill(
    rank: int,
    specs: list[Spec],
    impl: Any,
    tp_group: Any,
    cp_group: Any,
    iterations: int,
    *,
    metadata_rows: int = META_ROWS,
) -> list[dict[str, Any]]:
    """Run the prefill loop's queue steps (pop_bootstrapped, the forward stand-in,
    process_disagg_prefill_inflight_queue) for ``iterations`` iterations."""
    import sglang.srt.disaggregation.prefill as prefill

    queue_cls, scheduler_cls = prefill_classes()
    rig = Rig(rank, specs)
    slots = impl.ReqToMetadataIdxAllocator(metadata_rows)
    meta = impl.MetadataBuffers(metadata_rows, 16, torch.float32, 16)
    sched = scheduler_cls(rig, tp_group, cp_group, slots)
    queue = queue_cls(
        types.SimpleNamespace(page_size=1),
        None,
        slots,
        meta,
        0,
        PORT,
        TOKENS,
        sched,
        None,
        prefill.TransferBackend.MOONCAKE,
    )
    sched.disagg_prefill_bootstrap_queue = queue
    records = []
    next_row = 1
    for it in range(iterations):
        rig.now = it
        for spec in specs:
            if spec.arrive == it:
                req = rig.reqs[spec.room] = make_req(spec)
                queue.add(req, 1)
        rooms = {room for room in rig.specs if rig.spec(room, "abort") == it}
        for req in queue.queue:  # the prefill branch of the scheduler's abort_request
            if req.bootstrap_room in rooms:
                sched._release_aborted_request(req)
                req.disagg_kv_sender.abort()
        for req in sched.disagg_prefill_inflight_queue:
            if req.bootstrap_room in rooms:
                req.disagg_kv_sender.abort()
        bootstrapped = queue.pop_bootstrapped()
        sched.waiting_queue.extend(bootstrapped)
        for req in sched.waiting_queue:  # the forward pass, and its result's last chunk
            req.kv.req_pool_idx = next_row
            req.kv.kv_allocated_len = len(req.origin_input_ids)
            next_row += 1
            req.disagg_kv_sender.send(np.arange(len(req.origin_input_ids), dtype=np.int32))
            sched.disagg_prefill_inflight_queue.append(req)
        sched.waiting_queue.clear()
        done = sched.process_disagg_prefill_inflight_queue()
        records.append(
            {
                "it": it,
                "bootstrapped": [r.bootstrap_room for r in bootstrapped],
                "done": [(r.bootstrap_room, type(r.finished_reason).__name__) for r in done],
                "bootstrap": [r.bootstrap_room for r in queue.queue],
                "inflight": [r.bootstrap_room for r in sched.disagg_prefill_inflight_queue],
                "aborted": abort_record(rig.reqs),
                "retired": list(rig.retired),
                "streamed": list(rig.streamed),
                "released": list(rig.released),
                "finished": list(rig.finished),
                "metadata_rows_free": slots.available_size(),
                "metadata_index": {
                    room: int(r.metadata_buffer_index) for room, r in sorted(rig.reqs.items())
                },
            }
        )
    return records


def outcome(records: list[dict[str, Any]], side: str) -> dict[int, tuple[str, int]]:
    """Each room's fate and the iteration it was decided: ("popped" | "aborted" |
    "retired", it); rooms still queued at the end are ("queued", last iteration)."""
    out: dict[int, tuple[str, int]] = {}
    for rec in records:
        it = rec["it"]
        done = rec["popped"] if side == "decode" else rec["done"]
        for entry in done:
            room = entry[0]
            if room not in out:
                aborted = side == "prefill" and entry[1] != "FINISH_LENGTH"
                out[room] = ("aborted" if aborted else "popped", it)
        for room, *_ in rec["aborted"]:
            out.setdefault(room, ("aborted", it))
        for room in rec["retired"]:
            out.setdefault(room, ("retired", it))
    last = records[-1]
    queued = (
        last["prealloc"] + last["transfer"]
        if side == "decode"
        else last["bootstrap"] + last["inflight"]
    )
    for room in queued:
        out.setdefault(room, ("queued", last["it"]))
    return out


def groups(rank: int) -> dict[str, Any]:
    """WORLD, and each rank's group of one (every rank creates every group, in order)."""
    ones = [dist.new_group([r], backend="gloo") for r in range(dist.get_world_size())]
    return {"world": dist.group.WORLD, "one": ones[rank]}
