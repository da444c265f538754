"""Every setting is checked before anything runs.

Each field of ConnectorConfig, FakeConfig, Topology, KVArgs (and the
StateComponent it holds) and SimConfig, given a value of the wrong type, out of range, or not
fitting the others, is refused with a typed error naming the field; each flag
of ``pdlife simulate`` and ``pdlife bench-transfer`` likewise exits 2 with one
line naming it. Nothing -- a thread, a socket, a process, an engine -- is
started by any of them.

The fields and flags are enumerated (``attrs.fields``, the parser's actions):
one added later without bad values here fails the coverage tests.
"""

from __future__ import annotations

import contextlib
import json
import math
import multiprocessing.process
import os
import re
import socket
import subprocess
import threading
from multiprocessing import forkserver

import attrs
import pytest
import torch

from buffers import BuffersError, MetadataBuffers, MetadataLayout
from buffers.errors import BadSetting
from buffers.kv_args import KVArgs, StateComponent, StateType
from pdlife.args import SimConfigError, UsageError
from pdlife.cli import build_parser, main
from pdlife.cluster.config import SimConfig
from pdlife.cluster.plan_doc import FaultPlan, TargetedFault
from support.stub_engine import CopyConnector
from transport.backends.fake import FakeConfig
from transport.connector.config import MAX_SECONDS, ConnectorConfig
from transport.errors import ConfigError, TransportError
from transport.layout import kv_args_for
from transport.topology import Topology, TopologyError, TopologySettingError

NAN, INF = math.nan, math.inf


# -- nothing starts ---------------------------------------------------------------------------
def _open_fds() -> set[tuple[str, str]]:
    """This process's descriptors and what each is open on. Compared as sets: a
    descriptor an earlier test left to the garbage collector may close at any
    moment, which is not this test opening one."""
    out = set()
    for fd in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else ():
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed already
            out.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
    return out


@pytest.fixture
def nothing_starts(monkeypatch):
    """Any thread, socket connection or bind, process or forkserver started
    fails the test; the thread and descriptor counts are compared after."""

    def started(what):
        def refuse(*_a, **_k):
            raise AssertionError(f"{what} was started for a refused setting")

        return refuse

    monkeypatch.setattr(threading.Thread, "start", started("a thread"))
    monkeypatch.setattr(socket.socket, "connect", started("a socket connection"))
    monkeypatch.setattr(socket.socket, "bind", started("a socket bind"))
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", started("a process"))
    monkeypatch.setattr(subprocess.Popen, "__init__", started("a subprocess"))
    monkeypatch.setattr(forkserver, "ensure_running", started("the forkserver"))
    threads, fds = threading.active_count(), _open_fds()
    yield
    # fewer is not more: a thread an earlier test started may end meanwhile
    assert threading.active_count() <= threads
    assert _open_fds() - fds == set(), "a descriptor was opened for a refused setting"


# -- bad values, by kind ----------------------------------------------------------------------
# each entry: (value, whether it is of the wrong type: a TypeError too)
def ints(lo, hi=None, none=False):
    out = [(True, True), (1.5, True), (float(lo), True), (str(lo), True), (lo - 1, False)]
    out += [(hi + 1, False)] if hi is not None else []
    return out + ([] if none else [(None, True)])


def secs(lo=0.0, hi=MAX_SECONDS, none=False, above=True):
    out = [(True, True), ("1", True), (NAN, False), (INF, False), (-INF, False)]
    out += [(lo if above else lo - 1e-3, False), (-1, False), (hi * 2, False)]
    return out + ([] if none else [(None, True)])


FLAG = [("no", True), (1, True), (0, True), (None, True)]


def text(none=False, extra=()):
    out = [(3, True), ("", False), ("a b", False), (b"x", True), *extra]
    return out + ([] if none else [(None, True)])


def int_list(lo):
    """A list field of integers >= lo."""
    return [(5, True), ("1", True), ([1.5], True), ([True], True), ([lo - 1], False), (None, True)]


