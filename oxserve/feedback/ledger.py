"""The experiment ledger: every A/B experiment, its raw samples and its verdict, in SQLite.

Samples are committed one by one as they are measured, so an experiment cut short by a
crash keeps its data (status stays "running"). The file is checked when the ledger is
opened, before any experiment runs; a file that is not an oxserve ledger is never
overwritten.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import sqlite3
import statistics
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from oxserve.feedback import machine
from oxserve.feedback.stats import B_FASTER, B_SLOWER, NO_DIFFERENCE, SUSPECT
from oxserve.feedback.workload import Workload

SCHEMA_VERSION = 4  # stored in PRAGMA user_version; bump with a migration in _MIGRATIONS
VERDICTS = (B_FASTER, B_SLOWER, NO_DIFFERENCE, SUSPECT)
_SQLITE_MAGIC = b"SQLite format 3\x00"

_SCHEMA = (
    """CREATE TABLE experiments (
        id           INTEGER PRIMARY KEY AUTOINCREMENT,
        created_at   TEXT NOT NULL,
        finished_at  TEXT,
        status       TEXT NOT NULL CHECK (status IN ('running', 'finished', 'failed')),
        description  TEXT NOT NULL,
        config_a     TEXT NOT NULL,   -- JSON
        config_b     TEXT NOT NULL,   -- JSON
        config_diff  TEXT NOT NULL,
        workload_name TEXT NOT NULL,
        workload     TEXT NOT NULL,   -- JSON, the full workload
        environment  TEXT NOT NULL,   -- JSON
        verdict      TEXT,
        stats        TEXT,            -- JSON
        quality      TEXT,            -- JSON, with a boolean "passed"
        accepted     INTEGER,         -- 1: B faster and quality passed
        error        TEXT
    )""",
    """CREATE TABLE samples (
        experiment_id INTEGER NOT NULL REFERENCES experiments(id),
        run_index    INTEGER NOT NULL,
        arm          TEXT NOT NULL CHECK (arm IN ('A', 'B')),
        metrics      TEXT NOT NULL,   -- JSON: metric name -> value
        wall_time_s  REAL NOT NULL,
        recorded_at  TEXT NOT NULL,
        PRIMARY KEY (experiment_id, run_index)
    )""",
)

# The Infra Agent's journal (oxserve/agent/journal.py): its runs, every step of their loops
# with its reasoning and evidence, and the changes that wait for a person. Version 2.
_AGENT_SCHEMA = (
    """CREATE TABLE agent_runs (
        id           INTEGER PRIMARY KEY AUTOINCREMENT,
        created_at   TEXT NOT NULL,
        finished_at  TEXT,
        status       TEXT NOT NULL CHECK (status IN ('running', 'stopped', 'finished', 'failed')),
        policy       TEXT NOT NULL,
        goal         TEXT NOT NULL,   -- JSON, the goal file as loaded
        start        TEXT NOT NULL,   -- JSON, the first incumbent's options
        incumbent    TEXT NOT NULL,   -- JSON, the current incumbent's options
        error        TEXT
    )""",
    """CREATE TABLE agent_steps (
        id           INTEGER PRIMARY KEY AUTOINCREMENT,
        run_id       INTEGER NOT NULL REFERENCES agent_runs(id),
        created_at   TEXT NOT NULL,
        kind         TEXT NOT NULL,
        action       TEXT,            -- JSON: the option changes tested, if any
        reasoning    TEXT NOT NULL,
        evidence     TEXT NOT NULL,   -- JSON
        experiment_id INTEGER REFERENCES experiments(id),
        seconds      REAL NOT NULL    -- wall time the step took (counts against the budget)
    )""",
    """CREATE TABLE agent_changes (
        id           INTEGER PRIMARY KEY AUTOINCREMENT,
        run_id       INTEGER NOT NULL REFERENCES agent_runs(id),
        created_at   TEXT NOT NULL,
        decided_at   TEXT,
        status       TEXT NOT NULL CHECK (status IN ('pending', 'approved', 'rejected', 'applied')),
        base         TEXT NOT NULL,   -- JSON, the incumbent it was measured against
        action       TEXT NOT NULL,   -- JSON
        evidence     TEXT NOT NULL,   -- JSON: experiment ids, ratios, quality
        note         TEXT NOT NULL DEFAULT ''
    )""",
)
# Version 3: code patches as actions. The code each run started from and runs now (a commit;
# NULL: the working tree, for runs that change options only).
_AGENT_CODE_SCHEMA = (
    "ALTER TABLE agent_runs ADD COLUMN start_revision TEXT",
    "ALTER TABLE agent_runs ADD COLUMN revision TEXT",
)
# Version 4: an approved change that, measured again against a later incumbent, no longer
# applies or wins is 'lapsed'. SQLite cannot alter a CHECK: the table is rebuilt, rows kept.
_AGENT_LAPSED_SCHEMA = (
    _AGENT_SCHEMA[2].replace("CREATE TABLE agent_changes", "CREATE TABLE agent_changes_v4")
                    .replace("'applied')", "'applied', 'lapsed')"),
    "INSERT INTO agent_changes_v4 (id, run_id, created_at, decided_at, status, base, action, evidence, note) "
    "SELECT id, run_id, created_at, decided_at, status, base, action, evidence, note FROM agent_changes",
    "DROP TABLE agent_changes",
    "ALTER TABLE agent_changes_v4 RENAME TO agent_changes",
)
assert "'lapsed'" in _AGENT_LAPSED_SCHEMA[0], "the agent_changes table's CHECK was reworded"
# A fresh ledger runs every version's statements in order (the rebuild on an empty table).
_SCHEMA = _SCHEMA + _AGENT_SCHEMA + _AGENT_CODE_SCHEMA + _AGENT_LAPSED_SCHEMA
_MIGRATIONS = {1: _AGENT_SCHEMA, 2: _AGENT_CODE_SCHEMA, 3: _AGENT_LAPSED_SCHEMA}  # from version N to N + 1


class LedgerError(Exception):
    """The ledger file or its directory cannot be used, or a call breaks its rules."""


def default_ledger_path() -> Path:
    return machine.data_dir() / "ledger.sqlite"


@dataclass(frozen=True)
class Sample:
    run_index: int
    arm: str
    metrics: dict[str, float]
    wall_time_s: float
    recorded_at: str


@dataclass(frozen=True)
class ExperimentRecord:
    id: int
    created_at: str
    finished_at: str | None
    status: str
    description: str
    config_a: dict
    config_b: dict
    config_diff: str
    workload_name: str
    workload: dict
    environment: dict
    verdict: str | None
    stats: dict | None
    quality: dict | None
    accepted: bool | None
    error: str | None
    samples: tuple[Sample, ...]

    def metric_values(self, metric: str, arm: str) -> list[float]:
        """Values of one metric for one arm, in run order (runs lacking it skipped)."""
        return [s.metrics[metric] for s in self.samples if s.arm == arm and metric in s.metrics]


class Ledger:
    def __init__(self, path: str | os.PathLike | None = None) -> None:
        self.path = Path(path).expanduser() if path is not None else default_ledger_path()
        self._conn = _open(self.path)

    def close(self) -> None:
        self._conn.close()

    @property
    def connection(self) -> sqlite3.Connection:
        """The open connection (autocommit), for the agent's journal tables."""
        return self._conn

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start_experiment(
        self,
        config_a: Mapping | Any,
        config_b: Mapping | Any,
        workload: Workload,
        *,
        description: str = "",
        environment: Mapping | None = None,
    ) -> int:
        """Record a new experiment (status "running") and return its id. Configs are
        mappings or dataclasses; environment defaults to environment_info()."""
        a, b = _jsonable(config_a), _jsonable(config_b)
        env = dict(environment) if environment is not None else environment_info()
        cur = self._conn.execute(
            "INSERT INTO experiments (created_at, status, description, config_a, config_b,"
            " config_diff, workload_name, workload, environment)"
            " VALUES (?, 'running', ?, ?, ?, ?, ?, ?, ?)",
            (_now(), description, _dumps(a), _dumps(b), config_diff(a, b),
             workload.name, workload.to_json(), _dumps(env)),
        )
        return int(cur.lastrowid)

    def add_sample(
        self,
        experiment_id: int,
        run_index: int,
        arm: str,
        metrics: Mapping[str, float],
        wall_time_s: float,
    ) -> None:
        """Record one run's metrics; committed before returning."""
        if arm not in ("A", "B"):
            raise LedgerError(f"arm must be 'A' or 'B', got {arm!r}")
        if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in metrics.values()):
            raise LedgerError(f"metric values must be finite numbers, got {dict(metrics)!r}")
        self._require_running(experiment_id)
        try:
            self._conn.execute(
                "INSERT INTO samples VALUES (?, ?, ?, ?, ?, ?)",
                (experiment_id, run_index, arm, _dumps(dict(metrics)), float(wall_time_s), _now()),
            )
        except sqlite3.IntegrityError as e:
            raise LedgerError(
                f"experiment {experiment_id}: run {run_index} already recorded ({e})"
            ) from e

    def finish_experiment(
        self, experiment_id: int, verdict: str, stats: Mapping, quality: Mapping
    ) -> None:
        """Close an experiment with its verdict, the statistics behind it (e.g.
        Comparison.to_dict()) and the quality gate's result (needs a boolean "passed")."""
        if verdict not in VERDICTS:
            raise LedgerError(f"verdict must be one of {VERDICTS}, got {verdict!r}")
        if not isinstance(quality.get("passed"), bool):
            raise LedgerError(f"quality must have a boolean 'passed', got {dict(quality)!r}")
        self._require_running(experiment_id)
        accepted = verdict == B_FASTER and quality["passed"]
        self._conn.execute(
            "UPDATE experiments SET status = 'finished', finished_at = ?, verdict = ?,"
            " stats = ?, quality = ?, accepted = ? WHERE id = ?",
            (_now(), verdict, _dumps(dict(stats)), _dumps(dict(quality)), int(accepted),
             experiment_id),
        )

    def fail_experiment(self, experiment_id: int, error: str, quality: Mapping | None = None) -> None:
        """Close an experiment that could not complete (engine crash, bad config), or was cut
        short by its quality gate (then given, to be kept)."""
        self._require_running(experiment_id)
        self._conn.execute(
            "UPDATE experiments SET status = 'failed', finished_at = ?, error = ?, quality = ? WHERE id = ?",
            (_now(), error, None if quality is None else _dumps(dict(quality)), experiment_id),
        )

    def get(self, experiment_id: int) -> ExperimentRecord:
        records = self._records("WHERE id = ?", (experiment_id,))
        if not records:
            raise LedgerError(f"no experiment {experiment_id} in {self.path}")
        return records[0]

    def list(self, limit: int = 20) -> list[ExperimentRecord]:
        """The latest experiments, newest first."""
        return self._records("ORDER BY id DESC LIMIT ?", (limit,))

    def _require_running(self, experiment_id: int) -> None:
        row = self._conn.execute(
            "SELECT status FROM experiments WHERE id = ?", (experiment_id,)
        ).fetchone()
        if row is None:
            raise LedgerError(f"no experiment {experiment_id} in {self.path}")
        if row[0] != "running":
            raise LedgerError(f"experiment {experiment_id} is {row[0]}, not running")

    def _records(self, clause: str, params: tuple) -> list[ExperimentRecord]:
        rows = self._conn.execute(f"SELECT * FROM experiments {clause}", params).fetchall()
        samples: dict[int, list[Sample]] = {row["id"]: [] for row in rows}
        if rows:
            marks = ",".join("?" * len(rows))
            for s in self._conn.execute(
                f"SELECT * FROM samples WHERE experiment_id IN ({marks}) ORDER BY run_index",
                tuple(samples),
            ):
                samples[s["experiment_id"]].append(Sample(
                    s["run_index"], s["arm"], json.loads(s["metrics"]), s["wall_time_s"],
                    s["recorded_at"],
                ))
        return [_record(row, samples[row["id"]]) for row in rows]


