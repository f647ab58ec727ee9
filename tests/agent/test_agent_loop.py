"""The agent's loop end to end, for real: fresh worker processes on the tiny checkpoint,
experiments in a real ledger, the CLI in its own process (Ctrl-C, --resume, report)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import sys
from pathlib import Path

import pytest
import yaml

from oxserve.agent.actions import Action, check_action
from oxserve.agent.goal import goal_from_dict
from oxserve.agent.journal import Journal
from oxserve.agent.loop import AgentLoop, outcomes_of, resumable_run, start_run
from oxserve.agent.policies.llm import LLMPolicy
from oxserve.agent.policies.rules import RulesPolicy
from oxserve.agent.policies.search import SearchPolicy
from oxserve.agent.policy import AgentState, Outcome
from oxserve.agent.report import build_report, render_markdown
from oxserve.default_model import default_model
from oxserve.experiment.procedure import STOPPED_BY_QUALITY_GATE
from oxserve.feedback.ledger import Ledger, LedgerError

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "server"))  # the server tests' harness
from server_harness import serve  # noqa: E402

sys.path.insert(0, str(REPO / "tests" / "agent"))
from planted import Planted  # noqa: E402

pytestmark = pytest.mark.slow


def goal_dict(model: Path, **over) -> dict:
    run = {"temperature": 0.0, "ignore_eos": True}
    return {
        "name": "tiny",
        "objective": {"workload": {"name": "tiny_search", "num_requests": 8, "input_len": {"uniform": [8, 16]},
                                   "output_len": 12, "arrival": {"concurrency": 8}, "sampling": run}},
        "start": {"max_num_seqs": 1, "dtype": "float32"},
        "base_options": {"model": str(model), "cache_memory_gib": 0.05, "threads": 1},
        "search_space": {"max_num_seqs": [1, 8], "dtype": ["float32", "bfloat16"]},
        "experiment": {"pairs": 4, "max_pairs": 4},
        **over,
    }


def test_lowered_precision_is_caught_a_proven_change_waits_for_approval_then_holds_out(tiny_model_dir, data_dir, tmp_path):
    held_out = {"name": "tiny_held_out", "num_requests": 6, "seed": 3, "input_len": {"uniform": [10, 20]},
                "output_len": 10, "arrival": {"concurrency": 6}, "sampling": {"temperature": 0.0, "ignore_eos": True}}
    goal = goal_from_dict(goal_dict(tiny_model_dir, constraints={"quality_bound": 1e-3},
                                    risk={"needs_approval": ["max_num_seqs"]}, budget={"experiments": 6},
                                    objective={**goal_dict(tiny_model_dir)["objective"], "held_out": held_out}))
    bf16 = Action({"dtype": "bfloat16"}, "planted: lowers precision", 1.3, "planted")
    batch = Action({"max_num_seqs": 8}, "planted: batch the eight in flight", 2.0, "planted")
    policy = Planted([bf16, batch])
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        journal = Journal(ledger)
        run = start_run(journal, goal, policy.name)
        AgentLoop(goal, policy, ledger, run, tmp_path, threads=1, log=lambda line: None).run()

        first = ledger.get(1)  # the planted precision cut: stopped by the quality gate, no pair run
        assert first.status == "failed" and first.error == STOPPED_BY_QUALITY_GATE and not first.samples
        assert not first.quality["passed"] and first.quality["max_divergence"] > 1e-3
        kinds = [s.kind for s in journal.steps(run)]
        assert kinds[:2] == ["propose", "experiment"] and kinds[2] == "reject"
        assert "quality gate failed" in journal.steps(run)[2].reasoning
        # Proven (an experiment and a fresh confirmation) but reserved for a person: queued, not adopted.
        (change,) = journal.changes(run)
        assert change.status == "pending" and change.action["changes"] == {"max_num_seqs": 8}
        assert len(change.evidence["experiment_ids"]) == 2 and change.evidence["ratio"] > 1.5
        assert all(ledger.get(e).accepted for e in change.evidence["experiment_ids"])
        assert journal.run(run).incumbent == goal.start and journal.run(run).status == "finished"
        assert "failed the quality gate" in " ".join(s.reasoning for s in journal.steps(run) if s.kind == "check")

        journal.decide(change.id, "approved", "reviewed")
        # Another change was adopted meanwhile: the approved one was measured against an
        # incumbent that no longer holds, so it is measured again before it applies.
        moved = {**goal.start, "max_num_batched_tokens": 64}
        journal.set_incumbent(run, moved)
        experiments_before = len(ledger.list(50))
        resumable_run(journal, run, goal, policy.name)  # a finished run with an approved change continues
        AgentLoop(goal, policy, ledger, run, tmp_path, threads=1, log=lambda line: None).run()
        assert journal.change(change.id).status == "applied"
        assert journal.run(run).incumbent == {**moved, "max_num_seqs": 8}
        applied = next(s for s in journal.steps(run) if s.kind == "accept")
        assert "after measuring it again" in applied.reasoning and applied.evidence["base"] == moved
        remeasured = applied.evidence["experiment_ids"]
        assert len(remeasured) == 2 and min(remeasured) > max(change.evidence["experiment_ids"])
        assert all(ledger.get(e).config_a["options"]["max_num_batched_tokens"] == 64 for e in remeasured)
        assert len(ledger.list(50)) == experiments_before + 3  # the re-test, its confirmation, the held-out
        report = build_report(journal, run)
        assert report["held_out"]["ratio"] > 1.5 and report["held_out"]["quality_passed"]
        assert report["held_out"]["workload"] == "tiny_held_out"
        assert "held-out workload** (tiny_held_out)" in render_markdown(report)
        with pytest.raises(LedgerError, match="finished"):
            resumable_run(journal, run, goal, policy.name)


def test_ctrl_c_stops_cleanly_and_resume_finishes_with_the_rules(tiny_model_dir, data_dir, tmp_path):
    goal_file = tmp_path / "goal.yaml"
    goal_file.write_text(yaml.safe_dump(goal_dict(tiny_model_dir, search_space={"max_num_seqs": [1, 8]},
                                                  confirm=False, budget={"experiments": 3})))
    ledger_path = tmp_path / "ledger.sqlite"
    command = [sys.executable, "-m", "oxserve.cli", "agent", "run", "--goal", str(goal_file), "--ledger", str(ledger_path),
               "--workdir", str(tmp_path / "work")]
    env = {**os.environ, "OXSERVE_DATA_DIR": str(data_dir)}
    # The agent takes Ctrl-C as a terminal's foreground job does: a suite started in the
    # background of a script (`make test &`) ignores SIGINT, and its children would inherit that.
    agent = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    # Ctrl-C once the first experiment has measured a run, as its log says: seven runs remain.
    log: list[str] = []
    measured = threading.Event()

    def read_log():
        for line in agent.stderr:
            log.append(line)
            if line.lstrip().startswith("run 1 ("):
                measured.set()
        measured.set()  # the agent ended first: the assertions below say how

    threading.Thread(target=read_log, daemon=True).start()
    assert measured.wait(300) and agent.poll() is None, "".join(log)
    os.killpg(agent.pid, signal.SIGINT)  # what a terminal sends the foreground group
    agent.wait(timeout=60)  # (stdout: a report only when the run ends on its own)
    err = "".join(log)
    assert agent.returncode == 130, err
    with Ledger(ledger_path) as ledger:
        journal = Journal(ledger)
        assert journal.run(1).status == "stopped" and journal.steps(1)[-1].kind == "stop"
        assert ledger.get(1).status == "failed" and "KeyboardInterrupt" in ledger.get(1).error
        # What the cut experiment used is charged to the budget.
        cut = journal.steps(1)[-2]
        assert cut.kind == "interrupted" and cut.experiment_id == 1 and cut.seconds > 1.0
        assert journal.spent(1)[1] == 1 and journal.spent(1)[0] >= cut.seconds

    done = subprocess.run(command + ["--resume", "1"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "| max_num_seqs=8 | rules:batch_limit |" in done.stdout  # the report: accepted with its evidence
    with Ledger(ledger_path) as ledger:
        journal = Journal(ledger)
        assert journal.run(1).status == "finished" and journal.run(1).incumbent["max_num_seqs"] == 8
        accepted = [s for s in journal.steps(1) if s.kind == "accept"]
        assert len(accepted) == 1 and ledger.get(accepted[0].evidence["experiment_ids"][0]).accepted
    report = subprocess.run([sys.executable, "-m", "oxserve.cli", "agent", "report", "--ledger", str(ledger_path),
                             "--json", "--plot", str(tmp_path / "progress.png")], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    assert json.loads(report.stdout)["final"]["max_num_seqs"] == 8 and (tmp_path / "progress.png").stat().st_size > 0


def test_the_search_baseline_measures_its_draws_and_resumes_its_study(tiny_model_dir, data_dir, tmp_path):
    goal = goal_from_dict(goal_dict(tiny_model_dir, confirm=False, budget={"experiments": 1}, policy="search"))
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        journal = Journal(ledger)
        run = start_run(journal, goal, "search")
        loop = AgentLoop(goal, SearchPolicy(seed=3), ledger, run, tmp_path, threads=1, log=lambda line: None)
        loop.run()
        (outcome,) = loop.history
        assert outcome.action.origin == "search" and outcome.experiment_ids
        # A fresh policy on the same history (a resumed run) knows the draw: it never proposes it again.
        state = AgentState(goal, loop.incumbent, loop.incumbent_rate, None, loop.history)
        again = SearchPolicy(seed=3).propose(state)
        assert again and not any(state.tried(a) for a in again)


def test_the_llm_policy_in_the_loop_against_a_real_server_runs_only_what_passes_its_checks(tiny_model_dir, data_dir, tmp_path):
    """The default model (a small code model) at a real `oxserve serve` answers what it answers, under
    the answer's JSON schema: every answer is journaled and checked, and only checked actions run."""
    goal = goal_from_dict(goal_dict(tiny_model_dir, confirm=False, budget={"experiments": 1}, policy="llm"))
    with serve(default_model(), "--dtype", "bfloat16", "--served-model-name", "oxserve-default",
               "--cache-memory-gib", "0.5", "--max-model-len", "4096", log_dir=tmp_path) as server:
        policy = LLMPolicy(base_url=f"{server.base_url}/v1", model="oxserve-default", max_tokens=256, timeout_s=120)
        with Ledger(tmp_path / "ledger.sqlite") as ledger:
            journal = Journal(ledger)
            run = start_run(journal, goal, "llm")
            AgentLoop(goal, policy, ledger, run, tmp_path, threads=1, log=lambda line: None).run()
            steps, status = journal.steps(run), journal.run(run).status
    assert status == "finished" and steps[0].kind == "profile"
    assert 1 <= policy.answers and policy.use_schema, "oxserve's own server takes the json_schema response format"
    assert not any(r["reason"].startswith("endpoint error") for r in policy.rejected), policy.rejected
    journaled = [s for s in steps if s.kind == "reject" and "answer" in s.evidence]
    assert len(journaled) == len(policy.rejected) and all("never executed" in s.reasoning for s in journaled)
    for s in steps:
        if s.experiment_id is not None:  # whatever ran passed its checks first
            changes = s.action["changes"]
            assert check_action(Action(changes, "", 1.0, "llm"), goal, goal.start) == []


