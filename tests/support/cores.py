"""A connector's core on its own (no store, no engine, no thread), as the
quirk and protocol tests drive it: events in, effects out, time passed in."""

import torch

from buffers import MetadataBuffers, MetadataLayout
from lifecycle import KVPoll
from transport.connector.config import ConnectorConfig, check_fit
from transport.connector.core.legs import DecodeRequest, PrefillRequest
from transport.connector.core.machine import ConnectorCore
from transport.connector.core.sides import SIDES
from transport.layout import kv_args_for


def core_of(role="prefill", notifies=False, pages=8, page_bytes=64, **cfg):
    """A core for ``role`` over one small KV buffer and 4 metadata rows."""
    kv = [torch.zeros((pages, page_bytes), dtype=torch.uint8)]
    layout = MetadataLayout(hidden_size=32, hidden_dtype=torch.float32, max_top_logprobs=16)
    meta = MetadataBuffers(4, layout)
    config = ConnectorConfig(role=role, tp_rank=0, store_port=1, **cfg)  # (never reached)
    kv_args = kv_args_for(kv, meta.buf_infos(), 0)
    return ConnectorCore(kv_args, config, check_fit(kv_args, config), SIDES[role], notifies)


def request_at(core, phase, room=9, status=KVPoll.Transferring, now=0.0):
    """A live request of ``core`` put straight at ``phase`` (a test's shortcut)."""
    kind = PrefillRequest if core.config.role == "prefill" else DecodeRequest
    req = core.admit(room, kind, 0, now)
    core.phase[req.index] = phase
    core.status[req.index] = status
    return req