# -- the classes: valid fields, bad values per field, and combinations -------------------------
CONNECTOR = dict(role="decode", tp_rank=0, store_port=29500)
CONNECTOR_BAD = {
    "role": text(extra=[("sender", False), ("Prefill", False)]),
    "tp_rank": ints(0),
    "tp_size": ints(1),
    "dp_rank": ints(0),
    "mla": FLAG,
    "kv_heads": ints(1, none=True),
    "staging": FLAG,
    "staging_pages": ints(1),
    "scatter_pages": ints(1),
    "store_host": text(),
    "store_port": ints(1, 65535),
    "hostname": text(none=True),
    "store_wait": secs(above=False),
    "namespace": text(extra=[("a/b", False)]),
    "heartbeat_interval": [*secs(lo=0.001, above=False), (0, False), (1e-9, False)],
    "heartbeat_misses": ints(2),
    "bootstrap_timeout": secs(none=True),
    "waiting_timeout": secs(none=True),
    "poll_interval": secs(),
    "idle_interval": secs(),
    "drain_timeout": secs(),
    "progress_delay_us": ints(0, 1_000_000),
    "nixl_threads": ints(0, 64),
    "digest": FLAG,
}
CONNECTOR_MISFITS = [
    (dict(tp_rank=2, tp_size=2), "tp_rank"),
    (dict(kv_heads=3, tp_size=2), "kv_heads"),
    (dict(kv_heads=4, tp_size=8, tp_rank=7, staging=True), None),  # replicated heads: fine
    (dict(poll_interval=0.1, idle_interval=0.05), "poll_interval"),
]

TOPOLOGY = dict(prefill_tp=2, decode_tp=4, kv_heads=4)
TOPOLOGY_BAD = {
    "prefill_tp": ints(1),
    "decode_tp": ints(1),
    "kv_heads": ints(1),
    "mla": FLAG,
    "split_state": FLAG,
}
TOPOLOGY_MISFITS = [
    (dict(prefill_tp=3, decode_tp=1, kv_heads=4), "kv_heads"),
    (dict(prefill_tp=2, decode_tp=3, kv_heads=2), "kv_heads"),
    (dict(prefill_tp=3, decode_tp=5, kv_heads=4, mla=True), None),  # MLA: any sizes
]

KV = dict(engine_rank=0, kv_data_ptrs=[4096], kv_data_lens=[1024], kv_item_lens=[64])
KV_BAD = {
    "engine_rank": ints(0),
    "kv_data_ptrs": [*int_list(0), ([2**64], False)],
    "kv_data_lens": int_list(1),
    "kv_item_lens": int_list(1),
    "aux_data_ptrs": int_list(0),
    "aux_data_lens": int_list(1),
    "aux_item_lens": int_list(1),
    "state": [(5, True), ("x", True), ([object()], True), (None, True)],
    "page_size": ints(1),
    "ib_device": text(none=True),
    "kv_head_num": ints(1),
    "heads_major": FLAG,
    "head_group": ints(0),
}
KV_MISFITS = [
    (dict(kv_data_lens=[1024, 1024]), "kv_data_lens"),  # not parallel to the pointers
    (dict(aux_data_ptrs=[1], aux_data_lens=[64]), "aux_item_lens"),
    (dict(page_size=3), "kv_item_lens"),  # 64-byte pages are not 3 tokens
    (dict(kv_head_num=128), "kv_item_lens"),
    (dict(kv_data_lens=[1000]), "kv_data_lens"),  # not a whole number of pages
    (dict(kv_data_ptrs=[1, 2], kv_data_lens=[1024, 2048], kv_item_lens=[64, 64]), "kv_data_lens"),
    (dict(aux_data_ptrs=[1], aux_data_lens=[100], aux_item_lens=[64]), "aux_data_lens"),
    (dict(kv_head_num=4, head_group=3), "head_group"),  # groups must cut the heads evenly
    (dict(kv_head_num=4, head_group=2, heads_major=True), "head_group"),  # token-major only
    (dict(kv_head_num=4, head_group=2), None),
]