def test_a_sensitivity_marker_becomes_a_plan_made_once_and_measured_as_a_file(tiny_model_dir, data_dir, tmp_path):
    goal = goal_from_dict(goal_dict(tiny_model_dir, search_space={"quantization_plan": [None, "sensitivity@0.05"]},
                                    confirm=False, budget={"experiments": 1}))
    marker = Action({"quantization_plan": "sensitivity@0.05"}, "planted: a plan within 0.05 nats", 1.2, "planted")
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        journal = Journal(ledger)
        run = start_run(journal, goal, "planted")
        AgentLoop(goal, Planted([marker]), ledger, run, tmp_path, threads=1, log=lambda line: None).run()
        (made,) = [s for s in journal.steps(run) if s.kind == "check" and "quantization plan" in s.reasoning]
        plan = Path(made.evidence["plan"])
        assert plan.is_file() and plan.is_relative_to(tmp_path / "plans") and made.evidence["layers"]
        (record,) = ledger.list(5)
        assert record.config_b["options"]["quantization_plan"] == str(plan)  # the experiment ran the file
        assert "quantization_plan" not in record.config_a["options"] or not record.config_a["options"]["quantization_plan"]


def test_a_profile_that_fails_stops_the_search_with_its_reason_not_the_run(tiny_model_dir, data_dir, tmp_path):
    goal = goal_from_dict(goal_dict(tiny_model_dir, base_options={"model": str(tmp_path / "no-such-model"),
                                                                  "threads": 1}))
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        journal = Journal(ledger)
        run = start_run(journal, goal, "rules")
        AgentLoop(goal, RulesPolicy(), ledger, run, tmp_path, threads=1, log=lambda line: None).run()
        (step,) = journal.steps(run)
        assert step.kind == "stop" and "profiling the incumbent failed" in step.reasoning
        assert "no-such-model" in step.reasoning and journal.run(run).status == "finished" and not ledger.list(5)


