"""A minimal vLLM 0.34 KV connector that records what vLLM's scheduler asks of it.

vLLM loads it the way it will load this project's connector: by
KVTransferConfig(kv_connector="ProbeConnector",
kv_connector_module_path="vllm_probe_connector"). Its answers come from
kv_connector_extra_config: "matched_tokens" (how many prompt tokens it claims
to hold, default 0) and "load_async" (whether it loads them between steps,
default False). The worker side does nothing: no test here runs a model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


class ProbeMetadata(KVConnectorMetadata):
    """What build_connector_meta hands the workers: the ids it saw scheduled."""

    def __init__(self, request_ids: list[str]) -> None:
        self.request_ids = request_ids


class ProbeConnector(KVConnectorBase_V1):
    """Answers the scheduler from its extra config and records each call.

    `calls` holds (method, request id, token count) in call order.
    """

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        matched = extra.get("matched_tokens", 0)
        load_async = extra.get("load_async", False)
        if not isinstance(matched, int) or isinstance(matched, bool) or matched < 0:
            raise ValueError(
                f"kv_connector_extra_config matched_tokens={matched!r}: "
                "give a non-negative int (the prompt tokens this connector claims)"
            )
        if not isinstance(load_async, bool):
            raise ValueError(
                f"kv_connector_extra_config load_async={load_async!r}: give True or False"
            )
        self.matched_tokens = matched
        self.load_async = load_async and matched > 0
        self.calls: list[tuple[str, str, int]] = []

    # -- scheduler side --

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self.calls.append(("get_num_new_matched_tokens", request.request_id, num_computed_tokens))
        available = max(0, self.matched_tokens - num_computed_tokens)
        return available, self.load_async and available > 0

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.calls.append(("update_state_after_alloc", request.request_id, num_external_tokens))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        ids = [r.req_id for r in scheduler_output.scheduled_new_reqs]
        return ProbeMetadata(ids)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self.calls.append(("request_finished", request.request_id, len(block_ids)))
        return False, None

    # -- worker side: nothing to move --

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        return

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return

    def wait_for_save(self) -> None:
        return
