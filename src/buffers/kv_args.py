"""What a transfer engine needs to know about the memory it moves.

Both sides build the same description: KV page buffers, auxiliary (metadata)
buffers and, for models with more per-request state than KV pages, a list of
state components appended in the same order on both sides.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import attrs

from buffers.checks import Checks, int_tuple, is_int
from buffers.errors import BadSetting, BadSettingType, GeometryMismatch

__all__ = [
    "StateType",
    "StateComponent",
    "KVArgs",
    "DescribesState",
    "collect_state",
    "check_draft_geometry",
    "group_pieces",
]


class StateType(enum.Enum):
    MAMBA = "mamba"
    SWA = "swa"
    SWA_RING = "swa_ring"
    C128_STATE = "c128_state"
    DSA = "dsa"
    MINIMAX_INDEX_K = "minimax_index_k"


_CHECK = Checks(BadSetting, BadSettingType)
_U64 = 2**64 - 1
#: pointers are addresses (what a transfer engine registers), lengths whole bytes
_PTRS = _CHECK.ints(0, _U64, noun="addresses (integers)")
_LENS = _CHECK.ints(1, _U64, noun="byte counts (integers)")


def _state_type(inst: Any, attr: Any, value: Any) -> None:
    if not isinstance(value, StateType):
        names = ", ".join(f"StateType.{t.name}" for t in StateType)
        _CHECK.fail(inst, attr.name, value, f"a StateType ({names})", wrong_type=True)


def _split_dims(value: Any) -> Any:
    """None, or a tuple whose entries are ints or (a row of TP-split blocks)
    tuples of ints; anything else is left for the validator to refuse."""
    if value is None:
        return None
    out = int_tuple(value)
    if isinstance(out, tuple):
        out = tuple(int_tuple(x) if isinstance(x, list | tuple | range) else x for x in out)
    return out


_SPLIT_EACH = "an integer >= 0 (units; 0: held whole) or a list of integers >= 1 (units per block)"


def _split_check(inst: Any, attr: Any, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, tuple):
        _CHECK.fail(inst, attr.name, value, f"None or a list of {_SPLIT_EACH}", wrong_type=True)
    for i, x in enumerate(value):
        if isinstance(x, tuple):
            if not x:
                _CHECK.fail(inst, f"{attr.name}[{i}]", x, "at least one block")
            for j, u in enumerate(x):
                if not is_int(u):
                    _CHECK.fail(inst, f"{attr.name}[{i}][{j}]", u, "an integer", wrong_type=True)
                if u < 1:
                    _CHECK.fail(inst, f"{attr.name}[{i}][{j}]", u, "units >= 1 per block")
        elif not is_int(x):
            _CHECK.fail(inst, f"{attr.name}[{i}]", x, _SPLIT_EACH, wrong_type=True)
        elif x < 0:
            _CHECK.fail(inst, f"{attr.name}[{i}]", x, _SPLIT_EACH)


def split_blocks(dims: Any, i: int) -> tuple[int, ...]:
    """Tensor ``i``'s units per TP-split block of its row, in row order (one
    block for a plain count); () for a tensor held whole."""
    if dims is None:
        return ()
    d = dims[i]
    if isinstance(d, list | tuple):
        return tuple(int(u) for u in d)
    return (int(d),) if d else ()


def _states(value: Any) -> Any:
    return tuple(value) if isinstance(value, list | tuple) else value


def _components(inst: Any, attr: Any, value: Any) -> None:
    allowed = "a list or tuple of StateComponent"
    if not isinstance(value, tuple):
        _CHECK.fail(inst, attr.name, value, allowed, wrong_type=True)
    for i, c in enumerate(value):
        if not isinstance(c, StateComponent):
            _CHECK.fail(inst, f"{attr.name}[{i}]", c, "a StateComponent", wrong_type=True)


@attrs.frozen
class StateComponent:
    """One kind of per-request state: parallel lists of tensors' pointers,
    total bytes and bytes per row, plus optional per-tensor split dims for TP
    resharding: ``split_dims[i]`` is how many units of its rows' outermost
    dimension tensor ``i`` holds on this rank (a mamba state's ``heads / tp``,
    say), the rank's share ``[r * units, (r + 1) * units)`` of the whole; 0
    marks a tensor every rank holds whole. A row that TP splits block by block
    (a conv state ``[q|k|v]``: rank ``r`` holds its share of each block, one
    after the other) gives a list, the units of each block this rank holds, in
    row order: ``split_dims=[(q_units, k_units, v_units)]``. Without split dims
    every tensor is held whole."""

    type: StateType = attrs.field(validator=_state_type)
    ptrs: tuple[int, ...] = attrs.field(converter=int_tuple, validator=_PTRS)
    lens: tuple[int, ...] = attrs.field(converter=int_tuple, validator=_LENS)
    item_lens: tuple[int, ...] = attrs.field(converter=int_tuple, validator=_LENS)
    #: None: every tensor is held whole
    split_dims: tuple[int | tuple[int, ...], ...] | None = attrs.field(
        default=None, converter=_split_dims, validator=_split_check
    )

    def __attrs_post_init__(self) -> None:
        n, comp = len(self.ptrs), f"state component {self.type.value}"
        kind = f"of {comp}"
        for name in ("lens", "item_lens", "split_dims"):
            got = getattr(self, name)
            if got is not None and len(got) != n:
                _CHECK.fail(self, name, got, f"{n} entries, parallel to the {n} ptrs {kind}")
        for i, (ln, item) in enumerate(zip(self.lens, self.item_lens)):
            if ln % item:
                _CHECK.fail(
                    self,
                    f"lens[{i}]",
                    ln,
                    f"a whole number of {item}-byte rows (tensor {i} {kind})",
                )
        for i, (dim, item) in enumerate(zip(self.split_dims or (), self.item_lens)):
            units = sum(split_blocks(self.split_dims, i))
            if units and item % units:
                _CHECK.fail(
                    self,
                    f"split_dims[{i}]",
                    dim,
                    f"a unit count that divides the row: tensor {i} splits its {item}-byte "
                    f"rows into {units} units ({comp}; 0: the tensor is held whole)",
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
    """The KV-args description shared by every backend.

    Every field is checked as it is built (a :class:`~buffers.errors.BadSetting`
    naming the field, or ``BadSettingType`` for a wrong type): pointers are
    integers in 0..2**64-1, lengths at least 1, the lists of a kind parallel,
    each buffer a whole number of its pages (rows), every KV buffer as many
    pages and every aux buffer as many rows as the first (one page or slot
    index addresses them all), and each page a whole number of
    ``page_size`` x ``kv_head_num`` heads."""

    engine_rank: int = attrs.field(validator=_CHECK.integer(0))
    kv_data_ptrs: tuple[int, ...] = attrs.field(converter=int_tuple, validator=_PTRS)
    kv_data_lens: tuple[int, ...] = attrs.field(converter=int_tuple, validator=_LENS)
    kv_item_lens: tuple[int, ...] = attrs.field(converter=int_tuple, validator=_LENS)
    aux_data_ptrs: tuple[int, ...] = attrs.field(converter=int_tuple, validator=_PTRS, default=())
    aux_data_lens: tuple[int, ...] = attrs.field(converter=int_tuple, validator=_LENS, default=())
    aux_item_lens: tuple[int, ...] = attrs.field(converter=int_tuple, validator=_LENS, default=())
    state: tuple[StateComponent, ...] = attrs.field(
        converter=_states, validator=_components, default=()
    )
    page_size: int = attrs.field(default=1, validator=_CHECK.integer(1))  # tokens per page
    ib_device: str | None = attrs.field(
        default=None, validator=_CHECK.text(none="the engine's default device")
    )
    #: KV heads of each page on this rank: a page item is page_size x kv_head_num
    #: heads of equal size (what head slicing across TP sizes cuts)
    kv_head_num: int = attrs.field(default=1, validator=_CHECK.integer(1))
    #: the order of a page's heads: False, token-major (each token's heads one after
    #: the other: a page is (page_size, kv_head_num, head bytes)); True, head-major
    #: (each head's tokens one after the other: (kv_head_num, page_size, head
    #: bytes)), so that a rank's slice of a page is one run. Both sides must agree.
    heads_major: bool = attrs.field(default=False, validator=_CHECK.flag())
    #: KV heads per head-group region: 0 (the default), a page is one block of the
    #: buffer (laid out as ``heads_major`` says); k >= 1, each KV buffer is cut into
    #: ``kv_head_num / k`` regions one after the other, region g holding heads
    #: ``[g*k, (g+1)*k)`` of every page as (pages, page_size, k, head bytes), so a
    #: head group of consecutive pages is one run. k divides kv_head_num; token-major
    #: only. Both sides must give the same k.
    head_group: int = attrs.field(default=0, validator=_CHECK.integer(0))

    def __attrs_post_init__(self) -> None:
        for kind in ("kv", "aux"):
            ptrs = getattr(self, f"{kind}_data_ptrs")
            for name in (f"{kind}_data_lens", f"{kind}_item_lens"):
                got = getattr(self, name)
                if len(got) != len(ptrs):
                    _CHECK.fail(
                        self, name, got, f"{len(ptrs)} entries, parallel to {kind}_data_ptrs"
                    )
        if self.head_group and self.kv_head_num % self.head_group:
            _CHECK.fail(
                self,
                "head_group",
                self.head_group,
                f"0 (no head groups) or a head count that divides kv_head_num "
                f"({self.kv_head_num}): a page's heads are cut into whole groups",
            )
        if self.head_group and self.heads_major:
            _CHECK.fail(
                self,
                "head_group",
                self.head_group,
                "0 with head-major pages (heads_major=True): a head-group region is "
                "token-major, (pages, page_size, head_group, head bytes)",
            )
        unit = self.page_size * self.kv_head_num
        for i, item in enumerate(self.kv_item_lens):
            if item % unit:
                _CHECK.fail(
                    self,
                    f"kv_item_lens[{i}]",
                    item,
                    f"a multiple of page_size x kv_head_num ({unit}): KV buffer {i} has "
                    f"{item}-byte pages, not a whole number of {self.page_size} tokens x "
                    f"{self.kv_head_num} heads",
                )
        # a page (a metadata slot) is one index into every buffer of its kind
        for kind, lens, items, unit_name in (
            ("kv_data_lens", self.kv_data_lens, self.kv_item_lens, "pages"),
            ("aux_data_lens", self.aux_data_lens, self.aux_item_lens, "rows"),
        ):
            counts = [n // item for n, item in zip(lens, items)]
            for i, (n, item) in enumerate(zip(lens, items)):
                if n % item or counts[i] != counts[0]:
                    _CHECK.fail(
                        self,
                        f"{kind}[{i}]",
                        n,
                        f"a whole number of its {item}-byte {unit_name}, as many as buffer "
                        f"0's {counts[0]} (one index addresses every buffer)",
                    )

    @property
    def head_bytes(self) -> tuple[int, ...]:
        """Bytes of one head of one token, per KV buffer."""
        return tuple(it // (self.page_size * self.kv_head_num) for it in self.kv_item_lens)

    @property
    def head_groups(self) -> int:
        """Regions each KV buffer is cut into (1 without head groups)."""
        return self.kv_head_num // self.head_group if self.head_group else 1

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


def group_pieces(head: int, count: int, group: int) -> list[tuple[int, int, int]]:
    """Heads ``[head, head + count)`` of a page cut where its head groups of
    ``group`` heads break (``KVArgs.head_group``): (group, first head in the
    group, heads) per piece, in order."""
    cuts = [head, *range((head // group + 1) * group, head + count, group), head + count]
    return [(lo // group, lo % group, hi - lo) for lo, hi in itertools.pairwise(cuts)]