STATE = dict(type=StateType.MAMBA, ptrs=[0, 4096], lens=[640, 640], item_lens=[64, 64])
STATE_BAD = {
    "type": [("mamba", True), (0, True), (None, True)],
    "ptrs": int_list(0),
    "lens": int_list(1),
    "item_lens": int_list(1),
    "split_dims": [
        (5, True),
        ([1.5, 1], True),
        ([-1, 0], False),
        ([True, 0], True),
        ([(2, 0)], False),
        ([()], False),
        ([(1.5, 2)], True),
    ],
}
STATE_MISFITS = [
    (dict(lens=[640]), "lens"),
    (dict(split_dims=[8]), "split_dims"),
    (dict(lens=[100, 640]), "lens"),
    (dict(split_dims=[5, 0]), "split_dims"),
    (dict(split_dims=[(3, 2)]), "split_dims"),
]

SIM = dict(backend="fake")
SIM_BAD = {
    "prefill": ints(1),
    "decode": ints(1),
    "prefill_dp": ints(1),
    "mla": FLAG,
    "kv_heads": ints(1, none=True),
    "page_size": ints(1),
    "state": FLAG,
    "state_split": FLAG,
    "staging": FLAG,
    "staging_pages": ints(0),
    "prefix_pages": ints(0),
    "requests": ints(1, 2**62),
    "seed": ints(0, 2**63 - 1),
    "abort_prob": [(True, True), ("0.1", True), (NAN, False), (-0.1, False), (1.5, False)],
    "arrival": ints(1),
    "max_pages": ints(1),
    "chunk_pages": ints(1),
    "metadata_slots": ints(1, 1 << 24),
    "kv_pages": ints(1),
    "max_steps": ints(1, 2**31 - 1),
    "bootstrap_timeout": ints(1),
    "waiting_timeout": ints(1),
    "bootstrap_timeout_s": secs(),
    "waiting_timeout_s": secs(),
    "stuck_after": ints(1, 1 << 40),
    "backend": text(extra=[("auto", False), ("tcp", False)]),
    "pg_timeout": secs(hi=86400.0),
    "timeline": FLAG,
    "live_spans": FLAG,
    "metrics_port": ints(0, 65535, none=True),
    "plan": [(None, True), ({"faults": []}, True), ("plan.json", True)],
    "fault_mode": text(extra=[("sometimes", False)]),
    "soak": secs(none=True),
    "max_live": ints(1),
    "rss_every": secs(),
    "recovery": text(extra=[("sometimes", False), ("Retry", False)]),
    "max_attempts": ints(1, 1 << 15),
    "corrupt_prob": [(True, True), ("0.1", True), (NAN, False), (-0.1, False), (1.5, False)],
    "digest": FLAG,
}
SIM_MISFITS = [
    (dict(prefill=40, decode=30), "prefill"),
    (dict(prefill=2, prefill_dp=20, decode=30), "prefill_dp"),
    (dict(decode=63), "decode"),
    (dict(mla=True, kv_heads=8), "kv_heads"),
    (dict(prefill=4, kv_heads=3), "kv_heads"),
    (dict(state_split=True), "state_split"),
    (dict(prefill=3, state=True, state_split=True), "state_split"),
    (dict(max_pages=2000), "max_pages"),
    (dict(prefix_pages=32), "prefix_pages"),
    (dict(staging_pages=40), "staging_pages"),
    (dict(staging=True, staging_pages=8), "staging_pages"),
    (dict(staging=True, staging_pages=5000), "staging_pages"),
    (dict(metrics_port=65534), "metrics_port"),
    (dict(page_size=10**6), "page_size"),
    (dict(kv_heads=10**6), "kv_heads"),
    (dict(plan=FaultPlan(faults=(TargetedFault("kill_rank", 9, step=5),))), "plan"),
    (dict(plan=FaultPlan(faults=(TargetedFault("fail", 0, request=500),))), "plan"),
]

