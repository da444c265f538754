"""``pdlife bench``'s report from fabricated rank times: the like-for-like field
columns (gated against gated, ungated against ungated, staged against ours)
are the right quotients, printed side by side; without the field they are
absent and the run says so in one line. And the check that each compared pair
does the same work fails loudly when it does not."""

import types

import numpy as np
import pytest

from pdlife.bench.field_cases import check_agreement
from pdlife.bench.report import format_table, summarise

#: median microseconds of every variant the bench times (made up, all distinct)
MEDIANS = {
    "floor": 500.0,
    "hooks_floor": 650.0,
    "ours": 800.0,
    "ours_holds": 820.0,
    "ours_field": 640.0,
    "ours_gated": 700.0,
    "pattern": 900.0,
    "fused3": 950.0,
    "separate3": 1500.0,
    "hooks3_floor": 700.0,
    "churn": 1000.0,
    "churn_one": 980.0,
    "churn_spans": 1010.0,
    "churn_twin": 1001.0,
    "overlap_visible": 120.0,
    "overlap_inline": 300.0,
    "compat": 660.0,
    "compat_gated": 720.0,
    "transitions": 5000.0,
}
FIELD = {"field": 1600.0, "field_gated": 2800.0, "field_staged": 4000.0}


def _ranks(medians: dict[str, float]) -> list[dict]:
    """Two ranks' times (seconds) whose per-repetition minimum has the given
    median; rank 1 is always the slower one."""
    spread = np.array([0.9, 0.95, 1.0, 1.05, 1.1])
    r0 = {k: list(v * 1e-6 * spread) for k, v in medians.items()}
    r1 = {k: list(v * 1e-6 * spread * 1.5) for k, v in medians.items()}
    return [{"times": r0, "create_machine_us": 3.0}, {"times": r1, "create_machine_us": 3.0}]


def _result(medians: dict[str, float], skipped: str = "") -> dict:
    res = {"sizes": {"64": summarise(_ranks(medians))}, "table": None}
    if skipped:
        res["field_skipped"] = skipped
    return res


def test_the_like_for_like_columns_are_the_quotients_of_the_same_runs_medians():
    res = _result({**MEDIANS, **FIELD})
    r = res["sizes"]["64"]["ratios"]
    assert r["field_gated/ours_gated"] == pytest.approx(2800 / 700)
    assert r["field/ours_field"] == pytest.approx(1600 / 640)
    assert r["field_staged/ours"] == pytest.approx(4000 / 800)
    assert r["field_staged/hooks_floor"] == pytest.approx(4000 / 650)
    assert r["field_gated/floor"] == pytest.approx(2800 / 500)
    assert r["field/floor"] == pytest.approx(1600 / 500)
    assert r["ours_gated/floor"] == pytest.approx(700 / 500)
    assert r["ours_holds/ours"] == pytest.approx(820 / 800)
    assert r["churn_spans/churn"] == pytest.approx(1010 / 1000)
    # the columns there were keep their meaning
    assert r["field/ours"] == pytest.approx(1600 / 800)
    assert r["field/hooks_floor"] == pytest.approx(1600 / 650)
    assert r["ours-hooks_floor/floor"] == pytest.approx((800 - 650) / 500)
    assert r["hooks3_floor/floor"] == pytest.approx(700 / 500)
    assert r["compat_gated/field_gated"] == pytest.approx(720 / 2800)
    p25 = res["sizes"]["64"]["ratios_p25"]  # the lower quartiles: 0.95 of each median
    assert p25["field_gated/ours_gated"] == pytest.approx(2800 / 700)


def test_the_report_prints_gated_and_ungated_side_by_side():
    lines = format_table(_result({**MEDIANS, **FIELD})).splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("field like for like"))
    header, row = lines[at + 1].split(), lines[at + 2].split()
    assert header[:4] == ["N", "field_gated/ours_gated", "field/ours_field", "field_staged/ours"]
    assert header[4:6] == ["field_gated/floor", "field/floor"]
    assert header[6:] == ["field_staged/hooks_floor", "field/ours", "field/hooks_floor"]
    # each cell: the ratio of medians, then that of lower quartiles in brackets
    assert row[0] == "64" and row[1:3] == ["4.00", "(4.00)"] and row[3:5] == ["2.50", "(2.50)"]
    assert row[5:7] == ["5.00", "(5.00)"] and row[7] == "5.60" and row[9] == "3.20"
    assert row[11] == "6.15"
    assert "ours_gated" in lines[1].split()  # the medians' table has its column
    assert any("(ours_gated 700 us), staged 4000 us" in line for line in lines)


