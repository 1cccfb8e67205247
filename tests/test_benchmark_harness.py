"""The benchmark harness's statistics: paired rounds and their interval."""

import math

import pytest

from pagedjax.benchmarks.harness import in_turn, paired_ratio


def test_paired_ratio_is_the_geometric_mean_of_each_rounds_ratio_with_students_interval():
    # rounds where the host ran at 1x, 2x and 0.5x speed: a system 1.25x faster in each
    reference = [1.0, 0.5, 2.0]
    seconds = [0.8, 0.4, 1.6]
    mean, low, high = paired_ratio(seconds, reference)
    assert (mean, low, high) == pytest.approx((1.25, 1.25, 1.25))
    # log ratios 0 and log 2: mean log 2 / 2, sd log 2 / sqrt 2, t(1 df) 6.314
    mean, low, high = paired_ratio([1.0, 1.0], [1.0, 2.0])
    half = 6.314 * (math.log(2) / math.sqrt(2)) / math.sqrt(2)
    assert mean == pytest.approx(math.sqrt(2))
    assert (low, high) == pytest.approx((math.exp(math.log(2) / 2 - half),
                                         math.exp(math.log(2) / 2 + half)))
    assert low < 1 < mean < high


def test_one_round_has_no_interval_and_unpaired_rounds_are_an_error():
    mean, low, high = paired_ratio([2.0], [3.0])
    assert mean == pytest.approx(1.5) and math.isnan(low) and math.isnan(high)
    with pytest.raises(ValueError):
        paired_ratio([1.0, 2.0], [1.0])


def test_in_turn_starts_each_round_one_system_later():
    assert [in_turn("abc", r) for r in range(4)] == [list("abc"), list("bca"), list("cab"),
                                                   list("abc")]
