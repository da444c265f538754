"""SGLang 0.5.23's own PD queues on two gloo ranks: its utils functions, then ours.

Driven, on CPU, with stand-ins only for the connection, the staging handler,
the scheduler's other parts and the runtime context (tests/field/queue_standins.py):

- decode: ``SchedulerDisaggregationDecodeMixin.process_decode_queue``, which
  runs ``DecodePreallocQueue.pop_preallocated`` (``_update_handshake_waiters``,
  the abort pass, preallocation into SGLang's ``DecodeReqToTokenPool`` and
  ``TokenToKVPoolAllocator``, ``_send_kv_metadata``),
  ``DecodeTransferQueue.pop_transferred`` (the metadata gate, or staging with
  the gate; commit; failure; deferred release) and
  ``resolve_deferred_releases``; requests enter through
  ``DecodePreallocQueue.add``; an AbortReq takes the decode branch of the
  scheduler's ``abort_request``;
- prefill: ``PrefillBootstrapQueue.add`` and ``pop_bootstrapped``, then
  ``SchedulerDisaggregationPrefillMixin.process_disagg_prefill_inflight_queue``
  (with its ``handle_bootstrap_failure`` and
  ``handle_inflight_transfer_failure``), over the attention TP group, or the
  CP group, of two ranks.

Each scenario runs with SGLang's functions, then with every name those
modules import from SGLang's utils that ``field.utils`` provides patched in
(the poll functions, ``all_reduce_flags``, ``prepare_abort``, ``is_aborted``,
``is_unadmitted_reject``, ...), and the scheduler building our
``MetadataBuffers`` and ``ReqToMetadataIdxAllocator``. Poll values are scripted
per rank and per iteration. After every iteration each rank records what each
queue holds, what it popped, which requests finished by an abort and what was
released; the two runs must give the same records on each rank, and the ranks
the same records as each other. Where docs/compat.md says ours is stricter,
separate tests check its rule; a negative control (our poll with the metadata
gate left out) must be caught.

All of it runs in one pair of rank processes (SGLang's import takes most of
the time), shared by the tests of this module.
"""

from __future__ import annotations

import logging
import traceback
import warnings
from typing import Any

import pytest
from queue_standins import Spec, outcome

from lifecycle.testing.spawn import run_ranks

DECODE_ITERATIONS = 7
PREFILL_ITERATIONS = 6

#: name -> (requests, run_decode keywords, each room's expected fate under SGLang)
DECODE: dict[str, tuple[list[Spec], dict[str, Any], dict[int, tuple[str, int]]]] = {
    "late_metadata": (
        [
            Spec(101, land=(3, 4)),  # rank 1's row lands an iteration after rank 0's
            Spec(102),
            Spec(103, land=(5, 3)),  # rank 0's lands two after rank 1's
        ],
        {},
        {101: ("popped", 4), 102: ("popped", 3), 103: ("popped", 5)},
    ),
    "failed_on_one_rank": (
        [
            Spec(201, fail=(None, 2)),  # rank 1's transfer fails in the transfer queue
            Spec(202, hs=2, fail=(1, None)),  # rank 0's handshake fails in the prealloc queue
            Spec(203, fail=(3, None)),  # Failed on rank 0 as rank 1 reports Success
            Spec(204),
        ],
        {},
        {201: ("aborted", 2), 202: ("aborted", 1), 203: ("aborted", 3), 204: ("popped", 3)},
    ),
    "abort": (
        [
            Spec(301, hs=2, abort=0),  # AbortReq while bootstrapping (prealloc queue)
            Spec(302, done=5, abort=2),  # AbortReq while transferring (transfer queue)
            Spec(303, done=5, abort=(2, None)),  # the receiver aborts on rank 0 only
            Spec(304, reject=True),  # rejected at intake: to_finish set, retired at add
            Spec(305, hs=3, abort=1, pp_abort=True),  # receiver abort and prepare_abort
            Spec(306),
        ],
        {},
        {
            301: ("aborted", 0),
            302: ("aborted", 2),
            303: ("aborted", 2),
            304: ("retired", 0),
            305: ("aborted", 1),
            306: ("popped", 3),
        },
    ),
    "staging": (
        [
            Spec(401, staged=True, scatter=(3, 4)),  # rank 1's scatter finishes later
            Spec(402, staged=True, done=5, stage_fail=(None, 3)),  # rank 1's staging times out
            Spec(403),  # not staged
            Spec(404, staged=True, scatter=3, land=(5, 3)),  # staged, rank 0's row late
        ],
        {"staging": True},
        {401: ("popped", 4), 402: ("aborted", 3), 403: ("popped", 3), 404: ("popped", 5)},
    ),
    "metadata_never_lands": (
        [
            Spec(501, land=None),  # on no rank: 0.5.23 waits
            Spec(502, land=(3, None)),  # on rank 0 only
            Spec(503),
        ],
        {},
        {501: ("queued", 6), 502: ("queued", 6), 503: ("popped", 3)},
    ),
}

