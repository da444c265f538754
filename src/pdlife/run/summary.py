"""A run's summary: per-rank results merged, invariants checked, the table and the timeline."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from lifecycle.reasons import FailureReason
from lifecycle.status import Role
from pdlife.cluster.config import SimConfig, Workload

__all__ = ["summarize", "print_table"]


def _rss_growth(samples: list[list[float]], requests: int) -> float | None:
    """Relative RSS growth from the end of warm-up (a fifth of the requests
    finished) to the last sample; None without two samples past warm-up."""
    warm = [m for _, done, m, *_ in samples if done >= requests / 5]
    if len(warm) < 2 or warm[0] <= 0:
        return None
    return round((warm[-1] - warm[0]) / warm[0], 4)


def _end_to_end(
    rooms: list[int], by_group: dict[str, list[dict[str, Any]]]
) -> dict[str, tuple[str, int, int]]:
    """Per request, at its last attempt: Failed if either side failed it
    (decode's reason first, as the side the client sees), Success only once
    decode succeeded, Recomputed when decode prefills it locally, else
    unfinished; and its attempts. Prefill DP groups each saw their own
    requests: their outcomes are merged."""
    final: dict[str, tuple[str, int, int]] = {}
    firsts: dict[str, dict[str, Any]] = {"prefill": {}, "decode": {}}
    for results in by_group.values():
        if not results:
            continue
        got = firsts[results[0]["side"]]
        for room, o in results[0]["outcome"].items():
            # a retry may go to another prefill DP group: its last attempt counts
            if room not in got or (o[3] if len(o) > 3 else 0) >= (got[room][3:] or [0])[0]:
                got[room] = o
    for room in map(str, rooms):
        seen = {side: got.get(room) for side, got in firsts.items()}
        failed_on = [
            o for side in ("decode", "prefill") if (o := seen.get(side)) and o[0] == "Failed"
        ]
        dec = seen.get("decode")
        attempts = 1 + (int(dec[3]) if dec and len(dec) > 3 else 0)
        if dec and dec[0] == "Recomputed":  # prefilled on decode: prefill's attempt is moot
            final[room] = ("Recomputed", dec[1], attempts)
        elif failed_on:
            final[room] = ("Failed", failed_on[0][1], attempts)
        elif dec and dec[0] == "Success":
            # delivered: decode holds the KV and the first token (prefill may have died since)
            final[room] = ("Success", FailureReason.NONE, attempts)
    return final


def summarize(
    cfg: SimConfig, out: Path, exits: dict[int, int | None], hung: list[int], elapsed: float
) -> dict[str, Any]:
    ranks: dict[int, dict[str, Any]] = {}
    for r in range(cfg.world):
        path = out / "ranks" / f"rank{r}.json"
        if path.exists():
            ranks[r] = json.loads(path.read_text())
    by_side: dict[str, list[dict[str, Any]]] = {"prefill": [], "decode": []}
    by_group: dict[str, list[dict[str, Any]]] = {}
    for _, res in sorted(ranks.items()):
        by_side[res["side"]].append(res)
        by_group.setdefault(res.get("group", res["side"]), []).append(res)
    requests = cfg.requests
    if cfg.soak:
        agreed = [r["requests"] for r in ranks.values() if r.get("requests") is not None]
        requests = max(agreed, default=0)
    rooms = Workload(cfg).all_rooms(requests)
    final = _end_to_end(rooms, by_group)
    failed = Counter(
        FailureReason(reason).label for status, reason, _ in final.values() if status == "Failed"
    )
    aborted = failed.pop("aborted", 0)
    latency = np.concatenate(
        [np.asarray(r["latency_us"], dtype=float) for r in ranks.values()] or [np.zeros(1)]
    )
    violations = [v for r in ranks.values() for v in r["violations"]]
    # every rank of a TP group must report the same outcome for every request
    disagreements = sum(r["disagreements"] for r in ranks.values())
    for group, results in by_group.items():
        for res in results[1:]:
            if res["outcome"] != results[0]["outcome"]:
                disagreements += 1
                violations.append(
                    f"{group} rank {res['rank']} ended with different outcomes than rank {results[0]['rank']}"
                )
    dead = sorted(r for r, code in exits.items() if code == 17)
    errors = [r["error"] for r in ranks.values() if r.get("error")]
    crashed = sorted(r for r, code in exits.items() if code not in (0, 17, 3) and r not in hung)
    problems = [p for r in ranks.values() for p in r.get("problems", [])]
    unfired = [u for r in ranks.values() for u in r.get("unfired_faults", [])]
    # a kill that never happened: the rank is alive at the end
    for f in cfg.plan.faults:
        if f.kind == "kill_rank" and f.rank not in dead:
            unfired.append(f"kill_rank on rank {f.rank} at step {f.step}")
    if unfired:
        problems.append(
            f"{len(unfired)} targeted fault(s) never fired, e.g. {unfired[0]}: the request "
            "finished (or the run ended) before the fault's step or phase; move it earlier"
        )
    decisions = sorted(
        {tuple(d) for r in ranks.values() for d in r.get("decisions", []) if d[1] == r["rank"]}
        | {
            tuple(d)
            for res in by_side["decode"][:1]
            for d in res.get("decisions", [])
            if d[1] == -1
        }
    )
    rss = {str(r): res.get("rss_mb", []) for r, res in sorted(ranks.items())}
    summary: dict[str, Any] = {
        "requests": requests,
        "succeeded": sum(1 for s, _, _ in final.values() if s == "Success"),
        **recovery_counts(cfg, final, by_side, ranks),
        "failed": dict(sorted(failed.items())),
        "aborted": aborted,
        "disagreements": disagreements,
        # a rank that stopped on an error cannot have cleaned up: count the others
        "leaked_slots": sum(r["leaked_slots"] for r in ranks.values() if not r["error"]),
        "leaked_kv_pages": sum(r["leaked_kv_pages"] for r in ranks.values() if not r["error"]),
        # kept out of reuse for a writer that stopped beating and never came back
        "fenced_kv_pages": sum(r.get("fenced_kv_pages", 0) for r in ranks.values()),
        "drain_failed": sum(r.get("drain_failed", 0) for r in ranks.values()),
        "kv_bytes_verified": sum(r.get("bytes_checked", 0) for r in ranks.values()),
        "stuck": requests - len(final),
        "stuck_reports": sum(r["stuck_reports"] for r in ranks.values()),
        "steps": max((r["steps"] for r in ranks.values()), default=0),
        "step_latency_us": {
            "p50": round(float(np.percentile(latency, 50)), 1),
            "p99": round(float(np.percentile(latency, 99)), 1),
        },
        "backend": cfg.backend,
        "seed": cfg.seed,
        "fault_mode": cfg.mode,
        "ranks": {"prefill": cfg.prefill_ranks, "decode": cfg.decode},
        "topology": {
            "prefill_tp": cfg.prefill,
            "prefill_dp": cfg.prefill_dp,
            "decode_tp": cfg.decode,
            "kv_heads": cfg.total_heads,
            "mla": cfg.mla,
            "page_size": cfg.page_size,
            "state": cfg.state,
            "staging": cfg.staging,
            "prefix_pages": cfg.prefix_pages,
        },
        # bytes decode asked prefill for (uncached pages of each rank's heads, state
        # and metadata rows): of every request given pages, and of those that
        # succeeded; prefill's bytes_written (its transport's count) lies between
        # them when nothing cached and nothing twice was sent
        "decode_bytes_asked": sum(r.get("bytes_asked", 0) for r in by_side["decode"]),
        "decode_bytes_due": sum(r.get("bytes_due", 0) for r in by_side["decode"]),
        # decode requests (per rank) whose head slices landed via the staging buffer
        "staged_requests": sum(r.get("staged", 0) for r in by_side["decode"]),
        "prefill_bytes_written": sum(
            r.get("transport_stats", {}).get("bytes_written", 0) for r in by_side["prefill"]
        ),
        "faults_fired": sum(r["faults_fired"] for r in ranks.values()),
        "fault_decisions": [
            {
                "room": d[0],
                "rank": d[1],  # -1: the client (an abort)
                "phase": d[2],
                "kind": d[3],
                "reason": "aborted" if d[3] == "abort" else "injected fault",
                "wins": d[4],  # the request's winner: the one draw that fires
            }
            for d in decisions
        ],
        "outcomes": {
            room: [status, FailureReason(reason).label, attempts]
            for room, (status, reason, attempts) in final.items()
        },
        "unfired_faults": unfired,
        "problems": problems,
        "invariant_violations": violations,
        "dead_ranks": dead,
        "rank_errors": errors,
        "backend_errors": {
            str(r): res["backend_error"] for r, res in ranks.items() if res.get("backend_error")
        },
        "hung_ranks": hung,
        "crashed_ranks": crashed,
        "rss_mb": rss,
        "rss_growth_after_warmup": {r: _rss_growth(v, requests) for r, v in rss.items()},
        "soak_s": cfg.soak,
        "elapsed_s": round(elapsed, 2),
    }
    if not summary["peer_health_agreed"]:
        violations.append("decode ranks ended with different views of the prefill groups' health")
    summary["ok"] = not (
        violations
        or problems
        or disagreements
        or summary["leaked_slots"]
        or summary["leaked_kv_pages"]
        or summary["stuck"]
        or dead
        or errors
        or hung
        or crashed
        or len(ranks) != cfg.world
    )
    (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    from lifecycle.rules.diagram import mermaid

    (out / "lifecycle.mmd").write_text(
        mermaid(Role.SENDER) + "\n%% ---- decode ----\n" + mermaid(Role.RECEIVER)
    )
    if cfg.timeline:
        _timeline(out, ranks, cfg)
    return summary


def _timeline(out: Path, ranks: dict[int, dict[str, Any]], cfg: SimConfig) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        (out / "timeline.txt").write_text("install the 'plot' extra for timeline.png\n")
        return
    fig, axes = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    names = ["Failed", "Bootstrapping", "WaitingForInput", "Transferring", "Success"]
    colors = ["#d62728", "#7f7f7f", "#1f77b4", "#ff7f0e", "#2ca02c"]
    drawn = False
    for ax, (side, first) in zip(axes, (("prefill", 0), ("decode", cfg.prefill_ranks))):
        res = ranks.get(first)
        ax.set_title(f"{side} rank {first}: live requests by agreed status")
        if not res or not res["counts"]:
            continue
        counts = np.asarray(res["counts"])
        steps = np.arange(1, len(counts) + 1) * res.get("counts_stride", 1)
        ax.stackplot(steps, counts[:, 1:5].T, labels=names[1:5], colors=colors[1:5], alpha=0.8)
        ax.plot(steps, counts[:, 5], color="black", lw=1, label="finished (cumulative)")
        for s in res["failure_steps"]:
            ax.axvline(s, color=colors[0], alpha=0.25, lw=0.8)
        ax.set_ylabel("requests")
        drawn = True
    if drawn:
        axes[0].legend(loc="upper right", fontsize=7)
    axes[1].set_xlabel("scheduler step (red lines: failures agreed)")
    fig.tight_layout()
    fig.savefig(out / "timeline.png", dpi=90)
    plt.close(fig)


def print_table(s: dict[str, Any]) -> None:
    growth = {r: g for r, g in s.get("rss_growth_after_warmup", {}).items() if g is not None}
    rows = [
        ("backend", s["backend"]),
        ("ranks", f"{s['ranks']['prefill']} prefill + {s['ranks']['decode']} decode"),
        ("requests", s["requests"]),
        ("succeeded", s["succeeded"]),
        ("failed", ", ".join(f"{k}: {v}" for k, v in s["failed"].items()) or "0"),
        ("aborted", s["aborted"]),
        ("disagreements", s["disagreements"]),
        ("leaked slots", s["leaked_slots"]),
        ("leaked KV pages", s["leaked_kv_pages"]),
        ("fenced KV pages", s.get("fenced_kv_pages", 0)),
        ("stuck", s["stuck"]),
        ("steps", s["steps"]),
        (
            "step latency us p50/p99",
            f"{s['step_latency_us']['p50']} / {s['step_latency_us']['p99']}",
        ),
        ("fault mode", s["fault_mode"]),
        ("faults fired", s["faults_fired"]),
        *_recovery_rows(s),
        ("elapsed", f"{s['elapsed_s']} s"),
    ]
    if growth:
        rows.append(
            (
                "RSS growth after warm-up",
                ", ".join(f"rank {r}: {100 * g:+.1f}%" for r, g in sorted(growth.items())),
            )
        )
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{w}}  {v}")
    for msg in s["rank_errors"]:
        print(f"  ERROR: {msg}")
    for r in s["hung_ranks"]:
        print(f"  ERROR: rank {r} hung and was killed")
    for r in s["crashed_ranks"]:
        print(f"  ERROR: rank {r} crashed")
    for msg in s["problems"]:
        print(f"  ERROR: {msg}")
    for r, e in s.get("backend_errors", {}).items():
        print(f"  rank {r}'s transfer backend caught: {e}")
    for r in s["dead_ranks"]:
        print(f"  rank {r} was killed by the fault plan")
    for v in s["invariant_violations"][:20]:
        print(f"  VIOLATION: {v}")
    print("  result: " + ("OK" if s["ok"] else "FAILED"))


def recovery_counts(
    cfg: SimConfig,
    final: dict[str, tuple[str, int, int]],
    by_side: dict[str, list[dict[str, Any]]],
    ranks: dict[int, dict[str, Any]],
) -> dict[str, Any]:
    """What recovery did (docs/recovery.md): attempts per request, retries,
    recomputes, words of older attempts refused, and the corruptions injected,
    caught by the digest and delivered unseen."""
    first = by_side["decode"][0] if by_side["decode"] else {}

    def stat(side: str, key: str) -> int:
        return sum(int(r.get("transport_stats", {}).get(key, 0)) for r in by_side[side])

    attempts = Counter(a for _, _, a in final.values())
    views = {r.get("peer_health_fp") for r in by_side["decode"]}
    return {
        "peer_health": first.get("peer_health", {}),
        "peer_health_agreed": len(views) <= 1,
        "recovery": cfg.recovery,
        "attempts": {str(k): attempts[k] for k in sorted(attempts)},
        "retries": int(first.get("retried", 0)),
        "recomputed": int(first.get("recomputed", 0)),
        "recompute_steps": int(first.get("recompute_steps", 0)),
        "stale_refused": stat("prefill", "stale_epoch") + stat("decode", "stale_epoch"),
        "corruptions": {
            "injected": sum(int(r.get("corrupted", 0)) for r in by_side["decode"]),
            "detected": stat("decode", "digest_mismatches"),
            "unseen": sum(int(r.get("corrupt_unseen", 0)) for r in ranks.values()),
            "digest": cfg.digest,
        },
    }


def _recovery_rows(s: dict[str, Any]) -> list[tuple[str, Any]]:
    """The recovery lines of the table, when anything recovered or was corrupted."""
    rows: list[tuple[str, Any]] = []
    if s.get("recovery", "fail") != "fail":
        att = ", ".join(f"{k}: {v}" for k, v in s.get("attempts", {}).items())
        rows += [
            ("recovery", s["recovery"]),
            ("attempts (requests)", att or "0"),
            ("retries", s.get("retries", 0)),
            ("recomputed", s.get("recomputed", 0)),
            ("stale words refused", s.get("stale_refused", 0)),
        ]
    c = s.get("corruptions", {})
    if c.get("injected"):
        seen = f"{c['detected']} detected" if c.get("digest") else "digest off"
        rows.append(("corruptions", f"{c['injected']} injected, {seen}, {c['unseen']} unseen"))
    return rows
