"""``pdlife bench``'s table: medians, ratios of medians and of lower quartiles,
and the ratios of pairs timed back to back (:func:`pair_ratios`, which
``pdlife bench-transfer`` shares)."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["PAIRED", "format_table", "pair_ratios", "summarise"]

#: variants timed back to back in each repetition (in an order that turns), by
#: the one timed as the base: each one's ratio to the base is also the median of
#: the repetitions' own ratios. ``churn_twin`` is the churn step again, on a
#: queue of its own: its ratio is what the measurement itself scatters
PAIRED: dict[str, tuple[str, ...]] = {"churn": ("churn_spans", "churn_twin")}


def pair_ratios(raw: list[float], life: list[float]) -> dict[str, float]:
    """``raw/life`` of each repetition (a pair timed back to back, in turn
    first), summarised: the median, the quartiles and the extremes. A pair's
    ratio keeps a drift of the machine's speed out of the comparison, which a
    ratio of the two medians does not."""
    r = np.asarray(raw, dtype=np.float64) / np.asarray(life, dtype=np.float64)
    q1, med, q3 = (float(x) for x in np.quantile(r, [0.25, 0.5, 0.75]))
    return {"median": med, "q1": q1, "q3": q3, "min": float(r.min()), "max": float(r.max())}


def _stats(xs: list[float]) -> dict[str, float]:
    a = np.asarray(xs) * 1e6
    return {
        "median_us": float(np.median(a)),
        "p25_us": float(np.percentile(a, 25)),
        "p90_us": float(np.percentile(a, 90)),
    }


def summarise(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Per variant: the median over repetitions of the smaller rank time."""
    row: dict[str, Any] = {}
    for name, first in ranks[0]["times"].items():
        both = np.min([r["times"][name] for r in ranks], axis=0)
        row[name] = _stats(list(both))
        row[name]["rank0_median_us"] = _stats(first)["median_us"]
    row["transitions"]["create_machine_us"] = ranks[0]["create_machine_us"]
    row["ratios"] = _ratios({k: v["median_us"] for k, v in row.items()})
    # a collective here is bimodal (an idle vCPU halts, and its wake-up can
    # take milliseconds): the lower quartiles compare the fast mode
    row["ratios_p25"] = _ratios({k: v["p25_us"] for k, v in row.items() if k != "ratios"})
    row["paired"] = {}
    for base, others in PAIRED.items():
        b = np.min([r["times"][base] for r in ranks], axis=0)
        for other in others:
            o = np.min([r["times"][other] for r in ranks], axis=0)
            row["paired"][f"{other}/{base}"] = {
                **pair_ratios(list(o), list(b)),
                "mean_ratio": float(o.mean() / b.mean()),
            }
    return row


def _ratios(med: dict[str, float]) -> dict[str, float]:
    field = {}
    if "field" in med:
        field = {
            "field/ours": med["field"] / med["ours"],
            # like for like: ungated against ungated, gated against gated (the
            # same decode requests, metadata buffers and rows landed), and
            # SGLang's staged gated call on ours' own queue
            "field/ours_field": med["field"] / med["ours_field"],
            "field_gated/ours_gated": med["field_gated"] / med["ours_gated"],
            "field_staged/ours": med["field_staged"] / med["ours"],
            # the most field/ours and field_staged/ours can be: a step that adds
            # nothing to its hooks
            "field/hooks_floor": med["field"] / med["hooks_floor"],
            "field_staged/hooks_floor": med["field_staged"] / med["hooks_floor"],
            # the most any like-for-like ratio can be: a step that costs no
            # more than the bare reduce
            "field/floor": med["field"] / med["floor"],
            "field_gated/floor": med["field_gated"] / med["floor"],
            "compat/field": med["compat"] / med["field"],
            "compat_gated/field_gated": med["compat_gated"] / med["field_gated"],
        }
    return {
        **field,
        "ours-hooks_floor/floor": (med["ours"] - med["hooks_floor"]) / med["floor"],
        "ours/floor": med["ours"] / med["floor"],
        "hooks_floor/floor": med["hooks_floor"] / med["floor"],
        "ours/hooks_floor": med["ours"] / med["hooks_floor"],
        "ours_gated/floor": med["ours_gated"] / med["floor"],
        "ours_holds/ours": med["ours_holds"] / med["ours"],
        "fused3/floor": med["fused3"] / med["floor"],
        "hooks3_floor/floor": med["hooks3_floor"] / med["floor"],
        "fused3-hooks3_floor/floor": (med["fused3"] - med["hooks3_floor"]) / med["floor"],
        "separate3/fused3": med["separate3"] / med["fused3"],
        "churn/floor": med["churn"] / med["floor"],
        "churn_one/floor": med["churn_one"] / med["floor"],
        "churn_spans/churn": med["churn_spans"] / med["churn"],
        "overlap_visible/floor": med["overlap_visible"] / med["floor"],
        "overlap_inline/floor": med["overlap_inline"] / med["floor"],
        "pattern/ours": med["pattern"] / med["ours"],
        "transitions/ours": med["transitions"] / med["ours"],
    }


_COLUMNS = (
    "floor",
    "hooks_floor",
    "ours",
    "ours_holds",
    "ours_field",
    "ours_gated",
    "fused3",
    "hooks3_floor",
    "separate3",
    "churn",
    "churn_one",
    "churn_spans",
    "overlap_visible",
    "overlap_inline",
    "pattern",
)
_RATIOS = (
    "ours/floor",
    "ours-hooks_floor/floor",
    "hooks_floor/floor",
    "ours/hooks_floor",
    "ours_gated/floor",
    "ours_holds/ours",
    "fused3/floor",
    "hooks3_floor/floor",
    "fused3-hooks3_floor/floor",
    "separate3/fused3",
    "churn/floor",
    "churn_one/floor",
    "churn_spans/churn",
    "overlap_visible/floor",
    "overlap_inline/floor",
    "pattern/ours",
    "transitions/ours",
)


