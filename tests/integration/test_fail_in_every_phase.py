"""A request failed on one rank of either side, in each phase -- Bootstrapping,
WaitingForInput, Transferring -- ends Failed, for the injected reason, on
every rank of both sides, within a bound: nothing is stuck, leaked, left
waiting for a peer that will never speak, or finished as a Success on the
side that did not fail it. On the fake backend and on both byte-moving ones.

The bound. The side that fails the request agrees it in the step the fault
fires (the fault lowers the rank's value before that step's reduce): every
rank of it records that step. The other side hears of it by the failure
word (a real transport's connector message, the simulator's store word on
the fake backend) and ends it Failed for the same reason, every rank of it
at one step of its own -- so before any deadline of its own could fire,
which would give another reason -- and within ``BOUND_S`` seconds of the
failing side by the wall clock (both sides' ranks run on this host). The
steps and reasons are the check; the seconds are generous (a propagation
takes milliseconds) and say only that it arrived, not how fast.

What makes the other side's Success impossible rather than unlikely: the
simulator holds back a request's data on the side that writes it while a
rank of either side is still to fail it (``RankFaults.holds``: prefill sends
no chunk of it; on the fake backend, which has no link, decode takes no
buffers for a request prefill is to fail), and decode's transfer queue is
Transferring for its faults, so that one at Transferring fires while the
data is still on its way.

The negative control switches the propagation off in code, in the spawned
simulator's processes (see ``MUTE``): the fake backend's word and the
connector's failure messages are dropped. The other side then never ends
the request Failed for the injected reason, and the check fails."""

import json
import subprocess
import sys

import pytest
from engines import engine_env

from lifecycle.reasons import FailureReason
from pdlife.cluster.config import SimConfig, Workload

pytestmark = [pytest.mark.multiprocess, pytest.mark.network, pytest.mark.timeout(300)]

INJECTED, NONE = int(FailureReason.INJECTED_FAULT), int(FailureReason.NONE)
REQUESTS = 24
PHASES = ("Bootstrapping", "WaitingForInput", "Transferring")
#: (request index, global rank, phase): in each phase, a prefill rank (0 or 1)
#: and a decode rank (2 or 3)
TARGETS = [(3 + 4 * i + k, (i + k) % 2 + 2 * k, p) for i, p in enumerate(PHASES) for k in (0, 1)]
#: the generous wall-clock bound from the failing side's end to the other side's
BOUND_S = 30.0
ARGS = ("--requests", str(REQUESTS), "--abort-prob", "0")


def side_of(rank):
    return "prefill" if rank < 2 else "decode"


def check(ranks, rooms):
    """Every targeted request ends Failed, for the injected reason, on every rank
    of both sides: on the failing side at the step its fault fired, on the other
    side at one step of its own, within BOUND_S of the failing side. Every other
    request succeeded everywhere; nothing is unfinished or leaked."""
    fired = {}  # room -> (side, step) where its fault fired
    for r in ranks:
        for step, _kind, room in r["fired"]:
            fired[str(room)] = (r["side"], step)
    for r in ranks:
        assert (r["unfinished"], r["leaked_slots"], r["problems"]) == (0, 0, []), r["rank"]
    targeted = {rooms[i]: (side_of(k), p) for i, k, p in TARGETS}
    for room in rooms:
        got = {r["rank"]: r["outcome"].get(room) for r in ranks}
        if room not in targeted:
            assert all(o is not None and o[:2] == ["Success", NONE] for o in got.values()), got
            continue
        side, phase = targeted[room]
        where = (room, side, phase, got)
        assert fired.get(room, (None,))[0] == side, where
        for r in ranks:
            o = got[r["rank"]]
            assert o is not None and o[:2] == ["Failed", INJECTED], (r["rank"], where)
        for s in ("prefill", "decode"):
            steps = {got[r["rank"]][4] for r in ranks if r["side"] == s}
            assert len(steps) == 1, ("the ranks of a side end it at one step", s, where)
        failing = [r for r in ranks if r["side"] == side]
        other = [r for r in ranks if r["side"] != side]
        # the failing side: in the step the fault fired
        assert {got[r["rank"]][4] for r in failing} == {fired[room][1]}, where
        # the other side: within BOUND_S of the failing side, by the wall clock
        start = min(r["ended_ms"][room] for r in failing)
        late = max(r["ended_ms"][room] for r in other) - start
        assert late <= BOUND_S * 1000, (late, where)


def plan_args(tmp_path):
    """The run's flags, with the plan of TARGETS written under ``tmp_path``."""
    faults = [{"kind": "fail", "rank": k, "request": i, "at": p} for i, k, p in TARGETS]
    (tmp_path / "plan.json").write_text(json.dumps({"faults": faults}))
    return [*ARGS, "--plan", str(tmp_path / "plan.json")]


