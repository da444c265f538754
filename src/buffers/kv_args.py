"""What a transfer engine needs to know about the memory it moves.

Both sides build the same description: KV page buffers, auxiliary (metadata)
buffers and, for models with more per-request state than KV pages, a list of
state components appended in the same order on both sides.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import attrs

from buffers.errors import GeometryMismatch, LayoutError

__all__ = [
    "StateType",
    "StateComponent",
    "KVArgs",
    "DescribesState",
    "collect_state",
    "check_draft_geometry",
]


class StateType(enum.Enum):
    MAMBA = "mamba"
    SWA = "swa"
    SWA_RING = "swa_ring"
    C128_STATE = "c128_state"
    DSA = "dsa"
    MINIMAX_INDEX_K = "minimax_index_k"


def _ints(v: Sequence[int]) -> tuple[int, ...]:
    return tuple(int(x) for x in v)


def _opt_ints(v: Sequence[int] | None) -> tuple[int, ...] | None:
    return None if v is None else _ints(v)


@attrs.frozen
class StateComponent:
    """One kind of per-request state: parallel lists of tensors' pointers,
    total bytes and bytes per row, plus optional per-tensor split dims for TP
    resharding: ``split_dims[i]`` is how many units of its rows' outermost
    dimension tensor ``i`` holds on this rank (a mamba state's ``heads / tp``,
    say), the rank's share ``[r * units, (r + 1) * units)`` of the whole; 0
    marks a tensor every rank holds whole. Without split dims every tensor is
    held whole."""

    type: StateType
    ptrs: tuple[int, ...] = attrs.field(converter=_ints)
    lens: tuple[int, ...] = attrs.field(converter=_ints)
    item_lens: tuple[int, ...] = attrs.field(converter=_ints)
    split_dims: tuple[int, ...] | None = attrs.field(default=None, converter=_opt_ints)

    def __attrs_post_init__(self) -> None:
        n = len(self.ptrs)
        if len(self.lens) != n or len(self.item_lens) != n:
            raise LayoutError(
                f"state component {self.type.value}: {n} pointers, {len(self.lens)} lengths, "
                f"{len(self.item_lens)} row lengths; the three lists must be parallel"
            )
        if self.split_dims is not None and len(self.split_dims) != n:
            raise LayoutError(
                f"state component {self.type.value}: split_dims has {len(self.split_dims)} "
                f"entries for {n} tensors"
            )
        for ln, item in zip(self.lens, self.item_lens):
            if item <= 0 or ln % item:
                raise LayoutError(
                    f"state component {self.type.value}: total {ln} bytes is not a whole "
                    f"number of {item}-byte rows"
                )
        for i, (dim, item) in enumerate(zip(self.split_dims or (), self.item_lens)):
            if dim < 0 or (dim and item % dim):
                raise LayoutError(
                    f"state component {self.type.value}: tensor {i} splits its {item}-byte "
                    f"rows into {dim} units; give a unit count that divides the row "
                    "(0: the tensor is held whole)"
                )

    @property
    def geometry(self) -> tuple[object, ...]:
        return (self.type, len(self.ptrs), self.item_lens, self.split_dims)


@runtime_checkable
class DescribesState(Protocol):
    """A memory pool that lists its own state components (no isinstance chains)."""

    def state_components(self) -> Sequence[StateComponent]: ...


def collect_state(*pools: object) -> tuple[StateComponent, ...]:
    """Components of every pool that describes state, in argument order."""
    out: list[StateComponent] = []
    for pool in pools:
        if isinstance(pool, DescribesState):
            out.extend(pool.state_components())
    return tuple(out)


@attrs.frozen
class KVArgs:
    """The KV-args description shared by every backend."""

    engine_rank: int
    kv_data_ptrs: tuple[int, ...] = attrs.field(converter=_ints)
    kv_data_lens: tuple[int, ...] = attrs.field(converter=_ints)
    kv_item_lens: tuple[int, ...] = attrs.field(converter=_ints)
    aux_data_ptrs: tuple[int, ...] = attrs.field(converter=_ints, default=())
    aux_data_lens: tuple[int, ...] = attrs.field(converter=_ints, default=())
    aux_item_lens: tuple[int, ...] = attrs.field(converter=_ints, default=())
    state: tuple[StateComponent, ...] = ()
    page_size: int = 1  # tokens per page
    ib_device: str | None = None
    #: KV heads of each page on this rank: a page item is page_size x kv_head_num
    #: heads of equal size, token-major (what head slicing across TP sizes cuts)
    kv_head_num: int = 1

    def __attrs_post_init__(self) -> None:
        if not len(self.kv_data_ptrs) == len(self.kv_data_lens) == len(self.kv_item_lens):
            raise LayoutError("KVArgs: kv_data_ptrs, kv_data_lens, kv_item_lens must be parallel")
        if not len(self.aux_data_ptrs) == len(self.aux_data_lens) == len(self.aux_item_lens):
            raise LayoutError(
                "KVArgs: aux_data_ptrs, aux_data_lens, aux_item_lens must be parallel"
            )
        if self.page_size < 1:
            raise LayoutError(f"KVArgs: page_size must be >= 1, got {self.page_size}")
        if self.kv_head_num < 1:
            raise LayoutError(f"KVArgs: kv_head_num must be >= 1, got {self.kv_head_num}")
        for i, item in enumerate(self.kv_item_lens):
            if item % (self.page_size * self.kv_head_num):
                raise LayoutError(
                    f"KVArgs: KV buffer {i} has {item}-byte pages, not a whole number of "
                    f"{self.page_size} tokens x {self.kv_head_num} heads"
                )

    @property
    def head_bytes(self) -> tuple[int, ...]:
        """Bytes of one head of one token, per KV buffer."""
        return tuple(it // (self.page_size * self.kv_head_num) for it in self.kv_item_lens)

    def with_state(self, *components: StateComponent) -> KVArgs:
        """A copy with ``components`` appended after the existing ones (order matters)."""
        return attrs.evolve(self, state=self.state + tuple(components))


def check_draft_geometry(target: Sequence[StateComponent], draft: Sequence[StateComponent]) -> None:
    """A draft model's state may ride along only if its geometry is the target's."""
    if len(target) != len(draft):
        raise GeometryMismatch(
            "number of state components",
            [c.type.value for c in target],
            [c.type.value for c in draft],
        )
    for t, d in zip(target, draft):
        if t.geometry != d.geometry:
            raise GeometryMismatch(f"component {t.type.value}", t.geometry, d.geometry)
