"""The agent's journal lives in the experiment ledger: a version-1 ledger is migrated in
place (its experiments kept), and queued changes follow one path: pending -> approved or
rejected, approved -> applied."""

from __future__ import annotations

import sqlite3

import pytest

from oxserve.agent.journal import Journal
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
        assert ledger.connection.execute("PRAGMA user_version").fetchone()[0] == ledger_module.SCHEMA_VERSION == 3
        run = Journal(ledger).start_run("rules", {"name": "g"}, {"max_num_seqs": 1}, revision="abc")
        assert Journal(ledger).run(run).incumbent == {"max_num_seqs": 1}
        Journal(ledger).set_incumbent(run, {"max_num_seqs": 2}, "def")
        got = Journal(ledger).run(run)
        assert (got.start_revision, got.revision, got.incumbent) == ("abc", "def", {"max_num_seqs": 2})
    with Ledger(path) as ledger:  # opened again: nothing to migrate, still valid
        assert Journal(ledger).runs()[0].policy == "rules"


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
