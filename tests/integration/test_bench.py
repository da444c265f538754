"""``pdlife bench`` runs end to end on 2 gloo ranks and keeps its JSON keys
(a smoke test: the numbers themselves are read from a real run, never here)."""

import pytest

from pdlife.bench.step import format_table, run_bench

# the keys #14 asked for (more may be added beside them, never taken away)
VARIANTS = ("floor", "ours", "pattern", "transitions", "fused3", "separate3", "churn")
VARIANTS += ("overlap_visible",)
RATIOS = ("ours/floor", "fused3/floor", "separate3/fused3", "churn/floor")
RATIOS += ("overlap_visible/floor", "pattern/ours", "transitions/ours")


@pytest.mark.timeout(300)
def test_the_bench_reports_every_variant_and_ratio():
    res = run_bench((64, 300), reps=4, t_reps=2)
    assert set(res["sizes"]) == {"64", "300"}
    for row in res["sizes"].values():
        assert set(VARIANTS) < set(row)
        for name in set(row) - {"ratios", "ratios_p25"}:
            assert row[name]["median_us"] > 0
            assert row[name]["rank0_median_us"] >= row[name]["median_us"] * 0.999
        assert set(RATIOS) < set(row["ratios"]) and set(RATIOS) < set(row["ratios_p25"])
        # ratios of times are positive; the step's own share is a difference of
        # two noisy medians, so only its presence is checked here
        assert "ours-hooks_floor/floor" in row["ratios"]
        assert all(v > 0 for k, v in row["ratios"].items() if "-" not in k)
    assert res["table"]["bytes_per_live_request"] > 0
    text = format_table(res)
    assert "ours/floor" in text and "overlap_visible" in text
    # the field's own function: measured beside ours, or skipped in one line
    if "field_skipped" in res:
        assert all("field" not in row for row in res["sizes"].values())
        assert sum("skipped, not importable here" in line for line in text.splitlines()) == 1
    else:
        assert all("field/ours" in row["ratios"] for row in res["sizes"].values())


@pytest.mark.network
@pytest.mark.timeout(120)
def test_bench_transfer_moves_scattered_pages_and_checks_every_byte(backend):
    # the scattered-pages case, small: 4 buffers of 32 pages of 32 KiB whose
    # destination pages are shuffled, so every page is a run of its own in the
    # raw write and in the lifecycle-driven one; decode checks every byte
    from pdlife.bench.transfer import run_transfer_bench

    res = run_transfer_bench(4, 32, 2, backend, buffers=4, shuffle=True)
    assert (res["runs"], res["buffers"], res["shuffled"]) == (128, 4, True)
    assert res["bytes_verified"] and res["raw_gbps"] > 0 and res["lifecycle_gbps"] > 0
