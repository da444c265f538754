"""First-token metadata rows, written by prefill and read by decode.

A pool of ``size`` rows; each field is one 2-D tensor ``(size, width)``.
``buf_infos()`` returns three parallel lists, in :attr:`MetadataLayout.fields`
order, for registering with a transfer engine: base pointer, total bytes and
bytes per row; row ``k`` of a field is at ``ptr + k * item_len``. Both sides
build the same layout, so the lists line up.

A layout may add fields of its own (a subclass overriding
:attr:`MetadataLayout.fields`); each field's rows start at its ``fill``.

The ``bootstrap_room`` field is written last: a non-zero room equal to the
request's means the whole row has landed; zero means not written; another
non-zero room means the row belongs to someone else (corruption).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import attrs
import numpy as np
import torch
from numpy.typing import NDArray

from buffers.allocator import MAX_SLOTS, check_room
from buffers.errors import BadArgument, BadArgumentType, LayoutError, RowOverflow, SlotOutOfRange

__all__ = [
    "FieldSpec",
    "MetadataLayout",
    "MetadataRecord",
    "MetadataBuffers",
    "MIN_ROW_BYTES",
]

MIN_ROW_BYTES = 64  # the smallest RDMA write; rows narrower than this get torn


@attrs.frozen
class FieldSpec:
    """One field: ``width`` values of ``dtype`` per row; an unwritten row (and
    the part of a row a write leaves short) holds ``fill``."""

    name: str
    width: int
    dtype: torch.dtype
    fill: int = 0

    @property
    def row_bytes(self) -> int:
        return self.width * self.dtype.itemsize


def _uint64_supported() -> bool:
    try:
        torch.zeros(1, dtype=torch.uint64)
        return True
    except (AttributeError, RuntimeError, TypeError):
        return False


@attrs.frozen
class MetadataLayout:
    """Fields, widths and dtypes; the default matches the field's buffers."""

    hidden_size: int = 4096
    hidden_dtype: torch.dtype = torch.bfloat16
    max_top_logprobs: int = 128
    room_dtype: torch.dtype = attrs.field(
        factory=lambda: torch.uint64 if _uint64_supported() else torch.int64
    )

    @property
    def fields(self) -> tuple[FieldSpec, ...]:
        f = FieldSpec
        return (
            f("output_ids", 16, torch.int32),
            f("cached_tokens", 16, torch.int32),
            f("output_token_logprobs_val", 16, torch.float32),
            f("output_token_logprobs_idx", 16, torch.int32),
            f("output_top_logprobs_val", self.max_top_logprobs, torch.float32),
            f("output_top_logprobs_idx", self.max_top_logprobs, torch.int32),
            f("output_topk_p", 16, torch.float32),
            f("output_topk_index", 16, torch.int64),
            f("output_hidden_states", self.hidden_size, self.hidden_dtype),
            f("bootstrap_room", 8, self.room_dtype),
        )

    def validate(self) -> None:
        for name in ("hidden_size", "max_top_logprobs"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, (bool, np.bool_)) or v < 1:
                raise LayoutError(f"MetadataLayout.{name} must be an integer >= 1, got {v!r}")
        for name in ("hidden_dtype", "room_dtype"):
            if not isinstance(getattr(self, name), torch.dtype):
                raise LayoutError(f"MetadataLayout.{name} must be a torch.dtype")
        if self.room_dtype not in (torch.int64, getattr(torch, "uint64", torch.int64)):
            raise LayoutError(
                f"bootstrap_room dtype must be uint64 or int64, got {self.room_dtype}"
            )
        for spec in self.fields:
            if spec.width < 1:
                raise LayoutError(f"field {spec.name}: width must be >= 1, got {spec.width}")
            if spec.row_bytes < MIN_ROW_BYTES:
                raise LayoutError(
                    f"field {spec.name}: a row is {spec.row_bytes} bytes "
                    f"({spec.width} x {spec.dtype}), below the {MIN_ROW_BYTES}-byte minimum "
                    "RDMA write; widen the field (e.g. max_top_logprobs >= 16, "
                    "hidden_size large enough)"
                )


