"""The field's Mooncake connector classes over our Mooncake backend.

Only the backend's public API is used (the registry's manager, sender and
receiver, and its config), so this stays a thin translation:

- manager ``(args, disaggregation_mode, server_args, is_mla_backend)``: role
  from the mode, TP rank from ``args.engine_rank``, the bootstrap store at
  ``server_args.disaggregation_bootstrap_host`` (else ``server_args.host``,
  else 127.0.0.1) and ``server_args.disaggregation_bootstrap_port``. Unlike
  the field's decode side, which finds prefill per request from its bootstrap
  address, ours joins that store once, when the manager is built. The address
  it advertises (``local_ip``) is found as :mod:`field.conn.addressing` says,
  and checked, before anything starts;
- sender and receiver: see :mod:`field.conn.handles` (both releases' call shapes);
- bootstrap server ``(host, port)``: the store itself.

All are subclasses of :mod:`field.conn.base`'s abstract classes.
"""

from __future__ import annotations

import contextlib
from typing import Any

from field.conn.addressing import local_ip
from field.conn.base import BaseKVManager
from field.conn.bootstrap import BootstrapServer
from field.conn.handles import FieldReceiver, FieldSender
from field.conn.kv_args import KVArgs
from field.conn.shapes import SENDER_SIGNATURE, sender_options
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


class MooncakeKVManager(BaseKVManager):
    """One per rank: registers this rank's memory and moves its requests' pages.

    ``BACKEND`` names the registry entry driven underneath: every byte-moving
    backend shares one connector and one config, so NIXL's classes are these
    with another name.

    The base's flags stay False: no host destinations, and no runtime role
    switch or deferred decode KV release is offered (the receivers'
    ``is_abort_release_safe()`` says when an aborted request's pages are free).
    ``should_verify_kv_checksum`` is the base's True: the layout signature
    shipped beside a digest already tells a TP-width mismatch apart.
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
        from transport.connector.config import ConnectorConfig

        port = getattr(server_args, "disaggregation_bootstrap_port", None)
        if port is None:
            raise ValueError(
                f"server_args.disaggregation_bootstrap_port is not set: the {self.BACKEND} "
                "manager needs the bootstrap server's port"
            )
        store_host, store_setting = _store_host(server_args)
        #: the address this rank's engine advertises (see :mod:`field.conn.addressing`)
        self.local_ip = local_ip(store_host, store_setting)
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
            store_host=store_host,
            store_port=int(port),
            hostname=self.local_ip,
            # the bootstrap server may be starting in the prefill process right now
            store_wait=30.0,
        )
        core_args = args.to_core() if hasattr(args, "to_core") else args
        self.core = backend.manager(core_args, config)

    def register_to_bootstrap(self) -> None:
        """Nothing more to do: the manager published this rank's endpoint (and, on
        prefill, its group) in the bootstrap store when it was built."""

    def close(self) -> None:
        """Stop the backend's threads (the field's managers live as long as the process)."""
        with contextlib.suppress(Exception):
            self.core.close()

    def teardown(self) -> None:
        """Release the transfer resources, as 0.5.23's Mooncake ``teardown``: fail
        the live requests, stop the threads and the engine; the KV pool is the
        scheduler's and is left alone (the same as :meth:`close`)."""
        self.close()


def _store_host(server_args: Any) -> tuple[str, str]:
    """The bootstrap store's host, and the setting it came from (for errors)."""
    for name in ("disaggregation_bootstrap_host", "host"):
        value = getattr(server_args, name, None)
        if value:
            return str(value), f"server_args.{name}"
    return "127.0.0.1", "the default bootstrap host"


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
        self.page_size = int(mgr.core.kv_args.page_size)
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
