"""The agent's journal lives in the experiment ledger: a version-1 ledger is migrated in
place (its experiments kept), and queued changes follow one path: pending -> approved or
rejected, approved -> applied or lapsed."""

from __future__ import annotations

import sqlite3

import pytest

from oxserve.agent.actions import Action
from oxserve.agent.goal import goal_from_dict
from oxserve.agent.journal import Journal
from oxserve.agent.loop import AgentLoop
from oxserve.agent.policy import Outcome
from oxserve.feedback import ledger as ledger_module
from oxserve.feedback.ledger import Ledger, LedgerError
from oxserve.feedback.workload import load_workload


def test_a_version_1_ledger_is_migrated_through_every_version_keeping_its_experiments(tmp_path):
    path = tmp_path / "old.sqlite"
    conn = sqlite3.connect(path)
    for statement in ledger_module._SCHEMA[:2]:  # the experiments and samples tables of version 1
        conn.execute(statement)
    conn.execute("PRAGMA user_version = 1")
    conn.execute("INSERT INTO experiments (created_at, status, description, config_a, config_b, config_diff, "
                 "workload_name, workload, environment) VALUES ('t', 'running', 'old one', '{}', '{}', '', 'w', '{}', '{}')")
    conn.commit()
    conn.close()
    with Ledger(path) as ledger:
        assert ledger.get(1).description == "old one"
        assert ledger.connection.execute("PRAGMA user_version").fetchone()[0] == ledger_module.SCHEMA_VERSION == 4
        run = Journal(ledger).start_run("rules", {"name": "g"}, {"max_num_seqs": 1}, revision="abc")
        assert Journal(ledger).run(run).incumbent == {"max_num_seqs": 1}
        Journal(ledger).set_incumbent(run, {"max_num_seqs": 2}, "def")
        got = Journal(ledger).run(run)
        assert (got.start_revision, got.revision, got.incumbent) == ("abc", "def", {"max_num_seqs": 2})
    with Ledger(path) as ledger:  # opened again: nothing to migrate, still valid
        assert Journal(ledger).runs()[0].policy == "rules"


def test_a_version_3_ledger_keeps_its_queued_changes_through_the_rebuild_that_allows_lapsed(tmp_path):
    path = tmp_path / "v3.sqlite"
    conn = sqlite3.connect(path)
    for statement in ledger_module._SCHEMA[: -len(ledger_module._AGENT_LAPSED_SCHEMA)]:
        conn.execute(statement)
    conn.execute("PRAGMA user_version = 3")
    conn.execute("INSERT INTO agent_runs (created_at, status, policy, goal, start, incumbent) "
                 "VALUES ('t', 'finished', 'rules', '{}', '{}', '{}')")
    conn.execute("INSERT INTO agent_changes (run_id, created_at, status, base, action, evidence, note) "
                 "VALUES (1, 't', 'approved', '{}', '{\"changes\": {\"max_num_seqs\": 8}}', '{}', 'ok')")
    conn.commit()
    conn.close()
    with Ledger(path) as ledger:
        journal = Journal(ledger)
        (change,) = journal.changes(1)
        assert (change.id, change.status, change.action, change.note) == (1, "approved", {"changes": {"max_num_seqs": 8}}, "ok")
        assert journal.decide(1, "lapsed", "no longer wins").status == "lapsed"


def test_steps_count_against_the_budget_but_the_held_out_measurement_does_not(tmp_path):
    with Ledger(tmp_path / "l.sqlite") as ledger:
        journal = Journal(ledger)
        run = journal.start_run("search", {}, {})
        eids = [ledger.start_experiment({}, {}, load_workload("smoke")) for _ in range(3)]
        journal.add_step(run, "profile", "p", {}, seconds=10)
        journal.add_step(run, "experiment", "e", {}, experiment_id=eids[0], seconds=100)
        journal.add_step(run, "confirm", "c", {}, experiment_id=eids[1], seconds=90)
        journal.add_step(run, "held_out", "h", {}, experiment_id=eids[2], seconds=120)
        assert journal.spent(run) == (200.0, 2)
        assert [s.kind for s in journal.steps(run)] == ["profile", "experiment", "confirm", "held_out"]


def test_a_change_is_approved_or_rejected_once_and_applied_only_when_approved(tmp_path):
    with Ledger(tmp_path / "l.sqlite") as ledger:
        journal = Journal(ledger)
        run = journal.start_run("rules", {}, {})
        first = journal.queue_change(run, {"dtype": "float32"}, {"changes": {"dtype": "bfloat16"}}, {"ratio": 1.3})
        second = journal.queue_change(run, {}, {"changes": {"max_num_seqs": 8}}, {"ratio": 2.0})
        with pytest.raises(LedgerError, match="cannot be applied"):
            journal.decide(first, "applied")
        assert journal.decide(first, "approved", "checked the fidelity numbers").status == "approved"
        with pytest.raises(LedgerError, match="cannot be rejected"):
            journal.decide(first, "rejected")
        assert journal.decide(first, "applied").note == "checked the fidelity numbers"
        assert journal.decide(second, "rejected").status == "rejected"
        with pytest.raises(LedgerError, match="cannot be approved"):
            journal.decide(second, "approved")
        with pytest.raises(LedgerError, match="no queued change 99"):
            journal.decide(99, "approved")
        assert [c.id for c in journal.changes(status="pending")] == []


def test_an_approved_change_applies_as_measured_only_on_its_own_incumbent_else_it_is_measured_again(tmp_path):
    goal = goal_from_dict({"objective": {"workload": "smoke"}, "start": {"max_num_seqs": 1},
                           "search_space": {"max_num_seqs": [1, 8], "dtype": ["float32", "bfloat16"]},
                           "risk": {"needs_approval": ["max_num_seqs", "dtype"]}})
    with Ledger(tmp_path / "l.sqlite") as ledger:
        journal = Journal(ledger)
        run = journal.start_run("rules", {"name": "g"}, goal.start)

        def approve(changes: dict, base: dict) -> int:
            action = Action(changes, "proven elsewhere", 1.5, "rules:test")
            outcome = Outcome(action, base, True, (), (), 1.5, 100.0)
            change = journal.queue_change(run, base, action.to_dict(), outcome.to_dict())
            journal.decide(change, "approved")
            return change

        loop = AgentLoop(goal, None, ledger, run, tmp_path, log=lambda line: None)
        as_measured = approve({"max_num_seqs": 8}, {"max_num_seqs": 1})
        loop._apply_approved()  # measured against this very incumbent: applied, no experiment
        assert journal.change(as_measured).status == "applied" and loop.incumbent == {"max_num_seqs": 8}
        assert loop.incumbent_rate == 100.0 and not ledger.list(5)

        # Measured against the start; the incumbent has moved on and already holds the change.
        stale = approve({"max_num_seqs": 8}, {"max_num_seqs": 1})
        loop._apply_approved()
        assert journal.change(stale).status == "lapsed" and "already 8" in journal.change(stale).note
        assert loop.incumbent == {"max_num_seqs": 8} and not ledger.list(5)
        assert journal.steps(run)[-1].kind == "reject" and f"change {stale} lapsed" in journal.steps(run)[-1].reasoning
        with pytest.raises(LedgerError, match="lapsed: it cannot be applied"):
            journal.decide(stale, "applied")