@attrs.frozen(eq=False)
class MetadataRecord:
    """One row's contents (copies: the slot will be reused); ``extra`` holds
    the fields a layout adds beyond the standard ones, by name."""

    STANDARD: ClassVar[tuple[str, ...]] = (
        "output_ids",
        "cached_tokens",
        "output_token_logprobs_val",
        "output_token_logprobs_idx",
        "output_top_logprobs_val",
        "output_top_logprobs_idx",
        "output_topk_p",
        "output_topk_index",
        "output_hidden_states",
    )

    output_ids: NDArray[Any]
    cached_tokens: NDArray[Any]
    output_token_logprobs_val: NDArray[Any]
    output_token_logprobs_idx: NDArray[Any]
    output_top_logprobs_val: NDArray[Any]
    output_top_logprobs_idx: NDArray[Any]
    output_topk_p: NDArray[Any]
    output_topk_index: NDArray[Any]
    output_hidden_states: NDArray[Any]
    bootstrap_room: int
    extra: Mapping[str, NDArray[Any]] = attrs.field(factory=dict)

    @property
    def first_token(self) -> int:
        return int(self.output_ids[0])


class MetadataBuffers:
    """``size`` metadata rows on ``device`` (CPU by default)."""

    def __init__(
        self, size: int, layout: MetadataLayout | None = None, device: str = "cpu"
    ) -> None:
        ok = isinstance(size, (int, np.integer)) and not isinstance(size, (bool, np.bool_))
        if not ok or not 1 <= int(size) <= MAX_SLOTS:
            raise LayoutError(
                f"MetadataBuffers size must be an integer in 1..{MAX_SLOTS}, got {size!r}"
            )
        if layout is not None and not isinstance(layout, MetadataLayout):
            raise LayoutError(f"MetadataBuffers layout must be a MetadataLayout, got {layout!r}")
        self.size = int(size)
        self.layout = layout or MetadataLayout()
        self.layout.validate()
        self.device = torch.device(device)
        self._specs = {spec.name: spec for spec in self.layout.fields}
        self.tensors: dict[str, torch.Tensor] = {
            spec.name: torch.full(
                (size, spec.width), spec.fill, dtype=spec.dtype, device=self.device
            )
            for spec in self.layout.fields
        }
        self._checked: NDArray[np.int64] | None = None
        rooms = self.tensors["bootstrap_room"]
        # a CPU int64 view of the room column for vectorised checks (uint64 viewed as int64)
        self._rooms = rooms.view(torch.int64).numpy()[:, 0] if self.device.type == "cpu" else None

    # -- registration ----------------------------------------------------
    def buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        """(base pointers, total bytes, bytes per row), one entry per field in layout order."""
        ptrs, lens, items = [], [], []
        for spec in self.layout.fields:
            t = self.tensors[spec.name]
            ptrs.append(t.data_ptr())
            lens.append(t.nbytes)
            items.append(t[0].nbytes)
        return ptrs, lens, items

    # -- rows --------------------------------------------------------------
    def _check(self, slot: int) -> None:
        if not isinstance(slot, (int, np.integer)) or isinstance(slot, (bool, np.bool_)):
            raise BadArgumentType("metadata slot", slot, f"an integer in 0..{self.size - 1}")
        if not 0 <= slot < self.size:
            raise SlotOutOfRange(int(slot), self.size)

    def write(self, slot: int, room: int, values: Mapping[str, Any]) -> None:
        """Write a row; ``bootstrap_room`` goes last, so a reader that sees the room sees all.

        Everything is checked before the row is touched: a slot, room or
        ``values`` of the wrong type (a string, say), or a field's value that
        is not numbers, raises :class:`~buffers.errors.BadArgumentType` (a
        TypeError) naming it."""
        self._check(slot)
        if isinstance(room, (int, np.integer)) and not isinstance(room, bool) and room == 0:
            raise LayoutError("room 0 means 'not written'; a real request needs a non-zero room")
        room = check_room(room)
        if not isinstance(values, Mapping):
            raise BadArgumentType("metadata values", values, _VALUES)
        self._store(slot, _signed(room), values)

    def write_unclaimed(self, slot: int, values: Mapping[str, Any]) -> None:
        """Write a row's fields but leave its room 0 ('not written'): for a request
        that has no room (warm-up), whose row no reader may take as landed."""
        self._check(slot)
        if not isinstance(values, Mapping):
            raise BadArgumentType("metadata values", values, _VALUES)
        self._store(slot, 0, values)

    def _store(self, slot: int, room_word: int, values: Mapping[str, Any]) -> None:
        unknown = set(values) - set(self._specs)
        if unknown:
            raise LayoutError(f"unknown metadata fields {sorted(unknown)}")
        staged = {}
        for name, v in values.items():
            t = self.tensors[name]
            if isinstance(v, (str, bytes)):
                raise BadArgumentType(f"metadata values[{name!r}]", v, _numbers(name, t))
            try:
                src = torch.as_tensor(v, dtype=t.dtype).reshape(-1)
            except (TypeError, ValueError, RuntimeError):
                raise BadArgumentType(f"metadata values[{name!r}]", v, _numbers(name, t)) from None
            if src.numel() > t.shape[1]:
                raise RowOverflow(name, src.numel(), t.shape[1])
            staged[name] = src
        room_col = self.tensors["bootstrap_room"].view(torch.int64)
        room_col[slot, 0] = 0  # a reader must not pair the old room with new data
        for name, src in staged.items():
            row = self.tensors[name][slot]
            row.fill_(self._specs[name].fill)
            row[: src.numel()] = src
        room_col[slot, 0] = room_word

    def read(self, slot: int) -> MetadataRecord:
        self._check(slot)
        values = {
            spec.name: self.tensors[spec.name][slot].detach().to("cpu").clone()
            for spec in self.layout.fields
            if spec.name != "bootstrap_room"
        }
        np_values = {
            k: (v.float() if v.dtype == torch.bfloat16 else v).numpy() for k, v in values.items()
        }
        standard = {k: np_values.pop(k) for k in MetadataRecord.STANDARD}
        return MetadataRecord(bootstrap_room=self.room_of(slot), extra=np_values, **standard)

    def room_of(self, slot: int) -> int:
        self._check(slot)
        v = int(self.tensors["bootstrap_room"][slot, 0].view(torch.int64).item())
        return v & 0xFFFFFFFFFFFFFFFF

    def clear_room(self, slot: int) -> None:
        """Mark a row 'not written' (on free: the next owner must not see a stale room)."""
        self._check(slot)
        self.tensors["bootstrap_room"][slot].zero_()

    def landed(
        self, slots: NDArray[np.int64], rooms: NDArray[np.uint64]
    ) -> tuple[NDArray[np.bool_], NDArray[np.bool_]]:
        """Vectorised metadata gate: ``(landed, corrupt)`` for each (slot, room).

        landed: the row carries this room. corrupt: it carries another
        non-zero room (someone else's row). Zero: not written yet.
        """
        if type(slots) is not np.ndarray:
            slots = np.asarray(slots)
        # a read-only array checked before cannot have changed: a stepper
        # passes the same one every step until its table changes
        if slots is not self._checked:
            if slots.dtype.kind not in "iu":
                raise BadArgument("metadata slots", slots, "integer slot indices")
            if slots.size and (int(slots.min()) < 0 or int(slots.max()) >= self.size):
                bad = int(slots[(slots < 0) | (slots >= self.size)][0])
                raise SlotOutOfRange(bad, self.size)
            if not slots.flags.writeable and slots.base is None:
                self._checked = slots
        if self._rooms is not None:
            # indexing reads the strided column in place (np.take would first
            # copy the whole column: a cache line per row of the pool)
            got = self._rooms[slots]
        else:
            col = self.tensors["bootstrap_room"][torch.as_tensor(slots), 0].view(torch.int64)
            got = col.cpu().numpy()
        if type(rooms) is np.ndarray and rooms.dtype == np.uint64:
            want = rooms.view(np.int64)
        else:
            want = np.asarray(rooms, dtype=np.uint64).view(np.int64)
        landed = got == want
        # corrupt: another request's (non-zero) room, i.e. written and not landed
        return landed, np.greater(got != 0, landed)


_VALUES = "a mapping of field name to values (e.g. {'output_ids': [token]})"


def _numbers(name: str, tensor: torch.Tensor) -> str:
    return f"numbers for the {name} row (at most {tensor.shape[1]}, as {tensor.dtype})"


def _signed(room: int) -> int:
    """The same 64 bits as a signed integer (rooms are uint64; storage may be int64)."""
    if not 0 < room < 1 << 64:
        raise LayoutError(f"room {room} is not a non-zero uint64")
    return room - (1 << 64) if room >= 1 << 63 else room
