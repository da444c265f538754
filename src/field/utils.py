"""``sglang.srt.disaggregation.utils`` by its own names: change the import, keep the calls.

Every consensus, pipeline, flag, layout-signature, buffer, allocator, abort
and class-lookup name of that module is here, backed by this library. The
model-layout helpers (DSA, QSA, Mamba slicing, DeepSeek V4 layouts) and the
hardware-only paths are not: an engine keeps importing those from SGLang.
docs/compat.md lists every name and where ours differs on purpose.
"""

from __future__ import annotations

from field.checksum import kv_layout_signature
from field.conn.backends import KVClassType, TransferBackend, get_kv_class
from field.data.buffers import ReqToMetadataIdxAllocator, filter_kv_indices_for_cp_rank
from field.data.metadata import MetadataBuffers
from field.data.placement import filter_kv_indices_for_shard_rank, should_send_replicated_state
from field.data.state import append_state_component, is_mla_backend, setup_state_kv_args
from field.engine import DisaggregationMode
from field.step.abort import is_aborted, is_unadmitted_reject, prepare_abort
from field.step.consensus import (
    poll_and_all_reduce,
    poll_and_all_reduce_attn_cp_tp_group,
    poll_and_all_reduce_with_staging,
)
from field.step.gates import FAKE_BOOTSTRAP_HOST
from field.step.pp import (
    all_reduce_flags,
    poll_and_all_reduce_pp,
    poll_and_all_reduce_prefill_pp,
    pp_sync_polls,
)

__all__ = [
    "FAKE_BOOTSTRAP_HOST",
    "DisaggregationMode",
    "KVClassType",
    "MetadataBuffers",
    "ReqToMetadataIdxAllocator",
    "TransferBackend",
    "all_reduce_flags",
    "append_state_component",
    "filter_kv_indices_for_cp_rank",
    "filter_kv_indices_for_shard_rank",
    "get_kv_class",
    "is_aborted",
    "is_mla_backend",
    "is_unadmitted_reject",
    "kv_layout_signature",
    "poll_and_all_reduce",
    "poll_and_all_reduce_attn_cp_tp_group",
    "poll_and_all_reduce_pp",
    "poll_and_all_reduce_prefill_pp",
    "poll_and_all_reduce_with_staging",
    "pp_sync_polls",
    "prepare_abort",
    "setup_state_kv_args",
    "should_send_replicated_state",
]
