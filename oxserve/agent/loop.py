"""The agent's loop: profile the incumbent, ask the policy, check, experiment, judge, confirm,
adopt (or queue for a person), until the budget is spent; then measure the result once on
the held-out workload. Every step lands in the journal as it ends, so `--resume` continues
where a stopped run left off and `oxserve agent report` can tell the whole story.

The incumbent is engine options and, for a goal with a `code` section, a commit: the run
starts from HEAD, a patch is tried as a commit on the incumbent's (patches.py), and both
arms of every experiment are `git:` arms measured by this tree's harness.
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oxserve.agent.actions import Action, check_action, needs_approval
from oxserve.agent.diagnosis import Diagnosis, ProfileError, diagnose
from oxserve.agent.goal import Goal
from oxserve.agent.journal import Journal
from oxserve.agent.judge import judge, quality_failed
from oxserve.agent.patches import PatchError, digest, prepare
from oxserve.agent.plans import OPTION as PLAN_OPTION
from oxserve.agent.plans import PlanError, concrete, kl_budget
from oxserve.agent.policy import AgentState, Outcome, Policy
from oxserve.experiment.arms import REPO_ROOT, Arm, export_revision, harness_digest, resolve_revision
from oxserve.experiment.launch import WorkerError
from oxserve.experiment.procedure import Settings, run_experiment
from oxserve.feedback.ledger import ExperimentRecord, Ledger, LedgerError
from oxserve.feedback.workload import Workload
from oxserve.quantization.plan import QuantizationPlan


@dataclass
class AgentLoop:
    goal: Goal
    policy: Policy
    ledger: Ledger
    run_id: int
    workdir: Path  # profiles go here
    threads: int | None = None
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)

    def __post_init__(self) -> None:
        self.journal = Journal(self.ledger)
        run = self.journal.run(self.run_id)
        self.start: dict[str, Any] = run.start
        self.incumbent: dict[str, Any] = run.incumbent
        self.start_revision: str | None = run.start_revision
        self.revision: str | None = run.revision  # the incumbent's code
        self._prepared: dict[tuple, str] = {}  # (patch digest, base commit) -> the patched commit
        self._harness = harness_digest()  # what measures every experiment of this run
        self.history: list[Outcome] = outcomes_of(self.journal, self.run_id)
        self.incumbent_rate: float | None = _last_rate(self.journal, self.run_id)
        self.diagnosis: Diagnosis | None = None
        self._rejections_seen = 0

    def run(self) -> None:
        try:
            self.journal.set_status(self.run_id, "running")
            while self._next():
                pass
            self._held_out()
            self.journal.set_status(self.run_id, "finished")
        except KeyboardInterrupt:
            self.journal.add_step(self.run_id, "stop", "stopped by the user (Ctrl-C); `--resume` continues")
            self.journal.set_status(self.run_id, "stopped")
            self.log(f"agent run {self.run_id} stopped; continue with `oxserve agent run --resume {self.run_id}`")
            raise
        except Exception as e:
            self.journal.set_status(self.run_id, "failed", f"{type(e).__name__}: {e}")
            raise

    # --- one iteration ----------------------------------------------------------------

    def _next(self) -> bool:
        """One proposal tested; False when the budget is spent or nothing is left to try."""
        self._apply_approved()
        spent_s, experiments = self.journal.spent(self.run_id)
        budget = self.goal.budget
        if experiments >= budget.experiments or spent_s >= budget.wall_time_s:
            self.journal.add_step(self.run_id, "stop", f"budget spent: {spent_s:.0f} s, {experiments} experiments")
            return False
        if self.policy.needs_diagnosis and self.diagnosis is None and not self._diagnose():
            return False
        state = AgentState(self.goal, self.incumbent, self.incumbent_rate, self.diagnosis, list(self.history),
                           self.revision)
        action = self._choose(state)
        if action is None:
            self.journal.add_step(self.run_id, "stop", "no untried action passes its checks")
            return False
        if not self._fits(action, spent_s, experiments):
            return False
        self._test(action)
        return True

    def _diagnose(self) -> bool:
        """Profile the incumbent for the policy; False (the search stops, the held-out
        measurement still runs) when the profile fails."""
        t0 = time.monotonic()
        self.log(f"profiling the incumbent {_show(self.incumbent)}")
        out = self.workdir / f"run{self.run_id}-profile{len(self.history)}"
        try:
            with tempfile.TemporaryDirectory(prefix="oxserve-agent-profile-") as tmp:
                source = None if self.revision is None else export_revision(self.revision, Path(tmp) / "tree")
                self.diagnosis = diagnose({**self.goal.base_options, **self._concrete(self.incumbent)},
                                          self.goal.workload, out, source=source)
        except (ProfileError, PlanError) as e:
            self.journal.add_step(self.run_id, "stop", f"profiling the incumbent failed, so the policy has nothing to "
                                  f"read: {e}", seconds=time.monotonic() - t0)
            return False
        self.journal.add_step(self.run_id, "profile", self.diagnosis.headline[0] if self.diagnosis.headline else "",
                              self.diagnosis.summary(), seconds=time.monotonic() - t0)
        return True

    def _choose(self, state: AgentState) -> Action | None:
        t0 = time.monotonic()
        proposals = self.policy.propose(state)
        self._journal_policy_rejections()
        for action in proposals:
            problems = check_action(action, self.goal, self.incumbent)
            if not problems and state.tried(action):
                problems = ["tested already against this incumbent (or failed the quality gate)"]
            if not problems and action.patch:
                problems = self._prepare_patch(action)
            if not problems:
                problems = self._prepare_plan(action)
            if problems:
                self.journal.add_step(self.run_id, "check", "; ".join(problems), action=action.to_dict())
                continue
            self.journal.add_step(self.run_id, "propose", action.rationale, {"predicted_ratio": action.predicted_ratio},
                                  action=action.to_dict(), seconds=time.monotonic() - t0)
            return action
        return None

    def _prepare_patch(self, action: Action) -> list[str]:
        """Apply the patch on the incumbent's commit in a worktree and run the goal's tests
        there (the last cheap check); why not, if it fails."""
        if (digest(action.patch), self.revision) in self._prepared:
            return []
        if self.revision is None:
            return ["this run measures the working tree: code patches need a goal with a code section"]
        t0 = time.monotonic()
        message = (f"agent: {action.rationale.splitlines()[0][:72] if action.rationale else 'patch'}\n\n"
                   f"Proposed by {action.origin} (predicted x{action.predicted_ratio:.3f}); patch {digest(action.patch)} "
                   f"on {self.revision[:12]}. Not yet measured.")
        try:
            prepared = prepare(action.patch, self.revision, self.goal.code, REPO_ROOT, message)
        except PatchError as e:
            return [str(e)]
        self._prepared[(digest(action.patch), self.revision)] = prepared.commit
        self.journal.add_step(self.run_id, "check", f"patch {digest(action.patch)} applies on {self.revision[:12]} "
                              f"and passes the tests: commit {prepared.commit[:12]}", {"tests": prepared.tests,
                              "commit": prepared.commit}, action=action.to_dict(), seconds=time.monotonic() - t0)
        return []

    def _prepare_plan(self, action: Action) -> list[str]:
        """Make the quantization plan a `sensitivity@B` marker stands for (the sensitivity
        command, once per model, dtype and budget); why not, if it fails."""
        budget = kl_budget(action.changes.get(PLAN_OPTION))
        if budget is None:
            return []
        t0 = time.monotonic()
        try:
            path = self._concrete({**self.incumbent, **action.changes})[PLAN_OPTION]
        except PlanError as e:
            return [str(e)]
        layers = QuantizationPlan.load(path).layers
        self.journal.add_step(self.run_id, "check", f"quantization plan within {budget} nats/token: {path} "
                              f"({sum(e.get('weights') == 'w8a8' for e in layers.values())} layers W8A8, "
                              f"{sum(len(e) - ('weights' in e) for e in layers.values())} cache choices)",
                              {"plan": path, "layers": {str(k): v for k, v in layers.items()}},
                              action=action.to_dict(), seconds=time.monotonic() - t0)
        return []

    def _concrete(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """`options` as an engine takes them: a plan marker replaced by its plan file."""
        return concrete(options, self.goal.current_options(options), self.workdir)

    def _fits(self, action: Action, spent_s: float, experiments: int) -> bool:
        """Whether one more experiment (and its confirmation) fits what is left of the budget,
        judged by the longest experiment so far."""
        longest = max((s.seconds for s in self.journal.steps(self.run_id) if s.kind in ("experiment", "confirm")),
                      default=0.0)
        needed = (2 if self.goal.confirm else 1) * longest
        if spent_s + needed > self.goal.budget.wall_time_s or experiments + (2 if self.goal.confirm else 1) > self.goal.budget.experiments:
            self.journal.add_step(self.run_id, "stop", f"not enough budget left for {action.describe()}: "
                                  f"{self.goal.budget.wall_time_s - spent_s:.0f} s left, an experiment takes ~{longest:.0f} s")
            return False
        return True

    def _test(self, action: Action) -> None:
        outcome = self._measure(action)
        if outcome.reasons:
            self.journal.add_step(self.run_id, "reject", "; ".join(outcome.reasons), outcome.to_dict(),
                                  action=action.to_dict())
            self.log(f"rejected {action.describe()}: {'; '.join(outcome.reasons)}")
        elif needs_approval(action, self.goal):
            change = self.journal.queue_change(self.run_id, dict(self.incumbent), action.to_dict(), outcome.to_dict())
            self.journal.add_step(self.run_id, "queue", f"proven, but {', '.join(needs_approval(action, self.goal))} "
                                  f"needs a person: change {change} waits (`oxserve agent approve {change}`)",
                                  outcome.to_dict(), action=action.to_dict())
            self.log(f"queued change {change}: {action.describe()}, x{outcome.ratio:.3f}; waits for approval")
        else:
            self._adopt({**self.incumbent, **action.changes}, outcome.revision, outcome,
                        f"accepted {action.describe()}: x{outcome.ratio:.3f}")

    def _measure(self, action: Action) -> Outcome:
        """An experiment of `action` against the incumbent, judged, and confirmed in a fresh
        one when it passes (against the winner's curse)."""
        candidate = {**self.incumbent, **action.changes}
        revision = self._prepared[(digest(action.patch), self.revision)] if action.patch else self.revision
        a, b = (self.incumbent, self.revision), (candidate, revision)
        record = self._experiment("experiment", action, a, b, self.goal.workload)
        # The incumbent's rate as first measured (at adoption, or the run's first experiment)
        # anchors the baseline check: a rejected experiment never lowers it.
        if self.incumbent_rate is None:
            self.incumbent_rate = _stat(record, "median_a")
        reasons = judge(record, self.goal, self.incumbent_rate)
        records = [record]
        if not reasons and self.goal.confirm:
            records.append(self._experiment("confirm", action, a, b, self.goal.workload))
            reasons = [f"confirmation: {r}" for r in judge(records[-1], self.goal, self.incumbent_rate)]
        outcome = Outcome(action, dict(self.incumbent), not reasons, tuple(reasons), tuple(r.id for r in records),
                          _stat(record, "median_ratio"), _stat(records[-1], "median_b"),
                          any(quality_failed(r) for r in records), self.revision, revision)
        self.policy.observe(outcome)
        self.history.append(outcome)
        return outcome

    def _adopt(self, options: dict, revision: str | None, outcome: Outcome, reasoning: str) -> None:
        self.incumbent, self.revision = options, revision
        self.incumbent_rate = outcome.median_b
        self.diagnosis = None
        self.journal.set_incumbent(self.run_id, options, revision)
        self.journal.add_step(self.run_id, "accept", reasoning,
                              {**outcome.to_dict(), "incumbent": options, "incumbent_rate": outcome.median_b},
                              action=outcome.action.to_dict())
        self.log(f"{reasoning}; incumbent now {_show(options)} at {outcome.median_b:.4g} {self.goal.metric}")

    def _apply_approved(self) -> None:
        """Changes a person approved since. One measured against this very incumbent (options
        and code) is adopted as it stands; one measured against another is measured again
        against this one first (the person approved the change, not an untested combination),
        and lapses when it no longer applies or no longer wins."""
        for change in self.journal.changes(self.run_id, status="approved"):
            outcome = Outcome.from_dict(change.evidence)
            if change.base == self.incumbent and outcome.base_revision == self.revision:
                self.journal.decide(change.id, "applied")
                self._adopt({**self.incumbent, **outcome.action.changes}, outcome.revision, outcome,
                            f"applied approved change {change.id}")
                continue
            action, retest = outcome.action, None
            problems = check_action(action, self.goal, self.incumbent)
            if not problems and action.patch:
                problems = self._prepare_patch(action)
            if not problems:
                problems = self._prepare_plan(action)
            if not problems:  # a person asked for it: measured even when the search's budget is spent
                self.log(f"approved change {change.id} was measured against another incumbent: measuring it again")
                retest = self._measure(action)
                problems = list(retest.reasons)
            if problems:
                landed = " (its patch stays landed on the branch: revert it there)" if action.patch else ""
                reason = f"approved change {change.id} lapsed against the current incumbent{landed}: {'; '.join(problems)}"
                self.journal.decide(change.id, "lapsed", reason)
                self.journal.add_step(self.run_id, "reject", reason, None if retest is None else retest.to_dict(),
                                      action=action.to_dict())
                self.log(reason)
                continue
            self.journal.decide(change.id, "applied", f"measured again against incumbent {_show(self.incumbent)}")
            self._adopt({**self.incumbent, **action.changes}, retest.revision, retest,
                        f"applied approved change {change.id} after measuring it again: x{retest.ratio:.3f}")

    def _journal_policy_rejections(self) -> None:
        """What the policy dropped before proposing it (an `llm` answer out of bounds, a rule
        whose cheap check failed), journaled and counted; nothing of it ran."""
        rejected = getattr(self.policy, "rejected", None)
        if not rejected:
            return
        for entry in rejected[self._rejections_seen:]:
            self.journal.add_step(self.run_id, "reject", f"proposal dropped, never executed: {entry['reason']}",
                                  {k: v for k, v in entry.items() if k != "reason"})
        self._rejections_seen = len(rejected)

    def _experiment(self, kind: str, action: Action, a: tuple[Mapping, str | None], b: tuple[Mapping, str | None],
                    workload: Workload) -> ExperimentRecord:
        """Arms are (options, commit or None for the working tree)."""
        spent_s, experiments = self.journal.spent(self.run_id)
        self.log(f"[agent run {self.run_id} | {spent_s / 60:.1f}/{self.goal.budget.wall_time_s / 60:.1f} min, "
                 f"{experiments}/{self.goal.budget.experiments} experiments] incumbent "
                 f"{_rate(self.incumbent_rate)} {_show(self.incumbent)} | {kind}: {action.describe()} "
                 f"({action.origin}, predicted x{action.predicted_ratio:.3f})")
        e = self.goal.experiment
        settings = Settings(
            a=_arm("A", self._concrete(a[0]), a[1]), b=_arm("B", self._concrete(b[0]), b[1]), workload=workload,
            base_options=self.goal.base_options, pairs=e.pairs, max_pairs=e.max_pairs, noise_threshold=e.noise,
            alpha=e.alpha, metric=self.goal.metric, quality_bound=self.goal.quality_bound, output_bound=e.output_bound,
            seed=experiments,
            run_timeout_s=e.run_timeout_s, threads=self.threads, stop_on_quality_failure=kind != "held_out",
            description=f"agent run {self.run_id} {kind}: {action.describe()} ({action.origin}, predicted "
                        f"x{action.predicted_ratio:.3f}) -- {action.rationale}",
        )
        if harness_digest() != self._harness:
            raise RuntimeError("the measuring harness (oxserve/feedback, oxserve/experiment, oxserve/options.py) "
                               "changed during this run: its experiments would not be comparable; stopped")
        t0 = time.monotonic()
        newest = max((r.id for r in self.ledger.list(1)), default=0)

        def started() -> ExperimentRecord | None:  # the record run_experiment made before it stopped
            return next((r for r in self.ledger.list(20) if r.id > newest and r.description == settings.description), None)

        try:
            record = run_experiment(settings, self.ledger, log=lambda line: self.log(f"  {line}"))
        except WorkerError as e:  # a crashed arm is a result: the experiment is recorded failed, the action rejected
            record = started()
            if record is None:
                raise RuntimeError(f"experiment '{settings.description}' failed before it was recorded: {e}") from e
            self.log(f"  experiment {record.id} failed: {e}")
        except KeyboardInterrupt:  # what it used is charged to the budget; --resume tests the action again
            if kind != "held_out":
                cut = started()
                self.journal.add_step(self.run_id, "interrupted", f"{kind} cut short by the user (Ctrl-C)",
                                      action=action.to_dict(), experiment_id=cut.id if cut else None,
                                      seconds=time.monotonic() - t0)
            raise
        evidence = {"ratio": _stat(record, "median_ratio"), "ci": [_stat(record, "ci_low"), _stat(record, "ci_high")],
                    "p_value": _stat(record, "p_value"), "median_a": _stat(record, "median_a"),
                    "median_b": _stat(record, "median_b"),
                    "predicted_ratio": action.predicted_ratio, "verdict": record.verdict,
                    "quality_passed": (record.quality or {}).get("passed"), "workload": workload.name,
                    "arms": {"A": {"options": dict(a[0]), "revision": a[1]}, "B": {"options": dict(b[0]), "revision": b[1]}}}
        self.journal.add_step(self.run_id, kind, record.description, evidence, action=action.to_dict(),
                              experiment_id=record.id, seconds=time.monotonic() - t0)
        return record

    def _held_out(self) -> None:
        """The result, measured once on a workload the search never saw (outside the budget)."""
        if self.goal.held_out is None or (self.incumbent, self.revision) == (self.start, self.start_revision):
            return
        measured = [s for s in self.journal.steps(self.run_id) if s.kind == "held_out"]
        if measured and measured[-1].evidence.get("arms", {}).get("B") == {"options": self.incumbent,
                                                                            "revision": self.revision}:
            return  # this incumbent's held-out figure stands; one adopted since (an approval) is measured again
        final = Action({k: v for k, v in self.incumbent.items() if self.start.get(k) != v},
                       f"the final incumbent against the start, on {self.goal.held_out.name}", 1.0, "held-out")
        self._experiment("held_out", final, (self.start, self.start_revision), (self.incumbent, self.revision),
                         self.goal.held_out)


def start_run(journal: Journal, goal: Goal, policy: str) -> int:
    """A new run; a goal with a code section starts from HEAD's commit."""
    return journal.start_run(policy, goal.source, goal.start, resolve_revision("HEAD") if goal.code else None)


def resumable_run(journal: Journal, run_id: int, goal: Goal, policy: str) -> int:
    run = journal.run(run_id)
    if run.status == "finished" and not journal.changes(run_id, status="approved"):
        raise LedgerError(f"agent run {run_id} is finished and has no approved change to apply: start a new one")
    if run.goal != goal.source or run.policy != policy:
        raise LedgerError(f"agent run {run_id} ran another goal or policy ({run.policy}); resume it with the same ones")
    return run_id


def outcomes_of(journal: Journal, run_id: int) -> list[Outcome]:
    """The outcomes a run's steps recorded (for `--resume` and the report)."""
    return [Outcome.from_dict(s.evidence) for s in journal.steps(run_id) if s.kind in ("accept", "reject", "queue")
            and "action" in s.evidence]



def _last_rate(journal: Journal, run_id: int) -> float | None:
    for s in reversed(journal.steps(run_id)):
        if s.kind == "accept":
            return s.evidence.get("incumbent_rate")
    return None


def _stat(record: ExperimentRecord, key: str) -> float | None:
    return (record.stats or {}).get(key)


def _show(options: Mapping) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(options.items())) or "defaults"


def _arm(label: str, options: Mapping, revision: str | None) -> Arm:
    spec = _show(options) if revision is None else f"git:{revision[:12]}" + (f",{_show(options)}" if options else "")
    return Arm(label, spec, dict(options), revision)


def _rate(rate: float | None) -> str:
    return "?" if rate is None else f"{rate:.4g}"
