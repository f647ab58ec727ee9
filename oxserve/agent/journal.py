"""The agent's journal, in the experiment ledger: runs, the steps of their loops with the
reasoning and evidence of each, and the changes that wait for a person.

A step is written when it ends, with the wall time it took; the budget of a resumed run is
what its steps already spent. Experiments are referenced by id, never copied.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from oxserve.feedback.ledger import Ledger, LedgerError

RUN_STATUSES = ("running", "stopped", "finished", "failed")


@dataclass(frozen=True)
class Run:
    id: int
    created_at: str
    finished_at: str | None
    status: str
    policy: str
    goal: dict
    start: dict
    incumbent: dict
    error: str | None
    start_revision: str | None = None  # the commit the run started from (None: the working tree)
    revision: str | None = None  # the incumbent's code


@dataclass(frozen=True)
class Step:
    id: int
    run_id: int
    created_at: str
    kind: str  # profile | propose | check | experiment | confirm | interrupted | accept | reject | queue | held_out | stop
    action: dict | None  # option changes
    reasoning: str
    evidence: dict
    experiment_id: int | None
    seconds: float


@dataclass(frozen=True)
class Change:
    id: int
    run_id: int
    created_at: str
    decided_at: str | None
    status: str
    base: dict
    action: dict
    evidence: dict
    note: str


class Journal:
    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self._db = ledger.connection

    # --- runs ---------------------------------------------------------------------------

    def start_run(self, policy: str, goal: dict, start: dict, revision: str | None = None) -> int:
        cur = self._db.execute(
            "INSERT INTO agent_runs (created_at, status, policy, goal, start, incumbent, start_revision, revision)"
            " VALUES (?, 'running', ?, ?, ?, ?, ?, ?)",
            (_now(), policy, _dumps(goal), _dumps(start), _dumps(start), revision, revision))
        return int(cur.lastrowid)

    def run(self, run_id: int) -> Run:
        row = self._db.execute("SELECT * FROM agent_runs WHERE id = ?", (run_id,)).fetchone()
        if row is None:
            raise LedgerError(f"no agent run {run_id} in {self.ledger.path}")
        return Run(row["id"], row["created_at"], row["finished_at"], row["status"], row["policy"],
                   json.loads(row["goal"]), json.loads(row["start"]), json.loads(row["incumbent"]), row["error"],
                   row["start_revision"], row["revision"])

    def runs(self) -> list[Run]:
        return [self.run(r[0]) for r in self._db.execute("SELECT id FROM agent_runs ORDER BY id")]

    def set_incumbent(self, run_id: int, options: dict, revision: str | None = None) -> None:
        self._db.execute("UPDATE agent_runs SET incumbent = ?, revision = ? WHERE id = ?",
                         (_dumps(options), revision, run_id))

    def set_status(self, run_id: int, status: str, error: str | None = None) -> None:
        if status not in RUN_STATUSES:
            raise LedgerError(f"run status must be one of {RUN_STATUSES}, got {status!r}")
        finished = None if status == "running" else _now()
        self._db.execute("UPDATE agent_runs SET status = ?, finished_at = ?, error = ? WHERE id = ?",
                         (status, finished, error, run_id))

    # --- steps --------------------------------------------------------------------------

    def add_step(self, run_id: int, kind: str, reasoning: str, evidence: dict | None = None, *,
                 action: dict | None = None, experiment_id: int | None = None, seconds: float = 0.0) -> int:
        cur = self._db.execute(
            "INSERT INTO agent_steps (run_id, created_at, kind, action, reasoning, evidence, experiment_id, seconds)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (run_id, _now(), kind, None if action is None else _dumps(action), reasoning, _dumps(evidence or {}),
             experiment_id, float(seconds)))
        return int(cur.lastrowid)

    def steps(self, run_id: int) -> list[Step]:
        rows = self._db.execute("SELECT * FROM agent_steps WHERE run_id = ? ORDER BY id", (run_id,)).fetchall()
        return [Step(r["id"], r["run_id"], r["created_at"], r["kind"], None if r["action"] is None else json.loads(r["action"]),
                     r["reasoning"], json.loads(r["evidence"]), r["experiment_id"], r["seconds"]) for r in rows]

    def spent(self, run_id: int) -> tuple[float, int]:
        """(wall seconds, experiments) the run's search has used (the final held-out measurement
        is outside the budget)."""
        seconds, experiments = self._db.execute(
            "SELECT COALESCE(SUM(seconds), 0), COUNT(experiment_id) FROM agent_steps WHERE run_id = ? AND kind != 'held_out'",
            (run_id,)).fetchone()
        return float(seconds), int(experiments)

    # --- changes waiting for a person ---------------------------------------------------

    def queue_change(self, run_id: int, base: dict, action: dict, evidence: dict) -> int:
        cur = self._db.execute(
            "INSERT INTO agent_changes (run_id, created_at, status, base, action, evidence) VALUES (?, ?, 'pending', ?, ?, ?)",
            (run_id, _now(), _dumps(base), _dumps(action), _dumps(evidence)))
        return int(cur.lastrowid)

    def change(self, change_id: int) -> Change:
        row = self._db.execute("SELECT * FROM agent_changes WHERE id = ?", (change_id,)).fetchone()
        if row is None:
            raise LedgerError(f"no queued change {change_id} in {self.ledger.path}")
        return _change(row)

    def changes(self, run_id: int | None = None, status: str | None = None) -> list[Change]:
        clause, params = [], []
        if run_id is not None:
            clause.append("run_id = ?")
            params.append(run_id)
        if status is not None:
            clause.append("status = ?")
            params.append(status)
        where = f"WHERE {' AND '.join(clause)}" if clause else ""
        return [_change(r) for r in self._db.execute(f"SELECT * FROM agent_changes {where} ORDER BY id", params)]

    def decide(self, change_id: int, status: str, note: str = "") -> Change:
        """A person's decision (approved / rejected), or the loop's: applied, or lapsed (measured
        again against a later incumbent, it no longer applies or wins). Only a pending change
        can be approved or rejected; only an approved one applied or lapsed."""
        allowed = {"approved": "pending", "rejected": "pending", "applied": "approved", "lapsed": "approved"}
        if status not in allowed:
            raise LedgerError(f"a change can be approved, rejected, applied or lapsed, not {status!r}")
        current = self.change(change_id)
        if current.status != allowed[status]:
            raise LedgerError(f"change {change_id} is {current.status}: it cannot be {status}")
        notes = "; ".join(n for n in (current.note, note) if n)  # the person's note (and landed commit) stays
        self._db.execute("UPDATE agent_changes SET status = ?, decided_at = ?, note = ? WHERE id = ?",
                         (status, _now(), notes, change_id))
        return self.change(change_id)


def _change(r) -> Change:
    return Change(r["id"], r["run_id"], r["created_at"], r["decided_at"], r["status"], json.loads(r["base"]),
                  json.loads(r["action"]), json.loads(r["evidence"]), r["note"])


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def _dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)
