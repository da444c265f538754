"""Every public name of 0.5.23's utils.py and base/conn.py: present here with the
same signature, or out of scope with its reason.

The names come from the installed package (names.defined_names). A signature
is the same when 0.5.23's parameters are ours, in order, with the same kinds
and defaults; ours may add parameters after them, each with a default (the
seed's ``server_args``, for one). An enum is the same when ours has every one
of its members with the same value. ``python -m pytest tests/field/test_names.py
-s`` prints the table.
"""

from __future__ import annotations

import enum
import importlib
import inspect

import pytest
from names import defined_names

#: 0.5.23 module -> ours
HOMES = {
    "sglang.srt.disaggregation.utils": "field.utils",
    "sglang.srt.disaggregation.base.conn": "field.conn.base",
}

_LAYOUT = "a model-layout helper an engine keeps importing from SGLang"
OUT_OF_SCOPE = {
    "build_dsa_tail_transfer_blocks": f"DSA: {_LAYOUT}",
    "get_dsa_seed_metadata_dim": f"DSA: {_LAYOUT}",
    "get_dsa_tail_state_indices": f"DSA: {_LAYOUT}",
    "slice_dsa_tail_dst_ptrs_for_pp": f"DSA: {_LAYOUT}",
    "get_qsa_pending_state_indices": f"QSA: {_LAYOUT}",
    "compute_mamba_state_slice_blocks": f"Mamba slicing: {_LAYOUT}",
    "compute_mamba_state_slice_byte_blocks": f"Mamba slicing: {_LAYOUT}",
    "get_dsv41_spec_layout": f"DeepSeek V4: {_LAYOUT}",
    "get_pd_kv_layout": f"DeepSeek V4 (reads its token-to-KV pool class): {_LAYOUT}",
    "get_kv_transfer_buf_infos": f"reads SGLang's pool classes (MiniMax sparse pool): {_LAYOUT}",
    "build_kv_layer_ids": f"layer ids of SGLang's target and draft pools: {_LAYOUT}",
    "build_staging_slot_metadata": f"SGLang's staging pools' slot layout: {_LAYOUT}",
    "build_transfer_entry_pairs": f"layer-entry pairing of SGLang's pools: {_LAYOUT}",
    "is_elided_entry": f"layer-entry elision of SGLang's pools: {_LAYOUT}",
    "resolve_dcp_dst_entry_indices": f"decode context parallel layer entries: {_LAYOUT}",
    "unified_memory_disagg_move_gate": "hardware-only path: the unified-memory pool's compaction gate",
}


def _params(sig: inspect.Signature) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


def _signature(obj: object) -> inspect.Signature | None:
    try:
        return inspect.signature(obj)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def _compare(theirs: object, ours: object) -> str:
    """'' when ours takes what theirs takes, else what differs."""
    if isinstance(theirs, type) and issubclass(theirs, enum.Enum):
        if not (isinstance(ours, type) and issubclass(ours, enum.Enum)):
            return "not an enum here"
        missing = [m.name for m in theirs if ours.__members__.get(m.name) is None]
        wrong = [
            m.name
            for m in theirs
            if m.name in ours.__members__ and ours.__members__[m.name].value != m.value
        ]
        return f"members missing {missing}, values differ {wrong}" if missing or wrong else ""
    if isinstance(theirs, type) and _constants(theirs):  # a class of int constants (KVPoll)
        want = _constants(theirs)
        got = {k: getattr(ours, k, None) for k in want}
        return "" if got == want else f"constants {got} here, {want} there"
    if not callable(theirs):
        return "" if theirs == ours else f"value {ours!r} here, {theirs!r} there"
    a, b = _signature(theirs), _signature(ours)
    if a is None or b is None:
        return ""
    pa, pb = _params(a), _params(b)
    if pb[: len(pa)] != pa:
        return f"signature {b} here, {a} there"
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    extra = [
        p.name
        for p in list(b.parameters.values())[len(pa) :]
        if p.default is p.empty and p.kind not in variadic
    ]
    if extra:
        return f"extra required parameters here: {extra}"
    return ""


def _constants(cls: type) -> dict[str, int]:
    """The public int attributes a plain class defines itself (none for an enum)."""
    if issubclass(cls, enum.Enum):
        return {}
    return {
        k: v
        for k, v in vars(cls).items()
        if not k.startswith("_") and isinstance(v, int) and not isinstance(v, bool)
    }


def _rows() -> list[tuple[str, str, str, str]]:
    rows = []
    for home, mine in HOMES.items():
        theirs_mod = importlib.import_module(home)
        ours_mod = importlib.import_module(mine)
        for entry in defined_names(theirs_mod):
            name = entry.name
            if name in OUT_OF_SCOPE:
                rows.append((home, name, "out of scope", OUT_OF_SCOPE[name]))
                continue
            if not hasattr(ours_mod, name):
                rows.append((home, name, "MISSING", ""))
                continue
            diff = _compare(getattr(theirs_mod, name), getattr(ours_mod, name))
            rows.append((home, name, "DIFFERS" if diff else "same", diff))
    return rows


def test_every_name_is_here_with_its_signature_or_out_of_scope() -> None:
    rows = _rows()
    print("\n| module | name | here | note |\n|---|---|---|---|")
    for home, name, state, note in rows:
        print(f"| `{home.rsplit('.', 1)[-1]}` | `{name}` | {state} | {note} |")
    counts = {s: sum(1 for r in rows if r[2] == s) for s in ("same", "out of scope")}
    print(f"\n{len(rows)} names: {counts}")
    bad = [r for r in rows if r[2] in ("MISSING", "DIFFERS")]
    assert bad == [], bad
    assert len(rows) >= 49


@pytest.mark.parametrize("name", sorted(OUT_OF_SCOPE))
def test_out_of_scope_names_exist_there(name: str) -> None:
    """An out-of-scope entry names a real 0.5.23 name (no stale list)."""
    utils = importlib.import_module("sglang.srt.disaggregation.utils")
    assert hasattr(utils, name)