def test_without_the_field_the_run_says_so_once_and_has_no_field_column():
    res = _result(MEDIANS, skipped="ModuleNotFoundError: No module named 'sglang'")
    text = format_table(res)
    assert sum("skipped, not importable here" in line for line in text.splitlines()) == 1
    assert "field like for like" not in text and "field_gated/ours_gated" not in text
    assert not any(k.startswith("field") for k in res["sizes"]["64"]["ratios"])
    assert res["sizes"]["64"]["ratios"]["ours_gated/floor"] == pytest.approx(700 / 500)


def _step(statuses: list[int]):
    return lambda: types.SimpleNamespace(statuses=np.array(statuses, dtype=np.int8))


def test_the_pairs_must_agree_request_by_request_and_the_gate_must_hold_something():
    held, passed = [3, 3, 3, 2], [3, 4, 4, 2]
    gated = ("ours_gated", _step(held), "field_gated", lambda: held)
    check_agreement([gated], {"field_gated": lambda: passed})  # agrees, the gate held two
    with pytest.raises(RuntimeError, match="disagree on 2 of 4 requests"):
        check_agreement([("ours_gated", _step(passed), "field_gated", lambda: held)], {})
    with pytest.raises(RuntimeError, match="disagree on 1 of 4"):  # a missing answer counts
        check_agreement([("ours_gated", _step(held[:3]), "field_gated", lambda: held)], {})
    with pytest.raises(RuntimeError, match="field_gated's gate held no request"):
        check_agreement([gated], {"field_gated": lambda: held})


def test_a_pair_timed_back_to_back_is_the_median_of_its_repetitions_own_ratios():
    # the collective's slow mode hits both halves of a repetition alike: the
    # repetitions' own ratios are 1.02 each, while the ratio of medians is not
    slow = [1.0, 1.0, 5.0, 5.0, 5.0]
    fast = [1.0, 1.0, 1.0, 5.0, 5.0]
    times = {k: [v * 1e-6] * 5 for k, v in MEDIANS.items()}
    times["churn"] = [x * 1e-3 for x in fast]
    times["churn_spans"] = [x * 1.02e-3 for x in fast]
    other = {**times, "churn": [x * 1e-3 for x in slow], "churn_spans": [x * 1.02e-3 for x in slow]}
    row = summarise(
        [{"times": times, "create_machine_us": 3.0}, {"times": other, "create_machine_us": 3.0}]
    )
    pair = row["paired"]["churn_spans/churn"]
    assert pair["median"] == pytest.approx(1.02) and pair["q1"] == pytest.approx(1.02)
    assert pair["q3"] == pytest.approx(1.02) and pair["mean_ratio"] == pytest.approx(1.02)
    # a pair whose partner was slower in some repetitions: the median of those ratios
    times["churn_spans"] = [1.1e-3, 1.0e-3, 1.0e-3, 5.5e-3, 5.0e-3]
    row = summarise([{"times": times, "create_machine_us": 3.0}] * 2)
    assert row["paired"]["churn_spans/churn"]["median"] == pytest.approx(1.0)
    assert row["paired"]["churn_spans/churn"]["q3"] == pytest.approx(1.1)
    text = format_table({"sizes": {"1024": row}, "table": None})
    assert "1024 churn_spans/churn 1.000 (1.000-1.100); churn_twin/churn 1.001" in text


def test_the_one_process_part_is_printed_with_its_ratios():
    def ratio(m: float) -> dict:
        return {"median": m, "q1": m - 0.01, "q3": m + 0.01, "of_medians": m + 0.002}

    one = {"quiet_us": 20.0, "churn_us": 100.0, "churn_spans_us": 101.5}
    one |= {"gated_us": 30.0, "gated-hooks_us": 16.5, "fused3_us": 70.0, "fused3-hooks3_us": 44.0}
    one |= {"churn/quiet": ratio(5.0), "churn_spans/churn": ratio(1.015)}
    res = {**_result(MEDIANS), "one_process": {"1024": one}}
    line = next(x for x in format_table(res).splitlines() if x.startswith("  1024 quiet"))
    assert "quiet 20.0, churn 100.0, churn_spans 101.5; churn/quiet 5.00 (5.00)" in line
    assert "churn_spans/churn 1.015 (1.017; quartiles 1.005-1.025)" in line
    assert "gated step 30.0 = its hooks + 16.5; fused3 70.0 = its hooks + 44.0" in line