#: class -> (valid fields, bad values per field, combinations, the error it raises)
FAKE_BAD = {
    "bootstrap_timeout": [(-1.0, False), ("5", True), (NAN, False), (INF, False)],
    "waiting_timeout": [(-0.5, False), (True, True), (NAN, False)],
    "peer_alive": [(True, True), (5, True)],
    "clock": [(None, True), (3.0, True)],
}
CLASSES = {
    ConnectorConfig: (CONNECTOR, CONNECTOR_BAD, CONNECTOR_MISFITS, ConfigError),
    FakeConfig: ({}, FAKE_BAD, [], ConfigError),
    Topology: (
        TOPOLOGY,
        TOPOLOGY_BAD,
        TOPOLOGY_MISFITS,
        TopologySettingError,
    ),
    KVArgs: (KV, KV_BAD, KV_MISFITS, BadSetting),
    StateComponent: (STATE, STATE_BAD, STATE_MISFITS, BadSetting),
    SimConfig: (SIM, SIM_BAD, SIM_MISFITS, SimConfigError),
}
BASE = {ConfigError: TransportError, TopologySettingError: TopologyError}
BASE |= {BadSetting: BuffersError, SimConfigError: UsageError}


def _cases():
    for cls, (_, bad, _, _) in CLASSES.items():
        for field, values in bad.items():
            for value, wrong_type in values:
                # an id that is the same in every process (no object addresses)
                shown = re.sub(r" at 0x[0-9a-f]+", "", repr(value))
                yield pytest.param(
                    cls, field, value, wrong_type, id=f"{cls.__name__}.{field}={shown}"
                )


def _misfits():
    for cls, (_, _, misfits, _) in CLASSES.items():
        for i, (over, field) in enumerate(misfits):
            yield pytest.param(cls, over, field, id=f"{cls.__name__}-{i}-{field}")


def _refused(cls, kwargs, field):
    error = CLASSES[cls][3]
    with pytest.raises(error) as info:
        cls(**kwargs)
    e = info.value
    assert isinstance(e, BASE[error])
    assert e.field == field or e.field.startswith(f"{field}["), str(e)
    assert f"{cls.__name__}.{e.field}" in str(e)
    assert "\n" not in str(e) and "expected" in str(e)
    return e


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_field_has_bad_values_and_the_valid_ones_build(cls):
    good, bad, _, _ = CLASSES[cls]
    assert {f.name for f in attrs.fields(cls)} == set(bad)
    cls(**good)


@pytest.mark.parametrize(("cls", "field", "value", "wrong_type"), list(_cases()))
def test_a_bad_field_is_refused_by_name(cls, field, value, wrong_type, nothing_starts):
    e = _refused(cls, {**CLASSES[cls][0], field: value}, field)
    assert isinstance(e, TypeError) == wrong_type, str(e)
    if e.field == field:  # (an element's error shows the element)
        assert repr(value)[:20] in str(e)


@pytest.mark.parametrize(("cls", "over", "field"), list(_misfits()))
def test_fields_that_do_not_fit_together_are_refused(cls, over, field, nothing_starts):
    kwargs = {**CLASSES[cls][0], **over}
    if field is None:
        cls(**kwargs)
    else:
        assert not isinstance(_refused(cls, kwargs, field), TypeError)


def test_numpy_integers_are_integers_and_become_python_ints():
    import numpy as np

    kv = KVArgs(np.int64(0), np.array([4096]), [np.int32(1024)], (64,), page_size=np.int8(1))
    assert kv.kv_data_ptrs == (4096,) and type(kv.kv_data_lens[0]) is int
    assert ConnectorConfig(role="prefill", tp_rank=np.int64(0), store_port=np.uint16(80))


