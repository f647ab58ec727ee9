import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from oxserve.feedback.ledger import (
    Ledger, LedgerError, config_diff, default_ledger_path, environment_info, plot_metric,
)
from oxserve.feedback.stats import B_FASTER, NO_DIFFERENCE
from oxserve.feedback.workload import load_workload

REPO = Path(__file__).resolve().parents[2]
ENV = {"hostname": "test-host"}  # environment_info() is slow-ish (git); tested on its own
CONFIG_A = {"kv_cache": {"dtype": "bf16"}, "max_batch": 8}
CONFIG_B = {"kv_cache": {"dtype": "fp8"}, "max_batch": 8, "replay_ssm": True}


def run_python(code: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", code, *args], env=env,
                          capture_output=True, text=True, timeout=60)


def start(ledger: Ledger) -> int:
    return ledger.start_experiment(CONFIG_A, CONFIG_B, load_workload("smoke"),
                                   description="fp8 kv cache", environment=ENV)


def test_round_trip(tmp_path):
    with Ledger(tmp_path / "l.sqlite") as ledger:
        eid = start(ledger)
        running = ledger.get(eid)
        assert running.status == "running" and running.samples == ()
        for i, arm in enumerate("ABBA"):
            ledger.add_sample(eid, i, arm, {"tokens_per_s": 100.0 + i}, wall_time_s=1.5)
        ledger.finish_experiment(eid, B_FASTER, {"median_ratio": 1.1}, {"passed": True})
        r = ledger.get(eid)
    assert r.status == "finished" and r.verdict == B_FASTER and r.accepted is True
    assert r.config_a == CONFIG_A and r.config_b == CONFIG_B
    assert r.config_diff == 'kv_cache.dtype: "bf16" -> "fp8"\nreplay_ssm: (absent) -> true'
    assert r.workload_name == "smoke" and r.workload == load_workload("smoke").to_dict()
    assert r.environment == ENV and r.stats == {"median_ratio": 1.1}
    assert r.quality == {"passed": True} and r.finished_at is not None
    assert [s.arm for s in r.samples] == list("ABBA")
    assert r.metric_values("tokens_per_s", "B") == [101.0, 102.0]


