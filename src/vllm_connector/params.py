"""What rides in a vLLM request's ``kv_transfer_params``, typed and checked.

The flow is the one vLLM's own prefill/decode connectors use, so its proxy
and router examples work unchanged: the router sends a request to prefill
with ``do_remote_decode``; prefill's ``request_finished`` answers the
params decode needs (``do_remote_prefill``, the blocks that hold the KV,
where prefill is); the router copies them into the request it sends to
decode. Beside vLLM's own keys this connector adds ``pdlife_room`` (the
request's room on the wire, chosen by prefill) and ``pdlife_epoch`` (its
attempt). Both may be missing (a router that forwards only vLLM's keys, or
vLLM's own tests, which build the params by hand): the room is then the one
prefill derives from its request id (:func:`room_of` of
``remote_request_id``), and the attempt the first.

A malformed value is refused with :class:`ParamsError`, naming the request,
the key and what it must hold; nothing is recorded for the request.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import xxhash

from transport.errors import TransportError

__all__ = ["ParamsError", "TransferParams", "room_of"]

#: the largest room (rooms are uint64, 0 meaning none)
MAX_ROOM = (1 << 64) - 1


class ParamsError(TransportError, ValueError):
    """A request's ``kv_transfer_params`` hold a value this connector cannot use."""

    def __init__(self, request_id: str, key: str, value: object, expected: str) -> None:
        self.request_id, self.key, self.value = request_id, key, value
        super().__init__(
            f'request {request_id}: kv_transfer_params["{key}"] is {value!r} '
            f"({type(value).__name__}), expected {expected}; the request is not transferred "
            "(check the router that builds the params)"
        )


def room_of(request_id: str) -> int:
    """The room of a request id: the same on every rank and every run (a 64-bit
    hash; never 0, which means no room)."""
    if not isinstance(request_id, str):
        raise TypeError(f"a request id is a string, got {request_id!r}")
    return xxhash.xxh3_64_intdigest(request_id.encode()) or 1


def _int(rid: str, params: Mapping[str, Any], key: str, lo: int, hi: int) -> int:
    v = params[key]
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise ParamsError(rid, key, v, f"an integer in {lo}..{hi}")
    return v


def _text(rid: str, params: Mapping[str, Any], key: str) -> str:
    v = params[key]
    if not isinstance(v, str) or not v:
        raise ParamsError(rid, key, v, "a non-empty string")
    return v


def _is_id(b: object) -> bool:
    return isinstance(b, int) and not isinstance(b, bool) and b >= 0


def _groups(rid: str, blocks: object) -> tuple[tuple[int, ...], ...]:
    """Block ids per KV cache group: vLLM sends a list per group (a flat list is
    one group)."""
    expected = "block ids >= 0: a list per KV cache group, or one flat list"
    if not isinstance(blocks, (list, tuple)):
        raise ParamsError(rid, "remote_block_ids", blocks, expected)
    if all(_is_id(b) for b in blocks):
        return (tuple(blocks),)
    if all(isinstance(g, (list, tuple)) and all(_is_id(b) for b in g) for g in blocks):
        return tuple(tuple(g) for g in blocks)
    raise ParamsError(rid, "remote_block_ids", blocks, expected)


@attrs.frozen
class TransferParams:
    """Decode's view of where a request's KV is: prefill's engine, address,
    TP size and blocks, and the room and attempt on the wire."""

    room: int
    epoch: int
    engine_id: str
    request_id: str
    host: str
    port: int
    tp_size: int
    #: prefill's blocks per KV cache group (one group: a model of one attention kind)
    block_ids: tuple[tuple[int, ...], ...]

    #: the keys :meth:`from_params` needs (besides ``do_remote_prefill``)
    KEYS = (
        "remote_engine_id",
        "remote_request_id",
        "remote_host",
        "remote_port",
        "tp_size",
        "remote_block_ids",
    )

    @classmethod
    def from_params(cls, request_id: str, params: object) -> TransferParams | None:
        """The params of a request decode must load from prefill, or None when it
        need not (no params, or ``do_remote_prefill`` false)."""
        if params is None:
            return None
        if not isinstance(params, Mapping):
            raise ParamsError(request_id, "", params, "a JSON object")
        if not params.get("do_remote_prefill"):
            return None
        for key in cls.KEYS:
            if key not in params:
                raise ParamsError(request_id, key, None, "a value (prefill's answer lacks it)")
        blocks = _groups(request_id, params["remote_block_ids"])
        remote_id = _text(request_id, params, "remote_request_id")
        return cls(
            room=_int(
                request_id,
                {"pdlife_room": params.get("pdlife_room", room_of(remote_id))},
                "pdlife_room",
                1,
                MAX_ROOM,
            ),
            epoch=_int(
                request_id,
                {"pdlife_epoch": params.get("pdlife_epoch", 0)},
                "pdlife_epoch",
                0,
                65535,
            ),
            engine_id=_text(request_id, params, "remote_engine_id"),
            request_id=remote_id,
            host=_text(request_id, params, "remote_host"),
            port=_int(request_id, params, "remote_port", 1, 65535),
            tp_size=_int(request_id, params, "tp_size", 1, 1 << 16),
            block_ids=blocks,
        )

    @staticmethod
    def answer(
        room: int,
        epoch: int,
        engine_id: str,
        request_id: str,
        host: str,
        port: int,
        tp_size: int,
        block_ids: Sequence[Sequence[int]],
    ) -> dict[str, Any]:
        """Prefill's answer in ``request_finished``: the params decode's request
        carries (vLLM's keys, then this connector's)."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [list(g) for g in block_ids],
            "remote_engine_id": engine_id,
            "remote_request_id": request_id,
            "remote_host": host,
            "remote_port": port,
            "tp_size": tp_size,
            "pdlife_room": room,
            "pdlife_epoch": epoch,
        }