#: name -> (requests, metadata rows, each room's expected fate under SGLang)
PREFILL: dict[str, tuple[list[Spec], int, dict[int, tuple[str, int]]]] = {
    "late_bootstrap": (
        [
            Spec(1101, hs=(1, 2), done=4),  # rank 1's peer arrives an iteration later
            Spec(1102, done=(3, 4)),  # rank 1's transfer ends an iteration later
            Spec(1103),
        ],
        8,
        {1101: ("popped", 4), 1102: ("popped", 4), 1103: ("popped", 3)},
    ),
    "failed_on_one_rank": (
        [
            Spec(1201, hs=2, fail=(None, 1)),  # rank 1's bootstrap fails
            Spec(1202, done=4, fail=(3, None)),  # rank 0's transfer fails, inflight
            Spec(1203),
        ],
        8,
        {1201: ("aborted", 1), 1202: ("aborted", 3), 1203: ("popped", 3)},
    ),
    "abort": (
        [
            Spec(1301, hs=3, abort=1),  # AbortReq in the bootstrap queue
            Spec(1302, done=5, abort=2),  # AbortReq in the inflight queue
            Spec(1303, reject=True),  # rejected at intake
            Spec(1304, done=5, abort=(None, 2)),  # the sender aborts on rank 1 only
            Spec(1305),
        ],
        8,
        {
            1301: ("aborted", 1),
            1302: ("aborted", 2),
            1303: ("retired", 0),
            1304: ("aborted", 2),
            1305: ("popped", 3),
        },
    ),
    "never_done_and_no_metadata_row": (
        [
            Spec(1401, done=None),  # decode never reports its KV: stays inflight
            Spec(1402, done=2),
            Spec(1403, done=(4, 3)),  # waits for a metadata row (two rows, both taken)
        ],
        2,
        {1401: ("queued", 5), 1402: ("popped", 2), 1403: ("popped", 4)},
    ),
}
LAYOUTS = ("tp2", "cp2")  # the two ranks are the attention TP group, or the CP group

#: ours is stricter here (docs/compat.md): checked against its rule, not against SGLang
STRICT: dict[str, list[Spec]] = {
    "row_of_another_room": [Spec(601, wrong_room=(None, 999)), Spec(602)],
    "poll_raises_on_one_rank": [Spec(701, raise_at=(None, 2)), Spec(702)],
}

#: the negative control: our poll with its metadata gate left out
CONTROL = ("late_metadata", "metadata_never_lands")


def _ungated(pollers, gloo_group, decode_reqs=None, metadata_buffers=None, server_args=None):
    import field.utils as ours

    return ours.poll_and_all_reduce(pollers, gloo_group)


