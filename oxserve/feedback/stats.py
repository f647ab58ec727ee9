"""Statistics for controlled A/B experiments on a higher-is-better metric (e.g. tokens/s).

Runs are interleaved in ABBA-style blocks and paired two by two::

    run:   0 1 | 2 3 | 4 5 | 6 7
    arm:   A B | B A | B A | A B      <- blocks of two pairs: ABBA or BAAB, seeded
    pair:   0     1     2     3

A change is called only when three tests agree (BRIEF §3, "objectively verifiable"):
the bootstrap CI of the median B/A ratio excludes 1, the median moved by more than the
noise threshold, and a Mann–Whitney test between the A and B samples gives p < alpha.
A rate above the hardware roofline means the measurement itself is broken: "suspect".
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

B_FASTER = "B faster"
B_SLOWER = "B slower"
NO_DIFFERENCE = "no significant difference"
SUSPECT = "suspect"

NOISE_THRESHOLD = 0.02
ALPHA = 0.05
CONFIDENCE = 0.95
N_RESAMPLES = 10_000
# With 3 pairs the smallest exact two-sided Mann–Whitney p is 2/C(6,3) = 0.1 > alpha;
# 4 pairs is the least that can ever reach significance (2/C(8,4) = 0.029).
MIN_PAIRS = 4
# Exact Mann–Whitney distribution up to this many samples per arm (cost ~ n^4 / 8 flops).
EXACT_MAX_N = 50


def pair_ratios(a, b) -> np.ndarray:
    """Per-pair ratios B/A of a positive, higher-is-better metric."""
    a, b = _as_samples(a, "a"), _as_samples(b, "b")
    if a.shape != b.shape:
        raise ValueError(f"a and b must be paired (same length), got {a.size} and {b.size}")
    return b / a


def bootstrap_median_ci(
    values, confidence: float = CONFIDENCE, n_resamples: int = N_RESAMPLES, seed: int = 0
) -> tuple[float, float]:
    """Percentile-bootstrap CI of the median (seeded; all resamples in one array)."""
    values = _as_samples(values, "values")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, values.size, size=(n_resamples, values.size))
    medians = np.median(values[idx], axis=1)
    tail = (1.0 - confidence) / 2.0
    lo, hi = np.quantile(medians, [tail, 1.0 - tail])
    return float(lo), float(hi)


@dataclass(frozen=True)
class MannWhitney:
    u: float  # U of sample a: pairs (x in a, y in b) with x > y, ties counted 1/2
    p_value: float  # two-sided
    method: str  # "exact" or "asymptotic"


def mann_whitney_u(a, b, method: str = "auto") -> MannWhitney:
    """Two-sided Mann–Whitney U test. "auto": exact distribution when there are no ties
    and both samples have <= EXACT_MAX_N values, else the normal approximation with tie
    and continuity corrections (the same conventions as scipy.stats.mannwhitneyu)."""
    x, y = _as_samples(a, "a"), _as_samples(b, "b")
    n1, n2 = x.size, y.size
    combined = np.concatenate([x, y])
    ranks = _average_ranks(combined)
    u1 = float(ranks[:n1].sum() - n1 * (n1 + 1) / 2)
    u_big = max(u1, n1 * n2 - u1)
    has_ties = np.unique(combined).size < combined.size
    if method == "auto":
        method = "exact" if not has_ties and max(n1, n2) <= EXACT_MAX_N else "asymptotic"
    if method == "exact":
        if has_ties:
            raise ValueError("the exact Mann–Whitney distribution assumes no ties")
        upper_tail = _u_distribution(n1, n2)[int(round(u_big)):].sum()
        return MannWhitney(u1, float(min(1.0, 2.0 * upper_tail)), "exact")
    if method != "asymptotic":
        raise ValueError(f"method must be 'auto', 'exact' or 'asymptotic', got {method!r}")
    return MannWhitney(u1, _asymptotic_p(u_big, n1, n2, combined), "asymptotic")


@dataclass(frozen=True)
class Comparison:
    """Everything the verdict was based on; to_dict() is what the ledger stores."""

    verdict: str
    reason: str
    n_pairs: int
    median_a: float
    median_b: float
    median_ratio: float
    ci_low: float
    ci_high: float
    p_value: float
    u_statistic: float
    mw_method: str
    confidence: float
    noise_threshold: float
    alpha: float
    roofline: float | None
    ratios: tuple[float, ...]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ratios"] = list(self.ratios)
        return d


def compare(
    a,
    b,
    *,
    noise_threshold: float = NOISE_THRESHOLD,
    alpha: float = ALPHA,
    roofline: float | None = None,
    confidence: float = CONFIDENCE,
    n_resamples: int = N_RESAMPLES,
    seed: int = 0,
) -> Comparison:
    """Compare paired samples a (arm A) and b (arm B) of a higher-is-better metric.
    `roofline`: the most the hardware allows for this metric; a sample above it in
    either arm means the timing missed work, so the verdict is "suspect"."""
    ratios = pair_ratios(a, b)
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    med = float(np.median(ratios))
    lo, hi = bootstrap_median_ci(ratios, confidence, n_resamples, seed)
    mw = mann_whitney_u(a, b)
    verdict, reason = _decide(a, b, med, lo, hi, mw.p_value, noise_threshold, alpha, roofline)
    return Comparison(
        verdict=verdict, reason=reason, n_pairs=int(ratios.size),
        median_a=float(np.median(a)), median_b=float(np.median(b)), median_ratio=med,
        ci_low=lo, ci_high=hi, p_value=mw.p_value, u_statistic=mw.u, mw_method=mw.method,
        confidence=confidence, noise_threshold=noise_threshold, alpha=alpha,
        roofline=roofline, ratios=tuple(ratios.tolist()),
    )


def verdict(a, b, **kwargs) -> str:
    """Just the verdict of compare(): "B faster", "B slower", "no significant
    difference" or "suspect"."""
    return compare(a, b, **kwargs).verdict


