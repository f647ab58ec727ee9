"""`oxserve agent report`: what a run found, with the evidence, from the journal and ledger;
and the incumbent's progress over the budget, as a plot (several runs on one figure)."""

from __future__ import annotations

import math
from pathlib import Path

from oxserve.agent.journal import Journal, Step
from oxserve.agent.loop import outcomes_of
from oxserve.agent.patches import digest
from oxserve.agent.policy import Outcome


def progress(steps: list[Step]) -> list[tuple[float, float]]:
    """(minutes of budget spent, incumbent's median metric) at the start and at each adoption.
    The start's rate is the first experiment's A median (journals before it was recorded:
    B's median over the median pair ratio, close to it)."""
    points, spent = [], 0.0
    for s in steps:
        if s.kind == "held_out":  # measured after the search, outside its budget
            continue
        spent += s.seconds
        if s.kind == "experiment" and not points and s.evidence.get("ratio"):
            points.append((0.0, s.evidence.get("median_a") or s.evidence["median_b"] / s.evidence["ratio"]))
        elif s.kind == "accept" and s.evidence.get("incumbent_rate") is not None:
            points.append((spent / 60.0, s.evidence["incumbent_rate"]))
    if points:
        points.append((spent / 60.0, points[-1][1]))  # the curve runs to the end of the budget
    return points


def build_report(journal: Journal, run_id: int) -> dict:
    run = journal.run(run_id)
    steps = journal.steps(run_id)
    outcomes = outcomes_of(journal, run_id)
    spent_s, experiments = journal.spent(run_id)
    curve = progress(steps)
    held_out = next((s for s in reversed(steps) if s.kind == "held_out"), None)  # the final incumbent's
    calibration = [abs(math.log(o.ratio / o.action.predicted_ratio)) for o in outcomes
                   if o.ratio and o.action.predicted_ratio > 0 and o.action.origin != "search"]
    return {
        "run": run.id, "policy": run.policy, "status": run.status, "goal": run.goal.get("name", ""),
        "spent_minutes": spent_s / 60.0, "experiments": experiments, "budget": run.goal.get("budget", {}),
        "start": run.start, "final": run.incumbent, "start_revision": run.start_revision, "revision": run.revision,
        "start_rate": curve[0][1] if curve else None, "final_rate": curve[-1][1] if curve else None,
        "held_out": None if held_out is None else {**held_out.evidence, "experiment_id": held_out.experiment_id},
        # Adopted only: a proven change that waits for a person is listed under "queued".
        "accepted": [Outcome.from_dict(s.evidence).to_dict() for s in steps if s.kind == "accept" and "action" in s.evidence],
        "rejected": [o.to_dict() for o in outcomes if not o.accepted],
        "queued": [{"id": c.id, "status": c.status, "changes": c.action["changes"], "patch": c.action.get("patch", ""),
                    "rationale": c.action.get("rationale", ""), "ratio": c.evidence.get("ratio")}
                   for c in journal.changes(run_id)],
        "policy_answers_rejected": sum(1 for s in steps if s.kind == "reject" and "answer" in s.evidence),
        "cheap_checks_failed": sum(1 for s in steps if s.kind == "reject" and "check" in s.evidence),
        "prediction_error": sum(calibration) / len(calibration) if calibration else None,
        "curve": curve,
    }


def render_markdown(r: dict) -> str:
    lines = [f"# Agent run {r['run']} ({r['policy']}, {r['status']}): {r['goal']}", "",
             f"- budget used: {r['spent_minutes']:.1f} min, {r['experiments']} experiments (of {r['budget']})",
             f"- start: {_options(r['start'])}{_code(r['start_revision'])}",
             f"- final: {_options(r['final'])}{_code(r['revision'])}"]
    if r["start_rate"] and r["final_rate"]:
        lines.append(f"- search workload: {r['start_rate']:.4g} -> {r['final_rate']:.4g} "
                     f"(x{r['final_rate'] / r['start_rate']:.2f}; medians of separate experiments)")
    h = r["held_out"]
    if h and h.get("ratio"):
        lines.append(f"- **held-out workload** ({h['workload']}): final/start x{h['ratio']:.3f}, 95% CI "
                     f"[{h['ci'][0]:.3f}, {h['ci'][1]:.3f}], quality gate {'passed' if h['quality_passed'] else 'FAILED'} "
                     f"(experiment {h['experiment_id']})")
    elif r["final"] == r["start"]:
        lines.append("- held-out workload: not measured (nothing was adopted)")
    if r["prediction_error"] is not None:
        lines.append(f"- predictions: mean |log(measured / predicted)| = {r['prediction_error']:.3f}")
    if r["policy_answers_rejected"]:
        lines.append(f"- policy answers rejected (never executed): {r['policy_answers_rejected']}")
    if r.get("cheap_checks_failed"):
        lines.append(f"- remedies dropped because their cheap check failed: {r['cheap_checks_failed']}")
    lines += ["", "## Accepted", "", "| changes | origin | predicted | measured | experiments |", "|---|---|---|---|---|"]
    lines += [_row(o) for o in r["accepted"]]
    lines += ["", "## Rejected", "", "| changes | origin | predicted | measured | experiments | why |",
              "|---|---|---|---|---|---|"]
    lines += [_row(o) + f" {'; '.join(o['reasons'])} |" for o in r["rejected"]]
    if r["queued"]:
        lines += ["", "## Waiting for a person", ""]
        lines += [f"- change {q['id']} ({q['status']}): {_described(q['changes'], q['patch'])}, measured "
                  f"x{q['ratio'] or 0:.3f} -- {q['rationale'].splitlines()[0] if q['rationale'] else ''}" for q in r["queued"]]
    return "\n".join(lines) + "\n"


def plot_runs(journal: Journal, run_ids: list[int], out_png: Path, metric: str = "output_tokens_per_s") -> Path:
    """The incumbent over the budget spent, one step line per run."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for run_id in run_ids:
        run, curve = journal.run(run_id), progress(journal.steps(run_id))
        if curve:
            ax.step([m for m, _ in curve], [v for _, v in curve], where="post", marker="o", label=f"run {run_id} ({run.policy})")
    ax.set_xlabel("budget spent (minutes)")
    ax.set_ylabel(f"incumbent {metric} (median)")
    ax.set_title("agent progress")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize="small")
    fig.savefig(out_png, dpi=100)
    return Path(out_png)


def _row(o: dict) -> str:
    measured = "-" if o["ratio"] is None else f"x{o['ratio']:.3f}"
    return (f"| {_described(o['action']['changes'], o['action'].get('patch', ''))} | {o['action']['origin']} | x{o['action']['predicted_ratio']:.3f} | "
            f"{measured} | {', '.join(map(str, o['experiment_ids']))} |")


def _described(changes: dict, patch: str) -> str:
    return f"{_options(changes) if changes else ''}{', ' if changes and patch else ''}{'patch ' + digest(patch) if patch else ''}"


def _code(revision: str | None) -> str:
    return "" if revision is None else f" at commit {revision[:12]}"


def _options(options: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(options.items())) or "(defaults)"
