"""When an experiment proves a change: the one acceptance rule every policy is held to."""

from __future__ import annotations

from oxserve.agent.goal import Goal
from oxserve.feedback.ledger import ExperimentRecord
from oxserve.feedback.stats import B_FASTER, SUSPECT


def judge(record: ExperimentRecord, goal: Goal) -> list[str]:
    """Why `record` does not prove B better than A under `goal` (empty: it does). B must be
    faster -- the CI of the median ratio excludes 1 in the right direction, the median moved
    past the noise threshold, Mann-Whitney significant --, pass the quality gate, not be
    suspect (faster than the roofline allows), and keep every limit of the goal."""
    if record.status != "finished":
        return [f"experiment {record.id} {record.status}: {record.error}"] + _quality(record, goal)
    reasons = []
    stats = record.stats or {}
    if record.verdict == SUSPECT:
        reasons.append(f"suspect: {stats.get('reason', 'faster than the roofline allows')}")
    elif record.verdict != B_FASTER:
        reasons.append(f"{record.verdict}: {stats.get('reason', '')}".rstrip(": "))
    reasons += _quality(record, goal) if record.quality else ["quality gate: no result"]
    medians_b = stats.get("medians", {}).get("B", {})
    for name, bound in goal.limits.items():
        value = medians_b.get(name)
        if value is None:
            reasons.append(f"limit {name}: not measured")
        elif value > bound:
            reasons.append(f"limit {name}: B's median {value:.4g} over {bound:.4g}")
    return reasons


def quality_failed(record: ExperimentRecord) -> bool:
    return record.quality is not None and not record.quality.get("passed", False)


def _quality(record: ExperimentRecord, goal: Goal) -> list[str]:
    q = record.quality
    if q is None or q.get("passed"):
        return []
    return [f"quality gate failed: max divergence {q.get('max_divergence', float('nan')):.4g} nats "
            f"(bound {q.get('bound', goal.quality_bound)})"]