# -- a connector: its config against its KVArgs, before anything starts -------------------------
def _kv(pages=8, aux=True, heads=1, heads_major=False, head_group=0):
    shape = (heads // head_group, pages, 64 * head_group) if head_group else (pages, 64 * heads)
    kv = [torch.zeros(shape, dtype=torch.uint8)]
    layout = MetadataLayout(hidden_size=32, hidden_dtype=torch.float32, max_top_logprobs=16)
    infos = MetadataBuffers(4, layout).buf_infos() if aux else ([], [], [])
    args = kv_args_for(
        kv, infos, 0, kv_head_num=heads, heads_major=heads_major, head_group=head_group
    )
    return args, kv


@pytest.mark.parametrize(
    ("kv", "over", "field", "error"),
    [
        (dict(heads=2), dict(tp_size=2, kv_heads=2), "kv_heads", TopologySettingError),
        (dict(aux=False), dict(staging=True), "staging", ConfigError),
        (dict(pages=8), dict(staging=True, staging_pages=9), "staging_pages", ConfigError),
        # a head-major page's slice is one run already: nothing to gather
        (dict(heads_major=True), dict(staging=True), "staging", ConfigError),
        # nor is a head group of pages cut in head groups
        (dict(heads=2, head_group=1), dict(staging=True, kv_heads=2), "staging", ConfigError),
    ],
)
def test_a_connector_checks_its_config_against_its_kv_args_first(
    kv, over, field, error, nothing_starts
):
    args, _ = _kv(**kv)
    with pytest.raises(error) as info:
        CopyConnector(args, ConnectorConfig(**{**CONNECTOR, **over}))
    assert info.value.field == field


def test_a_connector_refuses_what_is_not_a_config_or_kv_args(nothing_starts):
    args, _ = _kv()
    with pytest.raises(ConfigError, match=r"Connector\.config"):
        CopyConnector(args, dict(CONNECTOR))
    with pytest.raises(ConfigError, match=r"Connector\.kv_args"):
        CopyConnector(object(), ConnectorConfig(**CONNECTOR))


# -- the command lines ----------------------------------------------------------------------
def _plan_file(d, body):
    path = d / f"plan{abs(hash(json.dumps(body)))}.json"
    path.write_text(json.dumps(body))
    return str(path)


# dest -> bad command lines (after the command); {d} is a scratch directory
SIMULATE_BAD = {
    "prefill": [["--prefill-tp", "0"], ["--prefill-tp", "1.5"], ["--prefill", "x"]],
    "decode": [["--decode-tp", "-1"], ["--decode-tp", "2.0"], ["--decode-tp", "40", "--prefill-tp", "40"]],
    "prefill_dp": [["--prefill-dp", "0"], ["--prefill-dp", "40"]],
    "mla": [["--mla=yes"]],
    "kv_heads": [["--kv-heads", "0"], ["--kv-heads", "3"], ["--kv-heads", "1000000"], ["--mla", "--kv-heads", "8"]],
    "page_size": [["--page-size", "0"], ["--page-size", "nan"], ["--page-size", "1000000"]],
    "state": [["--state=1"]],
    "state_split": [["--state-split"], ["--state", "--state-split", "--prefill-tp", "3"], ["--state-split=x"]],
    "staging": [["--staging=no"]],
    "staging_pages": [["--staging-pages", "8"], ["--staging", "--staging-pages", "4"], ["--staging", "--staging-pages", "5000"], ["--staging-pages", "0"]],
    "prefix_pages": [["--prefix-pages", "-1"], ["--prefix-pages", "32"]],
    "max_pages_per_request": [["--max-pages-per-request", "0"], ["--max-pages-per-request", "2000"]],
    "requests": [["--requests", "0"], ["--requests", "1e3"], ["--requests", str(2**70)], ["--soak", "5", "--requests", "9"]],
    "seed": [["--seed", "-1"], ["--seed", str(2**63)]],
    "fail_prob": [["--fail-prob", "1.5"], ["--fail-prob", "nan"], ["--fail-prob", "inf"]],
    "abort_prob": [["--abort-prob", "-0.1"], ["--abort-prob", "x"]],
    "fault_mode": [["--fault-mode", "sometimes"]],
    "recovery": [["--recovery", "sometimes"]],
    "max_attempts": [["--max-attempts", "0"], ["--max-attempts", "x"], ["--max-attempts", str(1 << 16)]],
    "corrupt_prob": [["--corrupt-prob", "1.5"], ["--corrupt-prob", "nan"], ["--corrupt-prob", "0.1", "--backend", "fake"]],
    "digest": [["--digest=yes"]],
    "peer_outage": [["--peer-outage", "0:5"], ["--peer-outage", "3:5:2"], ["--peer-outage", "0:5:9999"], ["--peer-outage", "0:5:2", "--pause-rank", "1"]],
    "otlp_traces_endpoint": [["--otlp-traces-endpoint", "ftp://h/v1/traces"], ["--otlp-traces-endpoint", "localhost:4318"], ["--otlp-traces-endpoint", "http://"]],
    "plan": [["--plan", "{d}/missing.json"], ["--plan", "{d}/late.json"]],
    "kill_rank": [["--kill-rank", "4"], ["--kill-rank", "-1"]],
    "kill_step": [["--kill-step", "3"], ["--kill-rank", "1", "--kill-step", "0"], ["--kill-rank", "1", "--kill-step", "11", "--max-steps", "10"]],
    "pause_rank": [["--pause-rank", "4"]],
    "pause_step": [["--pause-step", "3"], ["--pause-rank", "1", "--pause-step", "99", "--max-steps", "10"]],
    "pause_seconds": [["--pause-rank", "1", "--pause-seconds", "0"], ["--pause-rank", "1", "--pause-seconds", "7200"], ["--pause-rank", "1", "--pause-seconds", "nan"]],
    "backend": [["--backend", "tcp"], ["--backend", ""]],
    "max_steps": [["--max-steps", "0"], ["--max-steps", "2.5"], ["--max-steps", str(2**31)]],
    "soak": [["--soak", "0"], ["--soak", "inf"], ["--soak", "1e12"]],
    "timeout": [["--timeout", "-1"], ["--timeout", "nan"], ["--timeout", "1e300"]],
    "pg_timeout": [["--pg-timeout", "0"], ["--pg-timeout", "100000"], ["--pause-rank", "1", "--pause-seconds", "20", "--pg-timeout", "10"]],
    "waiting_timeout": [["--waiting-timeout", "0"], ["--waiting-timeout", "nan"], ["--waiting-timeout", "3", "--backend", "fake"]],
    "out": [["--out", "{d}/afile/sub"]],
    "metrics_port": [["--metrics-port", "-1"], ["--metrics-port", "65535"], ["--metrics-port", "x"]],
    "compare": [["--compare", "{d}/nowhere", "{d}"], ["--compare", "{d}"]],
    "quiet": [["--quiet=1"]],
    "timeline": [["--timeline=1"]],
    "live_spans": [["--live-spans=1"]],
    "verbose": [["--verbose=1"]],
    "role": [["--role", "sender"], ["--role", "prefill"]],
}  # fmt: skip
BENCH_BAD = {
    "backend": [["--backend", "fake"], ["--backend", "mooncake", "--unavailable"]],
    "mib": [["--mib", "0"], ["--mib", "1.5"], ["--mib", "100000000"]],
    "page_kib": [["--page-kib", "0"], ["--page-kib", "100"], ["--mib", "1", "--page-kib", "2048"],
                 ["--prefill-tp", "2", "--page-kib", "32"]],
    "reps": [["--reps", "0"], ["--reps", "x"], ["--reps", "5000"]],
    "json": [["--json", "{d}/nowhere/x.json"], ["--json", "{d}"]],
    "timeline": [["--timeline", "{d}/nowhere/t.json"], ["--timeline", "{d}"]],
    "verbose": [["--verbose=1"]],
    "buffers": [["--buffers", "0"], ["--buffers", "3"], ["--mib", "1", "--buffers", "2048"]],
    "shuffle": [["--shuffle=1"]],
    "prefill_tp": [["--prefill-tp", "0"], ["--prefill-tp", "3"], ["--kv-heads", "3", "--prefill-tp", "2"]],
    "decode_tp": [["--decode-tp", "0"], ["--decode-tp", "3"]],
    "page_tokens": [["--page-tokens", "0"], ["--mib", "1", "--page-tokens", "4096"]],
    "head_dim": [["--head-dim", "0"], ["--mib", "1", "--head-dim", "100000"]],
    "kv_heads": [["--kv-heads", "0"], ["--kv-heads", "x"], ["--mib", "1", "--kv-heads", "4096"]],
    "layout": [["--layout", "diagonal"], ["--layout", "head"], ["--layout", "group"]],
    "step_us": [["--step-us", "0"], ["--step-us", "0.5"], ["--step-us", "2000000"]],
    "staging": [["--staging=1"], ["--staging"], ["--staging", "--kv-heads", "8"], ["--staging", "--prefill-tp", "2", "--layout", "head"], ["--staging", "--prefill-tp", "2", "--layout", "group"]],
    "digest": [["--digest=1"]],
}  # fmt: skip
COMMANDS = {"simulate": SIMULATE_BAD, "bench-transfer": BENCH_BAD}


def _actions(command):
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return {a.dest: a for a in sub.choices[command]._actions if a.dest != "help"}


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_has_bad_values(command):
    assert set(_actions(command)) == set(COMMANDS[command])


def _flag_cases():
    for command, table in COMMANDS.items():
        for dest, argvs in table.items():
            for argv in argvs:
                yield pytest.param(command, dest, argv, id=f"{command} {' '.join(argv)}")


@pytest.mark.parametrize(("command", "dest", "argv"), list(_flag_cases()))
def test_a_bad_flag_exits_2_with_one_line_naming_it(
    command, dest, argv, tmp_path, capsys, monkeypatch, nothing_starts
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SGLANG_TEST_DISAGG_FAILURE_PROB", "")
    (tmp_path / "afile").write_text("")
    late = {"faults": [{"kind": "kill_rank", "rank": 1, "step": 5000}]}
    (tmp_path / "late.json").write_text(json.dumps(late))
    argv = [a.replace("{d}", str(tmp_path)) for a in argv]
    if "--unavailable" in argv:  # a backend that does not load here
        from transport.errors import BackendUnavailable

        def unavailable(name):
            raise BackendUnavailable(name, "its package is not installed", "install it")

        monkeypatch.setattr("transport.registry.get_backend", unavailable)
        argv.remove("--unavailable")
    if command == "simulate" and "--out" not in argv and "--compare" not in argv:
        argv += ["--out", str(tmp_path / "out")]
    rc = main([command, *argv])
    cap = capsys.readouterr()
    lines = cap.err.strip().splitlines()
    assert rc == 2, cap.err
    assert len(lines) == 1, cap.err
    assert "Traceback" not in cap.err + cap.out
    names = _actions(command)[dest].option_strings
    assert any(n in lines[0] for n in names), (names, lines[0])
    assert not (tmp_path / "out").exists()  # not even the output directory


def test_the_guard_sees_what_starts(nothing_starts):
    """Negative control: the fixture refuses a thread, a socket, a process."""
    with pytest.raises(AssertionError, match="a thread"):
        threading.Thread(target=print).start()
    with socket.socket() as s, pytest.raises(AssertionError, match="a socket bind"):
        s.bind(("127.0.0.1", 0))
    with pytest.raises(AssertionError, match="a process"):
        multiprocessing.process.BaseProcess.start(None)
