import numpy as np
import pytest

from oxserve.feedback import stats
from oxserve.feedback.stats import (
    B_FASTER, B_SLOWER, NO_DIFFERENCE, SUSPECT, bootstrap_median_ci, compare,
    interleaved_order, mann_whitney_u, more_pairs_needed, pair_ratios, split_by_arm, verdict,
)


def noisy(rng, mean, n, noise=0.02):
    return mean * (1.0 + noise * rng.standard_normal(n))


@pytest.mark.parametrize("noise_threshold", [0.02, 0.0])
def test_aa_false_positive_rate_is_near_nominal(noise_threshold):
    # 400 simulated A/A experiments, fresh noise each; even without the noise gate the
    # CI + Mann–Whitney conditions alone must keep false positives near alpha = 5%.
    rng = np.random.default_rng(1234)
    positives = 0
    for trial in range(400):
        a, b = noisy(rng, 100.0, 10), noisy(rng, 100.0, 10)
        positives += verdict(a, b, noise_threshold=noise_threshold, seed=trial) != NO_DIFFERENCE
    assert positives / 400 <= 0.06


def test_a_real_ten_percent_shift_is_detected():
    rng = np.random.default_rng(7)
    for trial in range(20):
        a, b = noisy(rng, 100.0, 10), noisy(rng, 110.0, 10)
        c = compare(a, b, seed=trial)
        assert c.verdict == B_FASTER, c.reason
        assert c.ci_low > 1.0 and c.median_ratio == pytest.approx(1.1, abs=0.03)
    assert verdict(b, a) == B_SLOWER


def test_a_shift_within_the_noise_threshold_is_not_called():
    rng = np.random.default_rng(3)
    a, b = noisy(rng, 100.0, 12, noise=0.001), noisy(rng, 101.0, 12, noise=0.001)
    c = compare(a, b)
    assert c.ci_low > 1.0 and c.p_value < 0.05  # statistically real...
    assert c.verdict == NO_DIFFERENCE and "noise" in c.reason  # ...but too small to count


def test_rates_above_the_roofline_are_suspect():
    rng = np.random.default_rng(0)
    a, b = noisy(rng, 100.0, 8), noisy(rng, 150.0, 8)
    c = compare(a, b, roofline=120.0)
    assert c.verdict == SUSPECT and "roofline" in c.reason
    assert verdict(a, b, roofline=1000.0) == B_FASTER


def test_comparison_to_dict_is_json_ready():
    import json
    rng = np.random.default_rng(0)
    d = compare(noisy(rng, 10, 6), noisy(rng, 10, 6)).to_dict()
    assert json.loads(json.dumps(d))["n_pairs"] == 6


def test_mann_whitney_matches_scipy_on_random_cases():
    from scipy import stats as scipy_stats

    rng = np.random.default_rng(42)
    for _ in range(150):
        n1, n2 = rng.integers(1, 16, size=2)
        x, y = rng.normal(5.5, 1, n1), rng.normal(5.0, 1, n2)
        ours, ref = mann_whitney_u(x, y, "exact"), scipy_stats.mannwhitneyu(x, y, method="exact")
        assert ours.u == pytest.approx(ref.statistic) and ours.p_value == pytest.approx(ref.pvalue)
        # Ties (rounding, plus one certain) -> normal approximation with tie correction.
        x, y = np.round(x, 1), np.append(np.round(y, 1), np.round(x[0], 1))
        ours = mann_whitney_u(x, y)
        ref = scipy_stats.mannwhitneyu(x, y, method="asymptotic")
        assert ours.method == "asymptotic"
        assert ours.u == pytest.approx(ref.statistic) and ours.p_value == pytest.approx(ref.pvalue)


def test_exact_distribution_is_a_symmetric_distribution():
    p = stats._u_distribution(7, 5)
    assert p.sum() == pytest.approx(1.0) and np.allclose(p, p[::-1])


def test_mann_whitney_edge_cases():
    assert mann_whitney_u([1.0, 2.0, 3.0], [4.0, 5.0, 6.0]).p_value == pytest.approx(0.1)
    assert mann_whitney_u([2.0, 2.0], [2.0, 2.0]).p_value == 1.0
    with pytest.raises(ValueError, match="ties"):
        mann_whitney_u([1.0, 2.0], [2.0, 3.0], method="exact")


def test_bootstrap_ci_is_seeded_and_brackets_the_median():
    values = np.random.default_rng(0).normal(1.0, 0.05, 15) + 0.1
    lo, hi = bootstrap_median_ci(values, seed=5)
    assert (lo, hi) == bootstrap_median_ci(values, seed=5)
    assert lo <= np.median(values) <= hi


def test_inputs_are_validated():
    with pytest.raises(ValueError, match="paired"):
        pair_ratios([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="positive"):
        pair_ratios([1.0, 0.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="non-empty"):
        pair_ratios([], [])


def test_interleaved_order_is_abba_blocks_and_seeded():
    order = interleaved_order(7, seed=11)
    assert len(order) == 16  # rounded up to whole blocks of two pairs
    blocks = {"".join(order[i:i + 4]) for i in range(0, len(order), 4)}
    assert blocks <= {"ABBA", "BAAB"}
    assert order == interleaved_order(7, seed=11)
    assert {"".join(interleaved_order(40, seed=s)[:4]) for s in range(10)} == {"ABBA", "BAAB"}


def test_split_by_arm_pairs_runs_and_drops_incomplete_pairs():
    order = ["A", "B", "B", "A", "B", "A"]
    a, b = split_by_arm(order, [1.0, 2.0, 3.0, 4.0, 5.0])  # last run missing
    assert a.tolist() == [1.0, 4.0] and b.tolist() == [2.0, 3.0]
    with pytest.raises(ValueError, match="one A and one B"):
        split_by_arm(["A", "A"], [1.0, 2.0])


def test_more_pairs_needed():
    rng = np.random.default_rng(0)
    assert more_pairs_needed([1.0], [1.0], max_pairs=20) == 4  # 1 -> at least MIN_PAIRS, even
    tight_a, tight_b = noisy(rng, 100, 8, 0.001), noisy(rng, 100, 8, 0.001)
    assert more_pairs_needed(tight_a, tight_b, max_pairs=20) == 0
    loose_a, loose_b = noisy(rng, 100, 8, 0.2), noisy(rng, 100, 8, 0.2)
    assert more_pairs_needed(loose_a, loose_b, max_pairs=20) == 8  # doubles
    assert more_pairs_needed(loose_a, loose_b, max_pairs=10) == 2  # capped
    assert more_pairs_needed(loose_a, loose_b, max_pairs=8) == 0
