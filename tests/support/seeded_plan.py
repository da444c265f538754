"""The seeded run the telemetry tests read (pdlife why, the spans, the
Perfetto export): 12 requests on the fake backend, 2 prefill and 2 decode
ranks; prefill rank 1's staging gate holds request 3 for 4 steps once it is
Transferring there, and prefill rank 0's backend reports a transfer error for
request 5 (a peer whose transfer broke)."""

from pdlife.cluster.config import SimConfig, Workload

REQUESTS = 12
HELD, FAILED = 3, 5  # request indices
#: the rank whose gate holds, and the prefill rank whose transfer breaks
HOLDER, PEER = 1, 0
PLAN = {
    "faults": [
        {"kind": "hold_staging", "rank": HOLDER, "request": HELD, "at": "Transferring",
         "steps": 4},
        {"kind": "transfer_error", "rank": PEER, "request": FAILED, "at": "Transferring"},
    ]
}  # fmt: skip
ARGS = ["--requests", str(REQUESTS), "--abort-prob", "0"]


def rooms() -> list[int]:
    """The run's rooms, by request index."""
    return [int(r) for r in Workload(SimConfig(requests=REQUESTS, seed=0)).all_rooms(REQUESTS)]
