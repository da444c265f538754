"""``PdLifecycleConnector``: this library as a vLLM KV connector.

A vLLM user names it by module path::

    --kv-transfer-config '{"kv_connector": "PdLifecycleConnector",
        "kv_connector_module_path": "vllm_connector.connector",
        "kv_role": "kv_both", "kv_port": 14579,
        "kv_connector_extra_config": {"backend": "mooncake"}}'

vLLM builds one on the scheduler (:class:`~vllm_connector.scheduler.SchedulerCore`
does the work) and one on each worker (:class:`~vllm_connector.worker.WorkerSide`
over this library's connector for the backend the extra config names, the TP
workers agreeing each step over vLLM's TP group). This module is the only one
of the package that imports vLLM; it translates vLLM's objects into the plain
data the two cores take.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import attrs
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from lifecycle import SingleRank, StepConfig
from lifecycle.drive.collective import Collective, TorchCollective
from transport.registry import get_backend
from vllm_connector.agreement import WorkerAgreement
from vllm_connector.caches import kv_args_of
from vllm_connector.config import ExtraConfig
from vllm_connector.scheduler import Meta, Phase, SchedulerCore
from vllm_connector.worker import WorkerSide

if TYPE_CHECKING:
    from collections.abc import Iterable

__all__ = ["PdLifecycleConnector", "PdLifecycleMetadata"]

logger = logging.getLogger(__name__)


@attrs.define
class PdLifecycleMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's work for the workers (the scheduler core's :class:`Meta`)."""

    meta: Meta = attrs.field(factory=Meta)


def _finished_normally(request: Any) -> bool:
    from vllm.v1.request import RequestStatus

    return request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)


def _groups(block_ids: Any) -> list[list[int]]:
    """vLLM's block ids per KV cache group (a tuple of lists, or one flat list)."""
    ids = list(block_ids)
    if ids and not isinstance(ids[0], (list, tuple)):
        return [[int(b) for b in ids]]
    return [[int(b) for b in g] for g in ids]


class PdLifecycleConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """vLLM's ``KVConnectorBase_V1`` over this library (see the module)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        kt = vllm_config.kv_transfer_config
        self.settings = ExtraConfig.parse(
            kt.kv_connector_extra_config,
            kv_ip=str(getattr(kt, "kv_ip", "127.0.0.1")),  # (0.34 has no kv_ip: store_host)
            kv_port=kt.kv_port,
            kv_load_failure_policy=kt.kv_load_failure_policy,
            kv_role=kt.kv_role,
        )
        self.tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        self.engine_id = str(kt.engine_id)
        self.scheduler: SchedulerCore | None = None
        self.worker: WorkerSide | None = None
        self.manager: Any = None
        self._load_errors: set[int] = set()
        if role == KVConnectorRole.SCHEDULER:
            host, port = self.settings.fields["store_host"], self.settings.fields["store_port"]
            self.scheduler = SchedulerCore(self.engine_id, host, port, self.tp_size)

    # -- scheduler side -------------------------------------------------------------------------
    def _core(self) -> SchedulerCore:
        if self.scheduler is None:
            raise RuntimeError("a scheduler-side call on a worker's connector")
        return self.scheduler

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._core().matched(
            request.request_id,
            request.kv_transfer_params,
            int(request.num_prompt_tokens),
            int(num_computed_tokens),
        )

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        core = self._core()
        core.allocated(
            request.request_id, _groups(blocks.get_block_ids()), int(num_external_tokens)
        )
        if core.phase(request.request_id) is Phase.PLANNED:
            # one transfer per request: a request recomputed or preempted later
            # never asks prefill again (whose blocks are freed by then)
            request.kv_transfer_params["do_remote_prefill"] = False

    def build_connector_meta(self, scheduler_output: Any) -> PdLifecycleMetadata:
        return PdLifecycleMetadata(self._core().build_meta())

    def update_connector_output(self, connector_output: Any) -> None:
        core = self._core()
        core.workers_report(
            set(connector_output.finished_sending or ()),
            set(connector_output.finished_recving or ()),
            set(getattr(connector_output, "failed_recving", None) or ()),
        )
        hold, release = core.take_holds()
        if hold or release:  # the quarantine of failed loads' blocks (see the scheduler core)
            pool = self._kv_cache_manager.block_pool
            for ids in hold:
                pool.touch([pool.blocks[i] for i in ids])
            for ids in release:
                pool.free_blocks([pool.blocks[i] for i in ids])

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        return self._core().finished(
            request.request_id,
            request.kv_transfer_params,
            _groups(block_ids),
            _finished_normally(request),
        )

    # -- worker side ----------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        rank = int(get_tensor_model_parallel_rank()) if self.tp_size > 1 else 0
        args, shape = kv_args_of(kv_caches, rank)
        config = self.settings.connector(
            self.settings.side,
            rank,
            self.tp_size,
            kv_heads=shape.kv_heads * self.tp_size,
            mla=shape.mla,
        )
        self.manager = get_backend(self.settings.backend).manager(args, config)
        self.worker = WorkerSide(
            self.manager,
            WorkerAgreement(
                rank, self.manager, self._collective(), StepConfig(recovery=self.settings.recovery)
            ),
            page_size=shape.block_size,
        )

    def _collective(self) -> Collective:
        if self.tp_size == 1:
            return SingleRank()
        from vllm.distributed.parallel_state import get_tp_group

        return TorchCollective(get_tp_group().cpu_group)

    def _worker(self) -> WorkerSide:
        if self.worker is None:
            raise RuntimeError("a worker-side call before register_kv_caches")
        return self.worker

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, PdLifecycleMetadata):
            self._worker().start(meta.meta)
        else:
            self._worker().hand_over()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing: a request's KV is loaded whole, between steps."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        """Nothing: prefill's KV is read where it lies once the request finished."""

    def wait_for_save(self) -> None:
        """Nothing to wait for: sends run between steps."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        report = self._worker().finished()
        self._load_errors |= report.load_errors
        return set(report.sending) or None, set(report.recving) or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """Sends ended, loads ended, and the loads that failed by request id."""
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorTransferResults,
        )

        report = self._worker().finished()
        self._load_errors |= report.load_errors
        return KVConnectorTransferResults(
            finished_sending=set(report.sending),
            finished_recving=set(report.recving),
            failed_recving=set(report.failed),
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self.manager is not None:
            self.manager.close()

    def take_events(self) -> Iterable[Any]:
        return ()
