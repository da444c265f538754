"""Prefill on one host, decode on another: two network namespaces, one
torchrun node each (c10d rendezvous), Mooncake over TCP between them.

The hosts are namespaces joined by a veth pair (192.0.2.1 and 192.0.2.2,
documentation addresses that exist only inside them), so every address is
the one a real deployment would use: nothing reaches the other side on
127.0.0.1. The worked example of docs/deployment.md.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import netns
import pytest

from pdlife.cluster.config import SimConfig, Workload

pytest.importorskip("mooncake.engine", reason="pd-lifecycle[mooncake] not installed")
_why = netns.unavailable()
pytestmark = [
    pytest.mark.skipif(_why is not None, reason=_why or ""),
    pytest.mark.multiprocess,
    pytest.mark.network,
    pytest.mark.timeout(120),
]
# Two pytest-xdist workers may run these at once: each worker's namespaces
# carry its pid in their names, so two tests never share a namespace.

RDZV_PORT = 29400  # inside fresh namespaces every port is free
JOB_TIMEOUT = 75.0


def torchrun(
    host: netns.Host,
    role: str,
    out: Path,
    *args: str,
    delay: float = 0,
    backend: str = "mooncake",
) -> subprocess.Popen[str]:
    """One node of the job, as docs/deployment.md starts it (the first host,
    192.0.2.1, holds the rendezvous)."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": host.ifname, "PYTHONUNBUFFERED": "1"}
    env.pop("PDLIFE_HOST", None)
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"{netns.SUBNET}.1:{RDZV_PORT}",
        "--rdzv-id",
        "pdlife-test",
        # the endpoint's node hosts the rendezvous store: say so rather than
        # rely on torchrun matching the address against the host name
        "--rdzv-conf",
        f"is_host={int(host.addr == f'{netns.SUBNET}.1')}",
        "--local-addr",
        host.addr,
        "--max-restarts",
        "0",
    ]
    sim = [sys.executable, "-m", "pdlife", "simulate", "--backend", backend, "--quiet"]
    sim += ["--no-timeline"]  # (no test here reads the picture)
    sim += ["--role", role, "--out", str(out), *args]
    if delay:  # this node's ranks start late, as on a slow or loaded host
        argv += ["--no-python", "sh", "-c", f"sleep {delay}; exec {shlex.join(sim)}"]
    else:
        argv += sim[1:]
    return subprocess.Popen(
        host.cmd(argv), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def finish(p: subprocess.Popen[str], deadline: float) -> tuple[int, str, str]:
    try:
        out, err = p.communicate(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        pytest.fail(f"a node did not exit within {JOB_TIMEOUT} s:\n{out}\n{err[-3000:]}")
    return p.returncode, out, err


def fault_plan(path: Path, requests: int) -> Path:
    """5% of the requests fail by injection, spread over every rank and kind."""
    kinds = ["fail", "raise_in_poll", "corrupt_metadata", "fail", "drop_metadata"]
    n = requests // 20
    faults = [
        {"kind": kinds[i % len(kinds)], "rank": i % 4, "request": 7 + i * (requests // n)}
        for i in range(n)
    ]
    # metadata faults happen on decode ranks (what lands in their rows)
    for f in faults:
        if f["kind"].endswith("metadata"):
            f["rank"] = 2 + f["rank"] % 2
    path.write_text(json.dumps({"faults": faults}))
    return path


def results(out: Path) -> dict[int, dict]:
    return {
        r: json.loads((out / "ranks" / f"rank{r}.json").read_text())
        for r in range(4)
        if (out / "ranks" / f"rank{r}.json").exists()
    }


def _nixl_usable():
    try:
        import nixl_cu12  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


BACKENDS = [
    "mooncake",
    pytest.param(
        "nixl",
        marks=pytest.mark.skipif(not _nixl_usable(), reason="pd-lifecycle[nixl] not installed"),
    ),
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_and_decode_on_two_hosts(tmp_path, backend):
    out = tmp_path / "run"
    plan = fault_plan(tmp_path / "plan.json", 200)
    args = ("--requests", "200", "--abort-prob", "0.05", "--plan", str(plan), "--seed", "5")
    # the plan's two dropped metadata rows end at decode's waiting timeout: 4 s
    # instead of the default 10. A healthy request waits well under 2 s for its
    # KV here even with the machine loaded by two busy processes (under 1 s but
    # for a NIXL run's first requests, while its agents connect)
    args += ("--waiting-timeout", "4")
    # the sides follow the roles, not the node order: on NIXL the rendezvous
    # host (node 0, global ranks 0 and 1) serves decode
    roles = ("decode", "prefill") if backend == "nixl" else ("prefill", "decode")
    with netns.hosts(2) as (a, b):
        deadline = time.monotonic() + JOB_TIMEOUT
        procs = [
            torchrun(a, roles[0], out, *args, backend=backend),
            torchrun(b, roles[1], out, *args, backend=backend),
        ]
        (rc_a, out_a, err_a), (rc_b, _, err_b) = (finish(p, deadline) for p in procs)
    assert (rc_a, rc_b) == (0, 0), out_a + err_a[-3000:] + err_b[-3000:]
    assert "result: OK" in out_a  # global rank 0, whichever side it serves, summarised
    s = json.loads((out / "summary.json").read_text())
    assert s["ok"], s
    assert s["requests"] == 200
    assert s["succeeded"] + s["aborted"] + sum(s["failed"].values()) == 200
    assert s["aborted"] > 0
    assert s["succeeded"] >= 150
    # decode checked every page and metadata row it committed; a difference is a violation
    assert s["invariant_violations"] == []
    assert s["kv_bytes_verified"] >= s["succeeded"] * 2 * 2 * 256
    assert (s["disagreements"], s["leaked_slots"], s["leaked_kv_pages"], s["stuck"]) == (0,) * 4
    r = results(out)
    assert [r[i]["side"] for i in range(4)] == ["prefill", "prefill", "decode", "decode"]
    assert r[2]["outcome"] == r[3]["outcome"]  # both decode ranks, every request and reason
    assert r[0]["outcome"] == r[1]["outcome"]
    # every injected fault failed its request (or an abort got there first), on every rank
    work = Workload(SimConfig(requests=200, seed=5, abort_prob=0.05))
    for f in json.loads(plan.read_text())["faults"]:
        room = str(work[f["request"]])
        assert r[2]["outcome"][room][0] == "Failed", (f, r[2]["outcome"][room])
    for res in r.values():
        assert (res["error"], res["unfinished"], res["leaked_slots"]) == (None, 0, 0)
    replay = subprocess.run(
        [sys.executable, "-m", "pdlife", "replay", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert replay.returncode == 0, replay.stdout
    assert out_a.count("pdlife simulate:") == 1


def test_a_node_that_starts_late_is_waited_for(tmp_path):
    # joining is not a step: a node slower to start than --pg-timeout is no dead node
    out = tmp_path / "late"
    args = ("--requests", "20", "--abort-prob", "0", "--pg-timeout", "4")  # 4 s < the 7 s delay
    with netns.hosts(2) as (a, b):
        deadline = time.monotonic() + JOB_TIMEOUT
        procs = [torchrun(a, "prefill", out, *args), torchrun(b, "decode", out, *args, delay=7)]
        (rc_a, out_a, err_a), (rc_b, _, err_b) = (finish(p, deadline) for p in procs)
    assert (rc_a, rc_b) == (0, 0), out_a + err_a[-3000:] + err_b[-3000:]
    assert json.loads((out / "summary.json").read_text())["succeeded"] == 20


def run_and_kill(
    out: Path, victim: int, backend: str = "mooncake"
) -> tuple[netns.Host, netns.Host, int, str, float]:
    """Start both nodes, SIGKILL every process of host ``victim`` once it is
    well under way; (survivor, victim host, survivor's exit code, output,
    seconds from the kill to the survivor's exit)."""
    args = ("--requests", "200", "--abort-prob", "0.05", "--pg-timeout", "6")
    with netns.hosts(2) as hosts:
        deadline = time.monotonic() + JOB_TIMEOUT
        procs = [
            torchrun(h, role, out, *args, backend=backend)
            for h, role in zip(hosts, ("prefill", "decode"))
        ]
        trace = out / "trace" / f"rank{2 * victim}.jsonl"
        while time.monotonic() < deadline and procs[victim].poll() is None:
            if trace.exists() and trace.stat().st_size > 20_000:  # well under way
                break
            time.sleep(0.1)
        assert procs[victim].poll() is None, "the victim finished before it could be killed"
        assert hosts[victim].kill_all()
        t_kill = time.monotonic()
        rc, stdout, stderr = finish(procs[1 - victim], deadline)
        exit_after = time.monotonic() - t_kill
        procs[victim].wait(5)
    return hosts[1 - victim], hosts[victim], rc, stdout + stderr, exit_after


def test_a_killed_decode_host_is_named_by_the_survivors(tmp_path):
    # Mooncake: a dead NIXL peer is covered on one host (test_transfer_backends)
    out = tmp_path / "kill"
    a, b, rc, text, exit_after = run_and_kill(out, victim=1)
    assert rc != 0, text
    for r in (2, 3):
        assert f"rank {r} (decode, on {b.addr}) stopped" in text, text[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert not s["ok"]
    assert sorted(s["crashed_ranks"]) == [2, 3]
    assert len(s["rank_errors"]) == 2
    r = results(out)
    assert r[0]["outcome"] == r[1]["outcome"]  # the prefill ranks still agree on everything
    for p in (0, 1):
        assert (r[p]["error"], r[p]["unfinished"], r[p]["leaked_slots"]) == (None, 0, 0)
        assert r[p]["leaked_kv_pages"] == 0
        reasons = {reason for status, reason, *_ in r[p]["outcome"].values() if status == "Failed"}
        assert 1 in reasons  # peer dead
    # Mooncake's heartbeat (2 s) + the collector's patience (--pg-timeout 6) + teardown
    assert exit_after < 30, exit_after


def test_a_killed_prefill_host_is_named_by_the_survivors(tmp_path):
    # node 0 hosts torchrun's store: the decode ranks lose it and say whose it was
    out = tmp_path / "kill0"
    b, a, rc, text, exit_after = run_and_kill(out, victim=0)
    assert rc != 0
    # torchrun's agent on the decode host loses the rendezvous too and stops its
    # workers: each decode rank that sees the loss first says so in one line
    named = [
        r for r in (2, 3) if f"rank {r} (decode, on {b.addr}): the job's store at {a.addr}:" in text
    ]
    assert named, text[-3000:]
    assert text.count("died with rank(s) [0, 1]; exiting") == len(named)
    assert "]: Traceback" not in text  # no worker traceback (torch prefixes them "[rankN]: ")
    assert exit_after < 30, exit_after


MISCONFIGURED = r"""
import json, os, sys, time
import torch
from buffers import MetadataBuffers
from pdlife.cluster.config import SIM_LAYOUT
from transport.addressing import AddressError, advertised_host
from transport.backends.mooncake import MooncakeConfig, MooncakeManager
from transport.layout import kv_args_for

kv = kv_args_for([torch.zeros((4, 256), dtype=torch.uint8)], MetadataBuffers(4, SIM_LAYOUT).buf_infos(), 0)
me, other = sys.argv[1], sys.argv[2]
report = {
    "by_route": advertised_host(env={"MASTER_ADDR": other}),
    "by_interface": advertised_host(env={"GLOO_SOCKET_IFNAME": sys.argv[3]}),
}
cases = {
    "explicit": (dict(hostname=other + "9"), {}),
    "env": ({}, {"PDLIFE_HOST": other}),
    "store": (dict(store_host=other, store_port=29999), {}),
}
for name, (cfg, env) in cases.items():
    os.environ.update(env)
    t0 = time.monotonic()
    try:
        MooncakeManager(kv, MooncakeConfig(role="prefill", tp_rank=0, **{"store_host": me, "store_port": 1, **cfg}))
        report[name] = ("no error", 0.0)
    except AddressError as e:
        report[name] = (str(e), time.monotonic() - t0)
    for k in env:
        del os.environ[k]
print(json.dumps(report))
"""


def test_misconfigured_addresses_fail_fast_naming_the_setting():
    with netns.hosts(2) as (a, b):
        proc = subprocess.run(
            a.cmd([sys.executable, "-c", MISCONFIGURED, a.addr, b.addr, a.ifname]),
            capture_output=True,
            text=True,
            timeout=60,
            env={k: v for k, v in os.environ.items() if k not in ("PDLIFE_HOST", "MASTER_ADDR")},
        )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["by_route"] == a.addr  # the interface that reaches the store
    assert got["by_interface"] == a.addr
    msg, took = got["explicit"]
    assert msg.startswith(f"MooncakeConfig.hostname='{b.addr}9': is not an address of this host")
    msg, took_env = got["env"]
    assert msg.startswith(f"PDLIFE_HOST='{b.addr}': is not an address of this host"), msg
    msg, took_store = got["store"]
    assert msg.startswith(f"MooncakeConfig.store_host='{b.addr}:29999': the store does not answer")
    assert "Connection refused" in msg
    # an answer, not a connect timeout (the store's own is 30 s)
    assert max(took, took_env, took_store) < 5


def _work_then_fail(seen: dict) -> None:
    with netns.hosts(3) as hosts:
        seen["names"] = [h.ns for h in hosts]
        # three hosts share a bridge: the third reaches the first
        seen["listen"] = subprocess.Popen(
            hosts[0].cmd([sys.executable, "-c", LISTEN, hosts[0].addr]),
            stdout=subprocess.PIPE,
            text=True,
        )
        assert seen["listen"].stdout.readline().strip() == "ready"
        connect = f"import socket; socket.create_connection(('{hosts[0].addr}', 5000), 5).close()"
        subprocess.run(hosts[2].cmd([sys.executable, "-c", connect]), check=True, timeout=30)
        seen["sleeper"] = subprocess.Popen(hosts[1].cmd(["sleep", "600"]))
        raise RuntimeError("boom")


def test_namespaces_and_their_processes_go_even_when_the_body_fails():
    seen: dict = {}
    with pytest.raises(RuntimeError, match="boom"):
        _work_then_fail(seen)
    assert seen["sleeper"].wait(10) == -9  # killed with its namespace
    seen["listen"].wait(10)
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in left for n in seen["names"]), left


LISTEN = """
import socket, sys
s = socket.create_server((sys.argv[1], 5000))
print("ready", flush=True)
s.accept()[0].close()
"""