def test_an_approved_change_that_no_longer_wins_lapses_and_is_not_tried_again(tiny_model_dir, data_dir, tmp_path):
    """Approved against the start, re-measured against a moved incumbent, where it fails the
    quality gate: it lapses with its re-test journaled (so it is never retried) and the
    person's note kept."""
    goal = goal_from_dict(goal_dict(tiny_model_dir, constraints={"quality_bound": 1e-3},
                                    risk={"needs_approval": ["dtype"]}, budget={"experiments": 2}))
    bf16 = Action({"dtype": "bfloat16"}, "approved on another incumbent", 1.3, "planted")
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        journal = Journal(ledger)
        run = start_run(journal, goal, "planted")
        measured = Outcome(bf16, dict(goal.start), True, (), (), 1.3, 50.0)
        change = journal.queue_change(run, dict(goal.start), bf16.to_dict(), measured.to_dict())
        journal.decide(change, "approved", "looks fine to me")
        journal.set_incumbent(run, {**goal.start, "max_num_seqs": 8})
        AgentLoop(goal, Planted([bf16]), ledger, run, tmp_path, threads=1, log=lambda line: None).run()
        lapsed = journal.change(change)
        assert lapsed.status == "lapsed" and lapsed.note.startswith("looks fine to me; ")
        assert "quality gate failed" in lapsed.note
        (record,) = ledger.list(5)  # the re-test only: stopped by the gate, and the policy's bf16 never ran
        assert record.error == STOPPED_BY_QUALITY_GATE
        (retest,) = outcomes_of(journal, run)
        assert retest.quality_failed and retest.experiment_ids == (record.id,)
        assert journal.run(run).incumbent == {**goal.start, "max_num_seqs": 8}
        assert any(s.kind == "check" and "failed the quality gate" in s.reasoning for s in journal.steps(run))