def test_survives_reopen_in_a_new_process(tmp_path):
    path = tmp_path / "l.sqlite"
    with Ledger(path) as ledger:
        eid = start(ledger)
        ledger.add_sample(eid, 0, "A", {"tokens_per_s": 10.0}, 1.0)
        ledger.finish_experiment(eid, NO_DIFFERENCE, {}, {"passed": False})
    out = run_python(
        "import sys, json; from oxserve.feedback.ledger import Ledger\n"
        "r = Ledger(sys.argv[1]).get(int(sys.argv[2]))\n"
        "print(json.dumps([r.status, r.verdict, r.accepted, r.samples[0].metrics]))",
        str(path), str(eid),
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == ["finished", NO_DIFFERENCE, False, {"tokens_per_s": 10.0}]


def test_samples_survive_a_crash_before_finish(tmp_path):
    path = tmp_path / "l.sqlite"
    crash = run_python(
        "import os, signal, sys\n"
        "from oxserve.feedback.ledger import Ledger\n"
        "from oxserve.feedback.workload import load_workload\n"
        "ledger = Ledger(sys.argv[1])\n"
        "eid = ledger.start_experiment({}, {'x': 1}, load_workload('smoke'), environment={})\n"
        "for i, arm in enumerate('ABB'):\n"
        "    ledger.add_sample(eid, i, arm, {'tokens_per_s': 1.0 + i}, 0.5)\n"
        "os.kill(os.getpid(), signal.SIGKILL)  # no close, no finish\n",
        str(path),
    )
    assert crash.returncode == -9, crash.stderr
    with Ledger(path) as ledger:
        (r,) = ledger.list()
        assert r.status == "running" and len(r.samples) == 3
        ledger.fail_experiment(r.id, "runner killed")
        assert ledger.get(r.id).status == "failed"


def test_corrupt_file_raises_at_open_and_is_untouched(tmp_path):
    path = tmp_path / "l.sqlite"
    garbage = b"this is not a database\n" * 100
    path.write_bytes(garbage)
    with pytest.raises(LedgerError) as exc:
        Ledger(path)
    assert str(path) in str(exc.value) and "not a SQLite database" in str(exc.value)
    assert path.read_bytes() == garbage
    assert sorted(p.name for p in tmp_path.iterdir()) == ["l.sqlite"]


def test_damaged_sqlite_file_raises_at_open_and_is_untouched(tmp_path):
    path = tmp_path / "l.sqlite"
    damaged = b"SQLite format 3\x00" + b"\xff" * 4000
    path.write_bytes(damaged)
    with pytest.raises(LedgerError, match="cannot be used"):
        Ledger(path)
    assert path.read_bytes() == damaged


def test_foreign_database_is_rejected_and_untouched(tmp_path):
    path = tmp_path / "other.sqlite"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE users (name TEXT)")
    conn.commit()
    conn.close()
    before = path.read_bytes()
    with pytest.raises(LedgerError, match="not an oxserve ledger"):
        Ledger(path)
    assert path.read_bytes() == before


def test_other_schema_version_is_rejected(tmp_path):
    path = tmp_path / "l.sqlite"
    Ledger(path).close()
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA user_version = 99")
    conn.close()
    with pytest.raises(LedgerError, match="schema version 99"):
        Ledger(path)


def test_missing_directories_are_created(tmp_path):
    path = tmp_path / "a" / "b" / "ledger.sqlite"
    with Ledger(path) as ledger:
        assert ledger.list() == []
    assert path.exists()


def test_impossible_directory_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(LedgerError) as exc:
        Ledger(blocker / "sub" / "ledger.sqlite")
    assert "directory" in str(exc.value) and str(blocker) in str(exc.value)


def test_default_path_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("OXSERVE_DATA_DIR", str(tmp_path / "data"))
    assert default_ledger_path() == tmp_path / "data" / "ledger.sqlite"
    monkeypatch.delenv("OXSERVE_DATA_DIR")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert default_ledger_path() == tmp_path / "xdg" / "oxserve" / "ledger.sqlite"
    monkeypatch.delenv("XDG_DATA_HOME")
    assert default_ledger_path() == Path.home() / ".local/share/oxserve/ledger.sqlite"


def test_misuse_is_refused(tmp_path):
    with Ledger(tmp_path / "l.sqlite") as ledger:
        eid = start(ledger)
        ledger.add_sample(eid, 0, "A", {"tokens_per_s": 1.0}, 1.0)
        with pytest.raises(LedgerError, match="already recorded"):
            ledger.add_sample(eid, 0, "B", {"tokens_per_s": 1.0}, 1.0)
        with pytest.raises(LedgerError, match="arm"):
            ledger.add_sample(eid, 1, "C", {"tokens_per_s": 1.0}, 1.0)
        with pytest.raises(LedgerError, match="verdict"):
            ledger.finish_experiment(eid, "looks faster", {}, {"passed": True})
        with pytest.raises(LedgerError, match="passed"):
            ledger.finish_experiment(eid, B_FASTER, {}, {})
        ledger.finish_experiment(eid, B_FASTER, {}, {"passed": False})
        assert ledger.get(eid).accepted is False  # faster but failed the quality gate
        with pytest.raises(LedgerError, match="not running"):
            ledger.add_sample(eid, 1, "B", {"tokens_per_s": 1.0}, 1.0)
        with pytest.raises(LedgerError, match="no experiment 999"):
            ledger.get(999)


def test_list_is_newest_first_and_limited(tmp_path):
    with Ledger(tmp_path / "l.sqlite") as ledger:
        ids = [start(ledger) for _ in range(4)]
        assert [r.id for r in ledger.list(limit=2)] == ids[::-1][:2]


def test_config_diff_of_equal_configs_is_empty():
    assert config_diff(CONFIG_A, dict(CONFIG_A)) == ""


def test_environment_info_describes_the_machine():
    env = environment_info()
    for key in ("hostname", "cpu_model", "gpu_model", "torch_version", "python_version",
                "oxserve_version", "git_commit"):
        assert key in env
    json.dumps(env)


def test_plot_metric_writes_a_png(tmp_path):
    with Ledger(tmp_path / "l.sqlite") as ledger:
        outcomes = [(1.1, B_FASTER), (1.0, NO_DIFFERENCE), (1.2, B_FASTER)]
        for k, (speedup, verdict) in enumerate(outcomes):
            eid = start(ledger)
            for i, arm in enumerate("ABBA"):
                rate = 100.0 * (1 + 0.1 * k) * (speedup if arm == "B" else 1.0)
                ledger.add_sample(eid, i, arm, {"tokens_per_s": rate}, 1.0)
            ledger.finish_experiment(eid, verdict, {}, {"passed": True})
        out = plot_metric(ledger, tmp_path / "p.png", metric="tokens_per_s", workload="smoke")
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        with pytest.raises(ValueError, match="no finished experiments"):
            plot_metric(ledger, tmp_path / "q.png", metric="ttft_ms")