#: SGLang's calls against ours on the same requests, side by side: gated
#: against gated, ungated against ungated, staged against ``ours``; then the
#: bounds (a step that cost no more than the bare reduce, or than its hooks
#: and the reduce) and the old mixed ratio
_FIELD = (
    "field_gated/ours_gated",
    "field/ours_field",
    "field_staged/ours",
    "field_gated/floor",
    "field/floor",
    "field_staged/hooks_floor",
    "field/ours",
    "field/hooks_floor",
)


def _like_for_like(sizes: dict[str, Any]) -> list[str]:
    lines = ["field like for like: ratios of medians (of lower quartiles), same run"]
    lines.append(f"{'N':>6} " + " ".join(f"{r:>{_width(r)}}" for r in _FIELD))
    for n, row in sizes.items():
        cells = [
            f"{row['ratios'][r]:.2f} ({row['ratios_p25'][r]:.2f})".rjust(_width(r)) for r in _FIELD
        ]
        lines.append(f"{n:>6} " + " ".join(cells))
    return lines


def _width(name: str) -> int:
    return max(16, len(name))


def format_table(res: dict[str, Any]) -> str:
    lines = []
    if res.get("field_skipped"):
        lines.append(
            f"field: SGLang's poll_and_all_reduce skipped, not importable here ({res['field_skipped']})"
        )
    lines.append("median us (p90 in json)")
    lines.append(f"{'N':>6} " + " ".join(f"{c:>12}" for c in (*_COLUMNS, "transitions")))
    for n, row in res["sizes"].items():
        cells = [f"{row[c]['median_us']:12.0f}" for c in (*_COLUMNS, "transitions")]
        lines.append(f"{n:>6} " + " ".join(cells))
    lines.append("ratios of medians, same run")
    lines.append(f"{'N':>6} " + " ".join(f"{r:>{_width(r)}}" for r in _RATIOS))
    for n, row in res["sizes"].items():
        lines.append(f"{n:>6} " + " ".join(f"{row['ratios'][r]:{_width(r)}.2f}" for r in _RATIOS))
        r = row["ratios"]
        compat = f"compat {row['compat']['median_us']:.0f} us, gated {row['compat_gated']['median_us']:.0f} us"
        if "field/ours" in r:
            lines.append(
                f"{'':>6} field {row['field']['median_us']:.0f} us, gated "
                f"{row['field_gated']['median_us']:.0f} us (ours_gated "
                f"{row['ours_gated']['median_us']:.0f} us), staged "
                f"{row['field_staged']['median_us']:.0f} us; {compat}; field/ours "
                f"{r['field/ours']:.2f} (at most field/hooks_floor {r['field/hooks_floor']:.2f}), "
                f"field/ours_field {r['field/ours_field']:.2f}, compat/field {r['compat/field']:.2f}, "
                f"compat_gated/field_gated {r['compat_gated/field_gated']:.2f}"
            )
        else:
            lines.append(f"{'':>6} {compat}")
    if any("field/ours" in row["ratios"] for row in res["sizes"].values()):
        lines.extend(_like_for_like(res["sizes"]))
    lines.append("ratios of lower quartiles, same run (the collectives' fast mode)")
    for n, row in res["sizes"].items():
        lines.append(
            f"{n:>6} " + " ".join(f"{row['ratios_p25'][r]:{_width(r)}.2f}" for r in _RATIOS)
        )
    lines.append("pairs timed back to back: the median of the repetitions' own ratios (quartiles)")
    for n, row in res["sizes"].items():
        cells = [
            f"{name} {p['median']:.3f} ({p['q1']:.3f}-{p['q3']:.3f})"
            for name, p in row.get("paired", {}).items()
        ]
        lines.append(f"{n:>6} " + "; ".join(cells))
    if res.get("one_process"):
        lines.extend(_one_process(res["one_process"]))
    t = res.get("table")
    if t:
        lines.append(
            f"table: add 10k {t['add_10k_ms']:.2f} ms (one by one {t['add_10k_one_by_one_ms']:.1f} ms), "
            f"remove 10k {t['remove_10k_ms']:.2f} ms, {t['bytes_per_live_request']:.0f} bytes per live request"
        )
    return "\n".join(lines)


def _one_process(res: dict[str, Any]) -> list[str]:
    lines = [
        "one process (no collective): medians us; ratios are the median of the "
        "repetitions' own (of medians)"
    ]
    for n, row in res.items():
        cq, sc = row["churn/quiet"], row["churn_spans/churn"]
        lines.append(
            f"{n:>6} quiet {row['quiet_us']:.1f}, churn {row['churn_us']:.1f}, "
            f"churn_spans {row['churn_spans_us']:.1f}; churn/quiet {cq['median']:.2f} "
            f"({cq['of_medians']:.2f}); churn_spans/churn {sc['median']:.3f} "
            f"({sc['of_medians']:.3f}; quartiles {sc['q1']:.3f}-{sc['q3']:.3f}); "
            f"gated step {row['gated_us']:.1f} = its hooks + {row['gated-hooks_us']:.1f}; "
            f"fused3 {row['fused3_us']:.1f} = its hooks + {row['fused3-hooks3_us']:.1f}"
        )
    return lines
