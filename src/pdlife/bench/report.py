"""``pdlife bench``'s table: medians, ratios of medians and of lower quartiles."""

from __future__ import annotations

from typing import Any

__all__ = ["format_table"]

_COLUMNS = (
    "floor",
    "hooks_floor",
    "ours",
    "fused3",
    "separate3",
    "churn",
    "churn_one",
    "overlap_visible",
    "overlap_inline",
    "pattern",
)
_RATIOS = (
    "ours/floor",
    "ours-hooks_floor/floor",
    "hooks_floor/floor",
    "ours/hooks_floor",
    "fused3/floor",
    "separate3/fused3",
    "churn/floor",
    "churn_one/floor",
    "overlap_visible/floor",
    "overlap_inline/floor",
    "pattern/ours",
    "transitions/ours",
)


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
    lines.append(f"{'N':>6} " + " ".join(f"{r:>16}" for r in _RATIOS))
    for n, row in res["sizes"].items():
        lines.append(f"{n:>6} " + " ".join(f"{row['ratios'][r]:16.2f}" for r in _RATIOS))
        r = row["ratios"]
        compat = f"compat {row['compat']['median_us']:.0f} us, gated {row['compat_gated']['median_us']:.0f} us"
        if "field/ours" in r:
            lines.append(
                f"{'':>6} field {row['field']['median_us']:.0f} us, gated "
                f"{row['field_gated']['median_us']:.0f} us; {compat}; field/ours "
                f"{r['field/ours']:.2f}, compat/field {r['compat/field']:.2f}, "
                f"compat_gated/field_gated {r['compat_gated/field_gated']:.2f}"
            )
        else:
            lines.append(f"{'':>6} {compat}")
    lines.append("ratios of lower quartiles, same run (the collectives' fast mode)")
    for n, row in res["sizes"].items():
        lines.append(f"{n:>6} " + " ".join(f"{row['ratios_p25'][r]:16.2f}" for r in _RATIOS))
    t = res.get("table")
    if t:
        lines.append(
            f"table: add 10k {t['add_10k_ms']:.2f} ms (one by one {t['add_10k_one_by_one_ms']:.1f} ms), "
            f"remove 10k {t['remove_10k_ms']:.2f} ms, {t['bytes_per_live_request']:.0f} bytes per live request"
        )
    return "\n".join(lines)