def _decide(a, b, med, lo, hi, p, noise_threshold, alpha, roofline) -> tuple[str, str]:
    if roofline is not None:
        for arm, samples in (("B", b), ("A", a)):
            if samples.max() > roofline:
                return SUSPECT, (f"arm {arm} measured {samples.max():.6g}, above the "
                                 f"roofline {roofline:.6g}: the timing misses work")
    failed = []
    if lo <= 1.0 <= hi:
        failed.append(f"CI [{lo:.4f}, {hi:.4f}] includes 1")
    if abs(med - 1.0) <= noise_threshold:
        failed.append(f"|median ratio - 1| = {abs(med - 1.0):.4f} <= noise {noise_threshold}")
    if p >= alpha:
        failed.append(f"Mann–Whitney p = {p:.4g} >= {alpha}")
    if failed:
        return NO_DIFFERENCE, "; ".join(failed)
    reason = f"median ratio {med:.4f}, CI [{lo:.4f}, {hi:.4f}], p = {p:.4g}"
    return (B_FASTER if med > 1.0 else B_SLOWER), reason


# --- run order and stopping ---------------------------------------------------------


def interleaved_order(n_pairs: int, seed: int = 0) -> list[str]:
    """Arms ("A"/"B") in run order for at least n_pairs pairs, in blocks of two pairs,
    each block ABBA or BAAB at random. Runs 2k and 2k+1 form pair k. ABBA blocks cancel
    a linear drift (thermal, caches, background load) within each block."""
    if not isinstance(n_pairs, int) or n_pairs < 1:
        raise ValueError(f"n_pairs must be an integer >= 1, got {n_pairs!r}")
    rng = np.random.default_rng(seed)
    order: list[str] = []
    for _ in range(math.ceil(n_pairs / 2)):
        order.extend("ABBA" if rng.random() < 0.5 else "BAAB")
    return order


