"""``pdlife why ROOM RUN`` on a seeded run (tests/support/seeded_plan.py): a
staging gate held on one prefill rank names that rank and gate; a transfer
error on one prefill rank names its reason and origin (the peer) on both
sides."""

import json

import pytest
import zygote

from pdlife.why import explain, why
from support.seeded_plan import ARGS, FAILED, HELD, HOLDER, PEER, PLAN, REQUESTS, rooms
from support.trace_events import problems

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(200)]


def test_why_names_the_gate_the_rank_and_the_failures_origin(run_sim, tmp_path):
    (tmp_path / "plan.json").write_text(json.dumps(PLAN))
    proc, s, out = run_sim("fake", "why", *ARGS, "--plan", str(tmp_path / "plan.json"))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert s["faults_fired"] == 2
    rooms_ = rooms()

    held = why(out, rooms_[HELD])
    gated = [h for h in held.holds if h.gates]
    assert gated and all(h.side == "prefill" and h.holders == (HOLDER,) for h in gated)
    assert {g for h in gated for g in h.gates} == {(HOLDER, "staging")}
    assert held.outcome == ("Success", "none", 1)
    text = "\n".join(explain(held))
    assert f"held at Transferring by rank {HOLDER} (prefill)" in text
    assert f"rank {HOLDER}'s poll said Success, its staging gate held it" in text

    failed = why(out, rooms_[FAILED])
    fails = [m for m in failed.moves if m[4] == "Failed"]
    assert {m[1] for m in fails} == {"prefill", "decode"}  # both sides, one reason
    assert {m[6] for m in fails} == {"transfer error"}
    # prefill agreed on the peer whose transfer broke; decode, on the rank of its
    # own that heard it from prefill (an origin is a rank of the side's own group)
    assert {m[7] for m in fails if m[1] == "prefill"} == {PEER}
    assert {m[7] for m in fails if m[1] == "decode"} <= {2, 3}
    text = "\n".join(explain(failed))
    assert f"-> Failed (transfer error, origin rank {PEER} (prefill))" in text
    assert f"fault fired: transfer_error on rank {PEER} (prefill)" in text

    # the command: one line per finding, exit 0; a room the run never saw: exit 1
    cli = zygote.run("why", str(rooms_[HELD]), str(out), timeout=60)
    assert cli.returncode == 0 and "staging gate held it" in cli.stdout
    assert zygote.run("why", "77", str(out), timeout=60).returncode == 1

    # the same run as a Perfetto trace: well formed, the hold on its rank
    cli = zygote.run("trace", "export", "--perfetto", str(out), "-o", str(tmp_path / "p.json"))
    assert cli.returncode == 0, cli.stderr
    doc = json.loads((tmp_path / "p.json").read_text())
    assert problems(doc) == []
    holds = {(e["pid"], e["args"]["room"]) for e in doc["traceEvents"] if e["ph"] == "i"}
    assert (HOLDER, rooms_[HELD]) in holds
    assert sum(e["ph"] == "s" for e in doc["traceEvents"]) >= REQUESTS - 1  # flows drawn
    # and drawn: the held and the failed room first
    from pdlife.trace_picture import draw

    assert set(draw(doc, tmp_path / "p.png", most=2)) == {rooms_[HELD], rooms_[FAILED]}
    cli = zygote.run("trace", "picture", str(tmp_path / "p.json"), timeout=60)
    assert cli.returncode == 0 and "4 room(s) drawn" in cli.stdout, cli.stderr
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_why_names_the_peer_whose_leg_failed_on_a_transport(run_sim):
    """On Mooncake decode's legs are traced by prefill peer (and prefill's by
    decode peer). Prefill rank 1
    stops for 6 s (past decode's dead-peer bound of at most 3 s): the requests
    in flight fail (peer dead), and each one's lines name the leg that failed
    for it, decode rank 3's to prefill rank 1, and not rank 2's to the live
    prefill rank 0. In a clean run a request shows both legs done, timed."""
    from engines import require

    backend = require("mooncake")
    args = ["--requests", "40", "--abort-prob", "0", "--peer-outage", "1:3:6"]
    proc, s, out = run_sim(backend, "why-legs", *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    dead = [int(r) for r, o in s["outcomes"].items() if o[:2] == ["Failed", "peer dead"]]
    assert dead, "the outage failed no request in flight"
    for room in dead:
        w = why(out, room)
        blamed = {
            (leg["rank"], leg["peer"], leg["outcome"]) for leg in w.legs if leg["outcome"] != "done"
        }
        # (prefill rank 1, back from its stop, may find decode rank 3 silent for
        # the time it was stopped itself: its own view, blamed on its own leg)
        assert blamed <= {(3, 1, "peer dead"), (1, 1, "peer dead")}, (room, w.legs)
    # (a request that failed before its page list went out had no leg)
    with_legs = [
        w for w in (why(out, r) for r in dead) if any(x["outcome"] != "done" for x in w.legs)
    ]
    assert with_legs, "no failed request had a leg blamed"
    text = "\n".join(explain(with_legs[0]))
    assert "rank 3 (decode)'s leg to prefill rank 1: failed (peer dead), blamed on it" in text

    # a clean run: every request's legs done, timed, on both sides (prefill's
    # by decode peer, decode's by prefill peer)
    _, s, out = run_sim(backend, "why-legs-ok", "--requests", "8", "--abort-prob", "0")
    ok = next(int(r) for r, o in s["outcomes"].items() if o[0] == "Success")
    legs = why(out, ok).legs
    assert {(leg["rank"], leg["peer"], leg["outcome"]) for leg in legs} == {
        (0, 0, "done"),
        (1, 1, "done"),
        (2, 0, "done"),
        (3, 1, "done"),
    }
    assert all(leg["seconds"] > 0 for leg in legs)
    text = "\n".join(explain(why(out, ok)))
    assert "rank 2 (decode)'s leg to prefill rank 0: done after" in text
    assert "rank 0 (prefill)'s leg to decode rank 0: done after" in text
