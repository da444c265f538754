"""Phase-keyed faults: the same seed fails the same requests, for the same
reasons, on every run and every backend (200 requests, 5% failures per rank,
5% client aborts), on the fake backend, Mooncake and NIXL."""

import json

import pytest
import zygote

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]


def _usable(module):
    try:
        __import__(module)
    except (ImportError, OSError):
        return False
    return True


BACKENDS = [
    pytest.param("fake", id="fake"),
    pytest.param(
        "mooncake",
        id="mooncake",
        marks=pytest.mark.skipif(
            not _usable("mooncake.engine"),
            reason="Mooncake engine not usable here (pd-lifecycle[mooncake], Debian's libibverbs1)",
        ),
    ),
    pytest.param(
        "nixl",
        id="nixl",
        marks=pytest.mark.skipif(
            not _usable("nixl_cu12"), reason="NIXL not usable here (pd-lifecycle[nixl])"
        ),
    ),
]
ARGS = ("--requests", "200", "--fail-prob", "0.05", "--abort-prob", "0.05", "--seed", "11")


def pdlife(*args, timeout=300, fresh=False):
    return zygote.run(*args, timeout=timeout, fresh=fresh)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    done = {}

    def get(backend, n):
        if (backend, n) not in done:
            out = tmp_path_factory.mktemp(f"{backend}{n}")
            # the fake backend's first run in a fresh interpreter: its string-hash
            # seed differs from the zygote's, whose children run the others
            fresh = (backend, n) == ("fake", 1)
            proc = pdlife(
                "simulate",
                "--backend",
                backend,
                "--quiet",
                "--no-timeline",
                "--out",
                str(out),
                *ARGS,
                fresh=fresh,
            )
            assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
            done[backend, n] = (out, json.loads((out / "summary.json").read_text()))
        return done[backend, n]

    return get


def check_against_plan(s):
    """Every request ends as its phase-keyed decisions say: the winner's kind
    and reason, or Success when nothing was drawn for it."""
    assert s["fault_mode"] == "phase"
    assert len(s["outcomes"]) == s["requests"] == 200
    winners = {str(d["room"]): d for d in s["fault_decisions"] if d["wins"]}
    want = {
        room: ["Success", "none", 1]  # (one attempt: no recovery)
        if room not in winners
        else ["Failed", "aborted" if winners[room]["kind"] == "abort" else "injected fault", 1]
        for room in s["outcomes"]
    }
    assert s["outcomes"] == want
    failed = sum(1 for o in want.values() if o[1] == "injected fault")
    aborted = sum(1 for o in want.values() if o[1] == "aborted")
    assert s["failed"] == ({"injected fault": failed} if failed else {})
    assert s["aborted"] == aborted
    assert s["succeeded"] == 200 - failed - aborted
    # about 5% per rank on 4 ranks, and 5% aborts: both well represented
    assert 15 < failed < 70 and 3 < aborted < 25
    assert {d["phase"] for d in winners.values()} == {
        "Bootstrapping",
        "WaitingForInput",
        "Transferring",
    }
    assert (s["disagreements"], s["leaked_slots"], s["stuck"]) == (0, 0, 0)


def test_same_seed_twice_same_outcomes(run):
    # on the fake backend; each byte-moving backend is held to the fake's
    # outcomes below, so to the same seed's on every run
    (out1, s1), (out2, s2) = run("fake", 1), run("fake", 2)
    check_against_plan(s1)
    assert s1["outcomes"] == s2["outcomes"]
    assert s1["fault_decisions"] == s2["fault_decisions"]
    proc = pdlife("simulate", "--compare", str(out1), str(out2))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "the 200 requests end the same" in proc.stdout


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b.values[0] != "fake"])
def test_backend_matches_the_fake_backend(backend, run):
    (fake_out, fake), (out, s) = run("fake", 1), run(backend, 1)
    check_against_plan(s)
    assert s["outcomes"] == fake["outcomes"]
    proc = pdlife("simulate", "--compare", str(fake_out), str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_step_mode_differs_and_compare_names_the_first_request(run, tmp_path):
    fake_out, fake = run("fake", 1)
    out = tmp_path / "step"
    proc = pdlife(
        "simulate",
        "--backend",
        "fake",
        "--quiet",
        "--no-timeline",
        "--out",
        str(out),
        *("--fault-mode", "step", *ARGS),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    step = json.loads((out / "summary.json").read_text())
    assert step["fault_mode"] == "step" and step["fault_decisions"] == []
    first = next(
        r for r in sorted(fake["outcomes"], key=int) if fake["outcomes"][r] != step["outcomes"][r]
    )
    proc = pdlife("simulate", "--compare", str(fake_out), str(out))
    assert proc.returncode == 1
    assert f"first: room {first}:" in proc.stdout