def _rank_main(rank: int, world: int) -> dict[str, Any]:
    warnings.simplefilter("ignore")
    logging.disable(logging.ERROR)  # the queues log each failure and abort they handle
    import queue_standins as qs
    import sglang.srt.disaggregation.decode as decode
    import sglang.srt.disaggregation.prefill as prefill
    import sglang.srt.disaggregation.utils as sgl
    import sglang.srt.managers.schedule_batch as schedule_batch

    import field.utils as ours

    g = qs.groups(rank)
    names = {
        m.__name__: [n for n in qs.our_names(m) if n != "get_kv_class"] for m in (decode, prefill)
    }
    ours_in = [(m, n, getattr(ours, n)) for m in (decode, prefill) for n in names[m.__name__]]
    context = [
        *[
            (m, "get_parallel", lambda: qs.parallel_context(rank, g["world"]))
            for m in (decode, prefill, schedule_batch)
        ],
        (decode, "get_disagg", qs.disagg_config),
        (decode, "get_memory", qs.memory_config),
        (prefill, "get_disagg", qs.disagg_config),
        # the connection classes are the scripted stand-ins, in both runs
        (decode, "get_kv_class", qs.get_kv_class),
        (prefill, "get_kv_class", qs.get_kv_class),
    ]
    impls = {"sglang": (sgl, []), "ours": (ours, ours_in)}
    out: dict[str, Any] = {"names": names, "decode": {}, "prefill": {}, "strict": {}}
    failed: list[str] = []

    def run(where: dict[str, Any], key: str, label: str, fn) -> None:
        if failed:  # after an error the ranks' collectives may be out of step
            where[key] = {"error": f"not run: {failed[0]} raised first"}
            return
        try:
            where[key] = fn()
        except Exception as e:
            failed.append(label)
            where[key] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}

    with qs.patched(context):
        for name, (specs, kw, _) in DECODE.items():
            runs = out["decode"][name] = {}
            for impl, (mod, pairs) in impls.items():
                with qs.patched(pairs):
                    run(
                        runs,
                        impl,
                        f"decode {name} ({impl})",
                        lambda mod=mod, specs=specs, kw=kw: qs.run_decode(
                            rank, specs, mod, g["world"], DECODE_ITERATIONS, **kw
                        ),
                    )
        for name, (specs, rows, _) in PREFILL.items():
            for layout in LAYOUTS:
                tp, cp = (g["world"], g["one"]) if layout == "tp2" else (g["one"], g["world"])
                runs = out["prefill"][f"{name}-{layout}"] = {}
                for impl, (mod, pairs) in impls.items():
                    with qs.patched(pairs):
                        run(
                            runs,
                            impl,
                            f"prefill {name}-{layout} ({impl})",
                            lambda mod=mod, specs=specs, tp=tp, cp=cp, rows=rows: qs.run_prefill(
                                rank, specs, mod, tp, cp, PREFILL_ITERATIONS, metadata_rows=rows
                            ),
                        )
        for name, specs in STRICT.items():
            runs = out["strict"][name] = {}
            for impl, (mod, pairs) in impls.items():
                if name == "poll_raises_on_one_rank" and impl == "sglang":
                    continue  # SGLang's poll raises on rank 1 and leaves rank 0 in the reduce
                with qs.patched(pairs):
                    run(
                        runs,
                        impl,
                        f"strict {name} ({impl})",
                        lambda mod=mod, specs=specs: qs.run_decode(
                            rank, specs, mod, g["world"], DECODE_ITERATIONS
                        ),
                    )
        for label, index in (("minus_one", -1), ("none", None)):
            runs = out["strict"][f"index_{label}"] = {}
            for impl, (mod, pairs) in impls.items():
                with qs.patched(pairs):
                    run(
                        runs,
                        impl,
                        f"strict index {label} ({impl})",
                        lambda mod=mod, index=index: qs.gate_on_index(rank, index, mod),
                    )
        control = out["control"] = {}
        broken = [*ours_in, (decode, "poll_and_all_reduce", _ungated)]
        for name in CONTROL:
            specs, kw, _ = DECODE[name]
            with qs.patched(broken):
                run(
                    control,
                    name,
                    f"control {name}",
                    lambda specs=specs, kw=kw: qs.run_decode(
                        rank, specs, ours, g["world"], DECODE_ITERATIONS, **kw
                    ),
                )
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(_rank_main, 2, timeout=170)


def _ok(run: Any, what: str) -> list[dict[str, Any]]:
    if isinstance(run, dict) and "error" in run:
        pytest.fail(f"{what}: {run['error']}\n{run.get('traceback', '')}", pytrace=False)
    return run


def _first_difference(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> str | None:
    for ra, rb in zip(a, b):
        if ra != rb:
            keys = [k for k in ra if ra[k] != rb.get(k)]
            return f"iteration {ra['it']}: " + "; ".join(f"{k}: {ra[k]} vs {rb[k]}" for k in keys)
    if len(a) != len(b):
        return f"{len(a)} records vs {len(b)}"
    return None


#: what a rank does on its own: its staging handler's scatter calls follow its own transfers
RANK_LOCAL = ("staging_advanced",)


def _agreed(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in rec.items() if k not in RANK_LOCAL} for rec in records]