def rooms_of_run():
    return [str(r) for r in Workload(SimConfig(requests=REQUESTS, seed=0)).all_rooms(REQUESTS)]


def read_ranks(out):
    return [json.loads((out / "ranks" / f"rank{r}.json").read_text()) for r in range(4)]


def test_a_failure_in_any_phase_on_either_side_reaches_the_other(run_sim, any_backend, tmp_path):
    args = plan_args(tmp_path)
    proc, s, out = run_sim(any_backend, "run", *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert (s["disagreements"], s["stuck"], s["leaked_kv_pages"]) == (0, 0, 0)
    assert s["faults_fired"] == len(TARGETS) and s["unfired_faults"] == []
    rooms = rooms_of_run()
    ranks = read_ranks(out)
    check(ranks, rooms)
    # the check sees a rank that never finished one, the failing side calling it
    # a Success, the other side calling it a Success, another reason, a step
    # other than the fault's, and the other side past the bound
    room = rooms[TARGETS[0][0]]  # failed on prefill rank 0 at Bootstrapping
    for rank, outcome in [
        (2, None),
        (0, ["Success", NONE]),
        (2, ["Success", NONE]),
        (3, ["Failed", int(FailureReason.WAITING_TIMEOUT)]),
        (0, "step"),
        (2, "late"),
    ]:
        bad = json.loads(json.dumps(ranks))
        o = bad[rank]["outcome"]
        if outcome is None:
            del o[room]
        elif outcome == "step":
            o[room][4] += 1
            bad[1]["outcome"][room][4] += 1
        elif outcome == "late":
            for r in (2, 3):
                bad[r]["ended_ms"][room] += int(BOUND_S * 1000) + 1000
        else:
            o[room][:2] = outcome
        with pytest.raises(AssertionError):
            check(bad, rooms)


#: run in the simulator's own process before its ranks fork: each rank drops the
#: word that carries a failure to the other side -- the fake backend's store
#: word (PeerWord.tell), the connector's Abort (decode to prefill), Failed and
#: GaveUp (prefill to decode) -- and notes each drop in MUTED
MUTE = r"""
import os, sys
from pdlife.sim import peer
from transport.connector.core import machine, messages
import pdlife.cli, pdlife.run.launch

out, argv = sys.argv[1], sys.argv[2:]
muted = os.path.join(out, "muted")

def note(what):
    with open(muted, "a") as f:
        f.write(what + "\n")

def tell(self, room, reason, epoch=0):
    if not self.silent:  # (a byte-moving backend's connector carries it instead)
        note(f"word {room}")

send = machine.ConnectorCore.send
FAILURES = (messages.Abort, messages.Failed, messages.GaveUp)

def quiet_send(self, peer_rank, msg):
    if isinstance(msg, FAILURES):
        note(f"{type(msg).__name__} {msg.room}")
        return
    send(self, peer_rank, msg)

peer.PeerWord.tell = tell
machine.ConnectorCore.send = quiet_send
# the ranks must fork from here to carry the patches (a fork server would not)
if not pdlife.run.launch.forkable():
    sys.exit(97)
sys.exit(pdlife.cli.main(argv))
"""


def test_with_the_propagation_switched_off_the_check_fails(any_backend, tmp_path):
    args = plan_args(tmp_path)
    out = tmp_path / "muted"
    out.mkdir()
    argv = ["simulate", "--backend", any_backend, "--quiet", "--no-timeline"]
    # the other side waits for a word that never comes: the run ends at its step
    # limit (a real transport idles 10 ms a step) with the requests unfinished
    argv += ["--out", str(out), "--max-steps", "300", *args]
    proc = subprocess.run(
        [sys.executable, "-c", MUTE, str(out), *argv],
        capture_output=True,
        text=True,
        timeout=200,
        env=engine_env(),
    )
    assert proc.returncode != 97, "the simulator could not fork its ranks: the patch is not theirs"
    assert (out / "muted").exists(), proc.stdout + proc.stderr[-3000:]
    dropped = {line.split()[0] for line in (out / "muted").read_text().splitlines()}
    carrier = {"word"} if any_backend == "fake" else {"Abort", "Failed", "GaveUp"}
    assert dropped and dropped <= carrier, dropped
    rooms = rooms_of_run()
    ranks = read_ranks(out)
    with pytest.raises(AssertionError):
        check(ranks, rooms)
    # and why: no targeted request ends Failed for the injected reason on the side
    # that did not fail it, while the side that did still fails it as injected
    for i, k, _ in TARGETS:
        for r in ranks:
            got = r["outcome"].get(rooms[i])
            told = got is not None and got[:2] == ["Failed", INJECTED]
            assert told == (r["side"] == side_of(k)), (rooms[i], r["rank"], k, got)
