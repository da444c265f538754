"""`pdlife simulate --soak` with `--metrics-port`: requests keep arriving for a
while, Prometheus answers on every rank meanwhile, RSS is sampled per rank."""

import json
import re
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip("prometheus_client")
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]


def scrape(port, openmetrics=False):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if openmetrics:  # the exposition that carries exemplars
        req.add_header("Accept", "application/openmetrics-text; version=1.0.0")
    with urllib.request.urlopen(req, timeout=2) as r:
        return r.read().decode()


def sample(text, name, **labels):
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}} ") or (not labels and line.startswith(name + " ")):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_soak_serves_metrics_and_samples_rss(tmp_path):
    out = tmp_path / "soak"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdlife",
            "simulate",
            "--backend",
            "fake",
            "--quiet",
            "--no-timeline",
            "--soak",
            "3",
            "--fail-prob",
            "0.05",
            "--metrics-port",
            "0",  # each rank binds a port the OS picks, and writes it down
            "--out",
            str(out),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    scraped, failing = {}, []
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if len(scraped) == 4 and failing:
                break
            for rank in range(4):
                if rank in scraped and (rank >= 2 or failing):
                    continue
                written = out / "ranks" / f"rank{rank}.metrics_port"
                try:
                    text = scrape(int(written.read_text()))
                except (OSError, ValueError):  # not up (or not written) yet
                    continue
                queue = "prefill/inflight" if rank < 2 else "decode/transfer"
                done = sum(
                    float(line.rsplit(" ", 1)[1])
                    for line in text.splitlines()
                    if line.startswith("pdlife_transitions_total{")
                    and f'queue="{queue}"' in line
                    and 'to="Success"' in line
                )
                if done > 0:  # requests are flowing through this rank's queues
                    scraped.setdefault(rank, text)
                    if rank < 2 and "pdlife_failures_by_origin_total{" in text:
                        failing.append(scrape(int(written.read_text()), openmetrics=True))
            time.sleep(0.2)
        stdout, stderr = proc.communicate(timeout=150)
    finally:
        proc.kill()
    assert proc.returncode == 0, stdout + stderr[-2000:]
    assert sorted(scraped) == [0, 1, 2, 3]
    for rank, text in scraped.items():
        side = "prefill" if rank < 2 else "decode"
        assert (
            sample(
                text,
                "pdlife_stuck_requests",
                queue=f"{side}/{'bootstrap' if rank < 2 else 'handshake'}",
            )
            == 0
        )
        assert "pdlife_live_requests" in text
        assert 'reason="injected fault"' in text or side == "decode"
        assert f'pdlife_step_seconds_count{{queue="{side}/' in text
    # a prefill rank's failures carry their agreed origin, and an exemplar its room
    assert failing, "no prefill rank had a failure to show when scraped"
    lines = [x for x in failing[0].splitlines() if x.startswith("pdlife_failures_by_origin_total{")]
    assert lines and all('origin="' in x and 'reason="' in x for x in lines)
    assert any(' # {room="' in x for x in lines)
    # each exemplar also names the trace of its room's spans: the run's id, the
    # same in every rank's trace, and the room give it
    from pdlife.spans.select import trace_id

    runs = {
        json.loads((out / "trace" / f"rank{r}.jsonl").open().readline())["run"] for r in range(4)
    }
    (run,) = runs
    found = [re.search(r'# \{room="(\d+)",trace_id="([0-9a-f]{32})"\}', x) for x in lines]
    found = [m for m in found if m]
    assert found and all(m[2] == f"{trace_id(run, int(m[1])):032x}" for m in found)
    s = json.loads((out / "summary.json").read_text())
    # the soak admitted what it could in 3 s and finished every one of them
    assert s["soak_s"] == 3.0
    # how many arrive in 3 s depends on the machine's load, so the check asks
    # only that requests flowed (each rank's scrape above saw a Success)
    assert s["requests"] >= 4
    assert s["stuck"] == 0 and s["disagreements"] == 0 and s["leaked_slots"] == 0
    assert s["succeeded"] + s["aborted"] + sum(s["failed"].values()) == s["requests"]
    assert len(s["outcomes"]) == s["requests"]
    for rank in "0123":
        samples = s["rss_mb"][rank]
        # one at the start and one at the end, and one a second (rss_every) in
        # between: a 3 s soak has at least one whole second inside it
        assert len(samples) >= 3
        assert all(mb > 50 and blocks > 1000 for _, _, mb, blocks in samples)
        assert [x[0] for x in samples] == sorted(x[0] for x in samples)
        assert samples[-1][1] == s["requests"]
        assert rank in s["rss_growth_after_warmup"]