def _same_everywhere(ranks: list[dict[str, Any]], side: str, name: str) -> list[Any]:
    """SGLang's and ours give the same records on each rank; the ranks agree."""
    runs = [
        {
            impl: _ok(r[side][name][impl], f"rank {i} {side} {name} ({impl})")
            for impl in ("sglang", "ours")
        }
        for i, r in enumerate(ranks)
    ]
    for i, by_impl in enumerate(runs):
        diff = _first_difference(by_impl["sglang"], by_impl["ours"])
        assert diff is None, f"rank {i}, SGLang's functions vs ours: {diff}"
    for impl in ("sglang", "ours"):
        diff = _first_difference(*(_agreed(runs[i][impl]) for i in (0, 1)))
        assert diff is None, f"{impl}: rank 0 vs rank 1: {diff}"
    return runs


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", list(DECODE))
def test_decode_queues_give_the_same_records_with_our_functions(ranks, name):
    runs = _same_everywhere(ranks, "decode", name)
    # the scenario did what it says (under SGLang's functions, hence under ours)
    assert outcome(runs[0]["sglang"], "decode") == DECODE[name][2]


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", list(PREFILL))
def test_prefill_queues_give_the_same_records_with_our_functions(ranks, name, layout):
    runs = _same_everywhere(ranks, "prefill", f"{name}-{layout}")
    assert outcome(runs[0]["sglang"], "prefill") == PREFILL[name][2]


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_ours_replaced_every_name_the_queues_import_that_we_provide(ranks):
    names = ranks[0]["names"]
    decode = names["sglang.srt.disaggregation.decode"]
    prefill = names["sglang.srt.disaggregation.prefill"]
    for n in (
        "poll_and_all_reduce",
        "poll_and_all_reduce_with_staging",
        "all_reduce_flags",
        "prepare_abort",
        "is_unadmitted_reject",
        "MetadataBuffers",
        "ReqToMetadataIdxAllocator",
    ):
        assert n in decode
    for n in (
        "poll_and_all_reduce_attn_cp_tp_group",
        "prepare_abort",
        "is_aborted",
        "is_unadmitted_reject",
    ):
        assert n in prefill


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_row_carrying_another_rooms_id_fails_the_request_on_every_rank(ranks):
    """docs/compat.md: a row that carries another request's non-zero room fails the
    request, agreed. Under 0.5.23 the gate lets it through (the row is not 0) and
    each rank's commit decides alone: rank 0, whose row is right, admits the
    request while rank 1 aborts it, and the ranks' queues part."""
    ours = [_ok(r["strict"]["row_of_another_room"]["ours"], "ours") for r in ranks]
    sglang = [_ok(r["strict"]["row_of_another_room"]["sglang"], "sglang") for r in ranks]
    assert _first_difference(ours[0], ours[1]) is None
    for records in ours:
        assert outcome(records, "decode") == {601: ("aborted", 3), 602: ("popped", 3)}
    assert outcome(sglang[0], "decode")[601] == ("popped", 3)
    assert outcome(sglang[1], "decode")[601] == ("aborted", 3)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_metadata_index_of_minus_one_or_none_fails_the_request(ranks):
    """docs/compat.md: an index outside the buffers fails the request, agreed. Through
    DecodeTransferQueue._poll_with_metadata_gate, 0.5.23 reads row -1 (the last row,
    another request's, landed) as this request's and reports Success; with None it
    raises from indexing."""
    for r in ranks:
        strict = r["strict"]
        assert _ok(strict["index_minus_one"]["ours"], "ours") == ("statuses", [0])
        assert _ok(strict["index_none"]["ours"], "ours") == ("statuses", [0])
        assert _ok(strict["index_minus_one"]["sglang"], "sglang") == ("statuses", [4])
        assert _ok(strict["index_none"]["sglang"], "sglang")[0] == "raised"


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_poll_that_raises_on_one_rank_fails_its_request_on_every_rank(ranks):
    """docs/compat.md: a poller that raises fails only its request, on every rank
    (0.5.23's raises on that rank between two collectives; not run)."""
    ours = [_ok(r["strict"]["poll_raises_on_one_rank"]["ours"], "ours") for r in ranks]
    assert _first_difference(ours[0], ours[1]) is None
    assert outcome(ours[0], "decode") == {701: ("aborted", 2), 702: ("popped", 3)}


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", CONTROL)
def test_negative_control_a_poll_without_the_metadata_gate_is_caught(ranks, name):
    for i, r in enumerate(ranks):
        broken = _ok(r["control"][name], f"rank {i} control {name}")
        sglang = _ok(r["decode"][name]["sglang"], f"rank {i} {name} (sglang)")
        assert _first_difference(sglang, broken) is not None, (
            f"rank {i}: a poll without the metadata gate gave SGLang's records in {name}"
        )
