"""When an experiment proves a change: the one acceptance rule every policy is held to."""

from __future__ import annotations

from oxserve.agent.goal import Goal
from oxserve.feedback.ledger import ExperimentRecord
from oxserve.feedback.stats import B_FASTER, SUSPECT

LIMIT_REPAIR_COST = 0.05  # the most speed a change that repairs a broken limit may cost
# The most the incumbent (A) may fall below its last measured rate before the experiment is
# distrusted: well past this machine's run-to-run noise (10-15%), so only a slowed baseline trips it.
BASELINE_DROP = 0.3


def judge(record: ExperimentRecord, goal: Goal, baseline_rate: float | None = None) -> list[str]:
    """Why `record` does not prove B better than A under `goal` (empty: it does). B must be
    faster -- the CI of the median ratio excludes 1 in the right direction, the median moved
    past the noise threshold, Mann-Whitney significant --, pass the quality gate and the
    output check, not be suspect (faster than the roofline allows), and keep every limit of
    the goal. When the incumbent (A) breaks a limit that B keeps, B need only not be slower
    by more than LIMIT_REPAIR_COST: meeting the goal's limits comes before speed. With
    `baseline_rate` (the incumbent's last measured rate), A must not have run more than
    BASELINE_DROP slower than that: a B that slows its baseline wins by cheating."""
    if record.status != "finished":
        return [f"experiment {record.id} {record.status}: {record.error}"] + _quality(record, goal)
    stats = record.stats or {}
    median_a = stats.get("median_a")
    baseline = []
    if baseline_rate and median_a is not None and median_a < baseline_rate * (1 - BASELINE_DROP):
        baseline = [f"baseline check: A ran at {median_a:.4g}, {median_a / baseline_rate:.2f}x its last measured "
                    f"{baseline_rate:.4g}: something slowed the baseline"]
    limits = _limits(stats.get("medians", {}).get("B", {}), goal, "B")
    a_breaks = _limits(stats.get("medians", {}).get("A", {}), goal, "A", missing_breaks=False)
    reasons = []
    if record.verdict == SUSPECT:
        reasons.append(f"suspect: {stats.get('reason', 'faster than the roofline allows')}")
    elif a_breaks and not limits:
        # B repairs a limit the incumbent breaks: it may cost a little speed, not more.
        # Any verdict: a 15% loss that 4 pairs cannot call significant is still a 15% loss.
        if stats.get("median_ratio", 0.0) < 1 - LIMIT_REPAIR_COST:
            reasons.append(f"repairs {', '.join(a_breaks)} but costs more than {LIMIT_REPAIR_COST:.0%}: {stats.get('reason', '')}")
    elif record.verdict != B_FASTER:
        reasons.append(f"{record.verdict}: {stats.get('reason', '')}".rstrip(": "))
    reasons += _quality(record, goal) if record.quality else ["quality gate: no result"]
    return reasons + baseline + [f"limit {problem}" for problem in limits]


def _limits(medians: dict, goal: Goal, arm: str, missing_breaks: bool = True) -> list[str]:
    """The goal's limits that an arm's run-metric medians break (or, if `missing_breaks`, do not report)."""
    broken = []
    for name, bound in goal.limits.items():
        value = medians.get(name)
        if value is None:
            if missing_breaks:
                broken.append(f"{name}: not measured")
        elif value > bound:
            broken.append(f"{name}: {arm}'s median {value:.4g} over {bound:.4g}")
    return broken


def quality_failed(record: ExperimentRecord) -> bool:
    return record.quality is not None and not record.quality.get("passed", False)


def _quality(record: ExperimentRecord, goal: Goal) -> list[str]:
    q = record.quality
    if q is None or q.get("passed"):
        return []
    reasons = []
    if not q.get("gate_passed", False):
        reasons.append(f"quality gate failed: max divergence {q.get('max_divergence', float('nan')):.4g} nats "
                       f"(bound {q.get('bound', goal.quality_bound)})")
    for name, check in (q.get("outputs") or {}).items():
        if not check.get("passed"):
            reasons.append(f"output check failed ({name}): B's workload outputs are {check.get('shortfall', float('nan')):.3g} "
                           f"nats/token less likely than A's under A (bound {check.get('bound')})")
    return reasons
