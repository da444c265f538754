"""The field's Mooncake connector classes over our Mooncake backend.

Only the backend's public API is used (the registry's manager, sender and
receiver, and its config), so this stays a thin translation:

- manager ``(args, disaggregation_mode, server_args, is_mla_backend)``: role
  from the mode, TP rank from ``args.engine_rank``, the bootstrap store at
  ``server_args.disaggregation_bootstrap_host`` (else ``server_args.host``,
  else 127.0.0.1) and ``server_args.disaggregation_bootstrap_port``. Unlike
  the field's decode side, which finds prefill per request from its bootstrap
  address, ours joins that store once, when the manager is built;
- sender and receiver: see :mod:`field.conn.handles` (both releases' call shapes);
- bootstrap server ``(host, port)``: the store itself.
"""

from __future__ import annotations

import contextlib
from typing import Any

from field.conn.bootstrap import BootstrapServer
from field.conn.handles import SENDER_SIGNATURE, FieldReceiver, FieldSender, sender_options
from field.conn.kv_args import KVArgs
from field.release import UNSET
from transport.registry import get_backend

__all__ = [
    "MooncakeKVManager",
    "MooncakeKVSender",
    "MooncakeKVReceiver",
    "MooncakeKVBootstrapServer",
    "CLASSES",
]


def _role(mode: Any, backend: str) -> str:
    value = getattr(mode, "value", mode)
    if value not in ("prefill", "decode"):
        raise ValueError(
            f"a {backend} manager serves prefill or decode, got disaggregation_mode={mode!r}"
        )
    return str(value)


class MooncakeKVManager:
    """One per rank: registers this rank's memory and moves its requests' pages.

    ``BACKEND`` names the registry entry driven underneath: every byte-moving
    backend shares one connector and one config, so NIXL's classes are these
    with another name.
    """

    BACKEND = "mooncake"

    def __init__(
        self,
        args: Any,
        disaggregation_mode: Any,
        server_args: Any,
        is_mla_backend: bool | None = False,
    ) -> None:
        backend = get_backend(self.BACKEND)  # a typed error naming the extra when missing
        from transport.connector import ConnectorConfig

        port = getattr(server_args, "disaggregation_bootstrap_port", None)
        if port is None:
            raise ValueError(
                f"server_args.disaggregation_bootstrap_port is not set: the {self.BACKEND} "
                "manager needs the bootstrap server's port"
            )
        host = (
            getattr(server_args, "disaggregation_bootstrap_host", None)
            or getattr(server_args, "host", None)
            or "127.0.0.1"
        )
        self.kv_args = args
        self.disaggregation_mode = disaggregation_mode
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        self.attn_cp_rank, self.attn_cp_size = 0, 1
        config = ConnectorConfig(
            role=_role(disaggregation_mode, self.BACKEND),
            tp_rank=int(args.engine_rank),
            tp_size=_tp_size(server_args, int(args.engine_rank), self.BACKEND),
            mla=bool(is_mla_backend),
            store_host=host,
            store_port=int(port),
            hostname=getattr(server_args, "host", None) or "127.0.0.1",
            # the bootstrap server may be starting in the prefill process right now
            store_wait=30.0,
        )
        core_args = args.to_core() if hasattr(args, "to_core") else args
        self.core = backend.manager(core_args, config)

    def close(self) -> None:
        """Stop the backend's threads (the field's managers live as long as the process)."""
        with contextlib.suppress(Exception):
            self.core.close()


def _tp_size(server_args: Any, rank: int, backend: str) -> int:
    """This side's TP size from the field's server args (1 for a lone rank 0):
    every rank of a group must publish the same size."""
    tp = getattr(server_args, "tp_size", None)
    if tp is None and rank > 0:
        raise ValueError(
            f"server_args.tp_size is not set: the {backend} manager of engine rank {rank} "
            "needs its TP group's size to pair with the other side's ranks"
        )
    return 1 if tp is None else int(tp)


class MooncakeKVSender(FieldSender):
    """Built as either release builds senders (see :mod:`field.conn.handles`)."""

    __signature__ = SENDER_SIGNATURE

    def __init__(
        self,
        mgr: MooncakeKVManager,
        bootstrap_addr: str | None,
        bootstrap_room: int,
        *args: Any,
        dest_tp_ranks: Any = UNSET,
        pp_rank: Any = UNSET,
        req_has_disagg_prefill_dp_rank: Any = UNSET,
    ) -> None:
        options = sender_options(
            f"{type(self).__name__}()",
            args,
            dest_tp_ranks=dest_tp_ranks,
            pp_rank=pp_rank,
            req_has_disagg_prefill_dp_rank=req_has_disagg_prefill_dp_rank,
        )
        core = mgr.core.sender(int(bootstrap_room))
        super().__init__(core, mgr, bootstrap_addr, bootstrap_room, **options)


class MooncakeKVReceiver(FieldReceiver):
    def __init__(
        self,
        mgr: MooncakeKVManager,
        bootstrap_addr: str | None,
        bootstrap_room: int | None = None,
        prefill_dp_rank: int | None = None,
    ) -> None:
        if not bootstrap_room:
            raise ValueError(
                f"a {mgr.BACKEND} receiver needs the request's non-zero bootstrap_room"
            )
        core = mgr.core.receiver(int(bootstrap_room))
        super().__init__(core, mgr, bootstrap_addr, bootstrap_room, prefill_dp_rank)


class MooncakeKVBootstrapServer(BootstrapServer):
    """The bootstrap store prefill and decode managers meet at."""


CLASSES: dict[str, Any] = {
    "kvargs": KVArgs,
    "manager": MooncakeKVManager,
    "sender": MooncakeKVSender,
    "receiver": MooncakeKVReceiver,
    "bootstrap_server": MooncakeKVBootstrapServer,
}