def config_diff(a: Mapping, b: Mapping) -> str:
    """One line per differing setting, nested keys dotted: `kv_cache.dtype: "bf16" -> "fp8"`.
    Empty when the configs are equal (an A/A experiment)."""
    fa, fb = _flatten(a), _flatten(b)
    lines = []
    for key in sorted(fa.keys() | fb.keys()):
        if fa.get(key, _ABSENT) != fb.get(key, _ABSENT):
            lines.append(f"{key}: {_show(fa.get(key, _ABSENT))} -> {_show(fb.get(key, _ABSENT))}")
    return "\n".join(lines)


def environment_info() -> dict[str, Any]:
    """What an experiment's numbers depend on besides the configs."""
    commit, dirty = _git_state()
    return {
        "hostname": machine.hostname(),
        "platform": platform.platform(),
        "cpu_model": machine.cpu_model(),
        "cpu_count": machine.cpu_count(),
        "gpu_model": machine.gpu_model(),
        "torch_version": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "python_version": platform.python_version(),
        "oxserve_version": _oxserve_version(),
        "git_commit": commit,
        "git_dirty": dirty,
    }


def plot_metric(
    ledger: Ledger,
    out_png: str | os.PathLike,
    metric: str = "tokens_per_s",
    workload: str | None = None,
    limit: int = 1000,
) -> Path:
    """Plot a metric's median per arm for each finished experiment (oldest to newest),
    and the best accepted B so far as a step line. Only one workload's numbers are
    comparable: pass `workload` when the ledger holds several."""
    # Lazy imports: matplotlib is only needed here. No pyplot: no global backend state.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    points = _plot_points(ledger.list(limit), metric, workload)
    if not points:
        where = f" on workload {workload!r}" if workload else ""
        raise ValueError(f"no finished experiments with metric {metric!r}{where} in {ledger.path}")
    fig = Figure(figsize=(9, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    xs = [p["x"] for p in points]
    ax.scatter(xs, [p["a"] for p in points], marker="o", facecolors="none",
               edgecolors="grey", label="A (baseline) median")
    colours = {True: "tab:green", False: "tab:blue"}
    ax.scatter(xs, [p["b"] for p in points], c=[colours[p["accepted"]] for p in points],
               label="B median (green: accepted)")
    best, best_line = None, []
    for p in points:
        if p["accepted"]:
            best = p["b"] if best is None else max(best, p["b"])
        best_line.append(best if best is not None else float("nan"))
    ax.step(xs, best_line, where="post", color="tab:green", label="best accepted")
    ax.set_xlabel("experiment id")
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} over experiments" + (f" ({workload})" if workload else ""))
    ax.legend(loc="best", fontsize="small")
    ax.grid(alpha=0.3)
    out = Path(out_png)
    fig.savefig(out, dpi=100)
    return out


# --- opening and validating the file ------------------------------------------------


def _open(path: Path) -> sqlite3.Connection:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LedgerError(f"cannot create the ledger directory {path.parent} "
                          f"for {path}: {e.strerror or e}") from e
    if path.is_dir():
        raise LedgerError(f"ledger path {path} is a directory, not a file")
    if not os.access(path.parent, os.W_OK | os.X_OK):
        # WAL mode keeps -wal and -shm files next to the database.
        raise LedgerError(f"ledger directory {path.parent} is not writable (for {path})")
    existing = path.exists() and path.stat().st_size > 0
    if existing:
        _check_header(path)
        if not os.access(path, os.R_OK | os.W_OK):
            raise LedgerError(f"ledger file {path} is not readable and writable")
    conn = sqlite3.connect(path, isolation_level=None, timeout=30.0)  # autocommit
    conn.row_factory = sqlite3.Row
    try:
        _check_or_create_schema(conn, path)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")  # a committed sample survives power loss
        conn.execute("PRAGMA foreign_keys=ON")
    except sqlite3.Error as e:
        conn.close()
        raise LedgerError(f"ledger file {path} cannot be used as a SQLite database: {e}") from e
    except LedgerError:
        conn.close()
        raise
    return conn


def _check_header(path: Path) -> None:
    try:
        with open(path, "rb") as f:
            header = f.read(len(_SQLITE_MAGIC))
    except OSError as e:
        raise LedgerError(f"cannot read ledger file {path}: {e.strerror or e}") from e
    if header != _SQLITE_MAGIC:
        raise LedgerError(f"ledger file {path} is not a SQLite database (bad header); "
                          "move it away or pass another path -- it will not be overwritten")


def _check_or_create_schema(conn: sqlite3.Connection, path: Path) -> None:
    version, tables = _schema_state(conn)
    if version == 0 and not tables:
        conn.execute("BEGIN IMMEDIATE")  # another process may be creating it too
        version, tables = _schema_state(conn)
        if version == 0 and not tables:
            for statement in _SCHEMA:
                conn.execute(statement)
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            version, tables = SCHEMA_VERSION, set(_EXPECTED_COLUMNS)
        conn.execute("COMMIT")
    if version == 0:
        raise LedgerError(f"{path} is a SQLite database but not an oxserve ledger "
                          f"(tables: {', '.join(sorted(tables))}); it will not be overwritten")
    if version in _MIGRATIONS and version < SCHEMA_VERSION:
        version = _migrate(conn, version)
    if version != SCHEMA_VERSION:
        raise LedgerError(f"ledger {path} has schema version {version}; this oxserve "
                          f"reads version {SCHEMA_VERSION}")
    for table, expected in _EXPECTED_COLUMNS.items():
        found = {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
        if found != expected:
            raise LedgerError(f"ledger {path}: table {table!r} has columns {sorted(found)}, "
                              f"expected {sorted(expected)} (schema version {version})")


def _migrate(conn: sqlite3.Connection, version: int) -> int:
    """Bring an older ledger up to SCHEMA_VERSION, one version per transaction; its data stay."""
    while version < SCHEMA_VERSION:
        conn.execute("BEGIN IMMEDIATE")
        current = conn.execute("PRAGMA user_version").fetchone()[0]  # another process may have done it
        if current == version:
            for statement in _MIGRATIONS[version]:
                conn.execute(statement)
            conn.execute(f"PRAGMA user_version = {version + 1}")
        conn.execute("COMMIT")
        version = conn.execute("PRAGMA user_version").fetchone()[0]
    return version


def _schema_state(conn: sqlite3.Connection) -> tuple[int, set[str]]:
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    tables = {r[0] for r in conn.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")}
    return version, tables


def _expected_columns() -> dict[str, set[str]]:
    """Column names per table, read back from the schema itself (one source of truth)."""
    conn = sqlite3.connect(":memory:")
    for statement in _SCHEMA:
        conn.execute(statement)
    tables = [r[0] for r in conn.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")]
    columns = {t: {r[1] for r in conn.execute(f"PRAGMA table_info({t})")} for t in tables}
    conn.close()
    return columns


_EXPECTED_COLUMNS = _expected_columns()


# --- small helpers ------------------------------------------------------------------

_ABSENT = object()


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def _dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _jsonable(config: Mapping | Any) -> dict:
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    if not isinstance(config, Mapping):
        raise LedgerError(f"a config must be a mapping or a dataclass, got {type(config).__name__}")
    return json.loads(json.dumps(dict(config), default=str))  # plain JSON types only


def _flatten(d: Mapping, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _show(value: Any) -> str:
    return "(absent)" if value is _ABSENT else json.dumps(value, sort_keys=True)


def _record(row: sqlite3.Row, samples: list[Sample]) -> ExperimentRecord:
    def load(column: str) -> Any:
        return None if row[column] is None else json.loads(row[column])

    return ExperimentRecord(
        id=row["id"], created_at=row["created_at"], finished_at=row["finished_at"],
        status=row["status"], description=row["description"], config_a=load("config_a"),
        config_b=load("config_b"), config_diff=row["config_diff"],
        workload_name=row["workload_name"], workload=load("workload"),
        environment=load("environment"), verdict=row["verdict"], stats=load("stats"),
        quality=load("quality"),
        accepted=None if row["accepted"] is None else bool(row["accepted"]),
        error=row["error"], samples=tuple(samples),
    )


def _plot_points(records: list[ExperimentRecord], metric: str, workload: str | None) -> list[dict]:
    points = []
    for r in sorted(records, key=lambda r: r.id):
        if r.status != "finished" or (workload is not None and r.workload_name != workload):
            continue
        a, b = r.metric_values(metric, "A"), r.metric_values(metric, "B")
        if a and b:
            points.append({"x": r.id, "a": statistics.median(a), "b": statistics.median(b),
                           "accepted": bool(r.accepted)})
    return points


def _oxserve_version() -> str:
    try:
        return metadata.version("oxserve")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def _git_state() -> tuple[str | None, bool | None]:
    """(commit, has uncommitted changes) of the checkout oxserve runs from, if any."""
    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()
        # --no-optional-locks: never take index.lock, which would race other git users.
        status = subprocess.run(
            ["git", "--no-optional-locks", "-C", str(root), "status", "--porcelain"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None, None
    return commit, bool(status.strip())
