"""A request failed on either side, in each phase -- before decode has
registered it with prefill included -- ends failed on both sides, for the
reason given, on every rank: nothing is stuck, leaked or left waiting for a
peer that will never speak. On the fake backend and on both byte-moving ones."""

import json

import pytest

from lifecycle.reasons import FailureReason
from pdlife.cluster.config import SimConfig, Workload

pytestmark = [pytest.mark.multiprocess, pytest.mark.network, pytest.mark.timeout(200)]

INJECTED, NONE = int(FailureReason.INJECTED_FAULT), int(FailureReason.NONE)
REQUESTS = 24
PHASES = ("Bootstrapping", "WaitingForInput", "Transferring")
#: (request index, global rank, phase): in each phase, a prefill rank (0 or 1)
#: and a decode rank (2 or 3)
TARGETS = [(3 + 4 * i + k, (i + k) % 2 + 2 * k, p) for i, p in enumerate(PHASES) for k in (0, 1)]


def check(ranks, rooms, backend):
    """Every targeted request failed as injected on every rank of the side
    that failed it, and on every rank of the other side too -- unless that
    side had already finished it as a Success: at Transferring the transfer
    may have completed end to end before the fault (decode reaches it only
    once every byte landed; prefill's writes may all land between its init
    and its next step), and the fake backend's two sides never wait for
    each other. Every other request succeeded everywhere; nothing is
    unfinished or leaked."""
    side_of = {r: "prefill" if r < 2 else "decode" for r in range(4)}
    targeted = {rooms[i]: (side_of[k], p) for i, k, p in TARGETS}
    for r in ranks:
        assert (r["unfinished"], r["leaked_slots"], r["problems"]) == (0, 0, []), r["rank"]
        for room in rooms:
            got = r["outcome"].get(room)
            assert got is not None, (r["side"], r["rank"], room)
            want = [["Success", NONE]]
            if room in targeted:
                side, phase = targeted[room]
                want = [["Failed", INJECTED]]
                told = r["side"] != side
                if told and (backend == "fake" or phase == "Transferring"):
                    want.append(["Success", NONE])
            assert got[:2] in want, (r["side"], r["rank"], room, got)


def test_a_failure_in_any_phase_on_either_side_reaches_the_other(run_sim, any_backend, tmp_path):
    backend = any_backend
    faults = [{"kind": "fail", "rank": k, "request": i, "at": p} for i, k, p in TARGETS]
    (tmp_path / "plan.json").write_text(json.dumps({"faults": faults}))
    args = ["--requests", str(REQUESTS), "--abort-prob", "0", "--plan", str(tmp_path / "plan.json")]
    proc, s, out = run_sim(backend, "run", *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert (s["disagreements"], s["stuck"], s["leaked_kv_pages"]) == (0, 0, 0)
    assert s["faults_fired"] == len(TARGETS) and s["unfired_faults"] == []
    rooms = [str(r) for r in Workload(SimConfig(requests=REQUESTS, seed=0)).all_rooms(REQUESTS)]
    ranks = [json.loads((out / "ranks" / f"rank{r}.json").read_text()) for r in range(4)]
    check(ranks, rooms, backend)
    # negative controls: the check sees a rank that never finished it, the side
    # that failed it calling it a Success, and (a real transport) the other side
    # never hearing of it
    room = rooms[TARGETS[0][0]]  # failed on prefill rank 0 at Bootstrapping
    doctored = [(2, None), (0, ["Success", NONE, -1])]
    if backend != "fake":
        doctored.append((2, ["Success", NONE, -1]))
    for rank, outcome in doctored:
        bad = json.loads(json.dumps(ranks))
        if outcome is None:
            del bad[rank]["outcome"][room]
        else:
            bad[rank]["outcome"][room] = outcome
        with pytest.raises(AssertionError):
            check(bad, rooms, backend)