@pytest.mark.timeout(120)
def test_a_soak_with_prefill_dp_groups_stops_every_group_at_one_request(run_sim):
    """Prefill DP group 0 sets the soak's pace; group 1 and decode follow it, so
    all stop at the same request and each group finishes exactly its share."""
    args = ["--soak", "1", "--prefill", "1", "--prefill-dp", "2", "--decode", "1"]
    proc, s, out = run_sim("fake", "soakdp", *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert s["ok"] and (s["leaked_slots"], s["stuck"], s["disagreements"]) == (0, 0, 0)
    n = s["requests"]
    # how many arrive in the soak depends on the machine's load (48 to ~1000
    # seen in a 0.5 s soak; this one runs 1 s); the split below needs only a
    # few requests per group
    assert n >= 4 and s["succeeded"] + s["aborted"] + sum(s["failed"].values()) == n
    ranks = [json.loads((out / "ranks" / f"rank{r}.json").read_text()) for r in range(3)]
    assert [len(r["outcome"]) for r in ranks] == [len(range(0, n, 2)), len(range(1, n, 2)), n]


def test_a_transport_soak_serves_legs_by_peer_and_pages_by_state(tmp_path):
    """On Mooncake, each rank counts its legs by peer (decode's by prefill peer,
    prefill's by decode peer: done, and their time), its side's requests by
    state and its KV pages by what pins them, while the run goes on."""
    from engines import engine_env, require

    backend = require("mooncake")
    out = tmp_path / "legs"
    argv = [sys.executable, "-m", "pdlife", "simulate", "--backend", backend, "--quiet",
            "--no-timeline", "--soak", "3", "--metrics-port", "0", "--out", str(out)]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=engine_env())  # fmt: skip
    side = {0: "prefill", 1: "prefill", 2: "decode", 3: "decode"}
    seen: dict[int, str] = {}
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and proc.poll() is None and len(seen) < 4:
            for rank in side:
                try:
                    text = scrape(int((out / "ranks" / f"rank{rank}.metrics_port").read_text()))
                except (OSError, ValueError):
                    continue
                # (the exposition writes labels in name order: sample() is asked in it)
                legs = sum(
                    sample(text, "pdlife_peer_legs_total", outcome="done", peer=str(p),
                           side=side[rank]) or 0
                    for p in (0, 1)
                )  # fmt: skip
                if legs > 0 and rank not in seen:
                    seen[rank] = text
            time.sleep(0.2)
        stdout, stderr = proc.communicate(timeout=150)
    finally:
        proc.kill()
    assert proc.returncode == 0, stdout + stderr[-2000:]
    assert sorted(seen) == [0, 1, 2, 3], "a rank never showed a leg done"
    for rank, text in seen.items():
        s = side[rank]
        # TP 2 -> 2: each rank's leg goes to one peer, each with its time
        assert 'pdlife_peer_leg_seconds_count{peer="' in text
        assert sample(text, "pdlife_kv_pages", side=s, state="fenced") == 0
        assert sample(text, "pdlife_kv_pages", side=s, state="held") is not None
        for state in ("Bootstrapping", "WaitingForInput", "Transferring", "Success"):
            assert sample(text, "pdlife_requests", side=s, state=state) is not None
        assert sample(text, "pdlife_requests", side=s, state="fenced") == 0
        assert sample(text, "pdlife_requests", side=s, state="quarantined") is not None