def split_by_arm(order, values) -> tuple[np.ndarray, np.ndarray]:
    """Paired samples (a, b) from values measured in `order`. Only complete pairs count,
    so a run cut short (crash, timeout) still gives usable pairs."""
    n_pairs = min(len(order), len(values)) // 2
    a, b = [], []
    for k in range(n_pairs):
        arms = (order[2 * k], order[2 * k + 1])
        if sorted(arms) != ["A", "B"]:
            raise ValueError(f"runs {2 * k} and {2 * k + 1} must be one A and one B, got {arms}")
        first, second = values[2 * k], values[2 * k + 1]
        a.append(first if arms[0] == "A" else second)
        b.append(second if arms[0] == "A" else first)
    return np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)


def more_pairs_needed(
    a,
    b,
    *,
    max_pairs: int,
    ci_width_threshold: float = 2 * NOISE_THRESHOLD,
    min_pairs: int = MIN_PAIRS,
    confidence: float = CONFIDENCE,
    seed: int = 0,
) -> int:
    """How many more pairs to run (0: stop). Below min_pairs: up to min_pairs. Then, while
    the CI of the median ratio is wider than ci_width_threshold (default: twice the noise
    threshold, so an effect at the threshold can be told from none), double the pairs,
    never past max_pairs. Counts are even: whole ABBA blocks."""
    n = pair_ratios(a, b).size
    if n >= max_pairs:
        return 0
    if n < min_pairs:
        extra = min_pairs - n
    else:
        lo, hi = bootstrap_median_ci(pair_ratios(a, b), confidence, seed=seed)
        if hi - lo <= ci_width_threshold:
            return 0
        extra = n
    extra += extra % 2
    return min(extra, max_pairs - n)


# --- helpers ------------------------------------------------------------------------


def _as_samples(values, name: str) -> np.ndarray:
    arr = np.asarray(values, dtype=np.float64)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D sequence of numbers")
    if not np.all(np.isfinite(arr)) or np.any(arr <= 0):
        raise ValueError(f"{name} must hold finite positive values (a rate), got {arr.tolist()}")
    return arr


def _average_ranks(values: np.ndarray) -> np.ndarray:
    """1-based ranks, tied values sharing the mean of their ranks."""
    order = np.argsort(values, kind="mergesort")
    sorted_vals = values[order]
    # Start index of each run of equal values in sorted order.
    starts = np.flatnonzero(np.concatenate([[True], sorted_vals[1:] != sorted_vals[:-1]]))
    ends = np.concatenate([starts[1:], [values.size]])
    run_rank = (starts + ends + 1) / 2.0  # mean of ranks starts+1 .. ends
    ranks = np.empty(values.size)
    ranks[order] = np.repeat(run_rank, ends - starts)
    return ranks


def _u_distribution(n1: int, n2: int) -> np.ndarray:
    """P(U = u), u = 0..n1*n2, for U = #(x > y) with n1 x's and n2 y's, no ties.
    The largest of all values is an x with probability i/(i+j), adding j to U:
        p[i, j](u) = i/(i+j) * p[i-1, j](u - j) + j/(i+j) * p[i, j-1](u)
    Probabilities rather than counts keep it exact-enough without big integers."""
    size = n1 * n2 + 1
    prev = np.zeros((n2 + 1, size))
    prev[:, 0] = 1.0  # i = 0: U is 0
    for i in range(1, n1 + 1):
        cur = np.zeros((n2 + 1, size))
        cur[0, 0] = 1.0
        for j in range(1, n2 + 1):
            cur[j, j:] = i / (i + j) * prev[j, : size - j]
            cur[j] += j / (i + j) * cur[j - 1]
        prev = cur
    return prev[n2]


def _asymptotic_p(u_big: float, n1: int, n2: int, combined: np.ndarray) -> float:
    n = n1 + n2
    _, counts = np.unique(combined, return_counts=True)
    tie_term = float((counts**3 - counts).sum()) / (n * (n - 1)) if n > 1 else 0.0
    sigma = math.sqrt(n1 * n2 / 12.0 * ((n + 1) - tie_term))
    if sigma == 0.0:  # every value tied: no evidence either way
        return 1.0
    z = (u_big - n1 * n2 / 2.0 - 0.5) / sigma  # 0.5: continuity correction
    return float(min(1.0, math.erfc(z / math.sqrt(2.0))))  # 2 * normal sf(z)
