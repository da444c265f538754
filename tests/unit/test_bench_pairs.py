"""bench-transfer's figure is the median of each repetition's own raw/lifecycle
ratio: a drift of the machine's speed across the run moves both halves of a
pair, not the ratio."""

import pytest

from pdlife.bench.transfer import pair_ratios


def test_each_pair_gives_one_ratio_and_the_summary_orders_them():
    got = pair_ratios([1.0, 2.0, 3.0], [2.0, 2.0, 2.0])
    assert got == {"median": 1.0, "q1": 0.75, "q3": 1.25, "min": 0.5, "max": 1.5}


def test_a_drift_of_the_machine_leaves_the_pairs_ratio_alone():
    # each pair's lifecycle run takes 10% longer than its raw one, and the
    # machine slows down fourfold in the middle of the third pair
    raw = [1.0, 1.0, 1.0, 4.0, 4.0]
    life = [1.1, 1.1, 4.4, 4.4, 4.4]
    assert pair_ratios(raw, life)["median"] == pytest.approx(1 / 1.1)
    # the ratio of the two medians reads the drift as the lifecycle's cost
    assert sorted(raw)[2] / sorted(life)[2] == pytest.approx(1 / 4.4)
