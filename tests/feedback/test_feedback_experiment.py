"""Controlled experiments, for real: fresh worker processes on a tiny checkpoint.

Each experiment here is the cheapest that can reach a verdict: 4 pairs (the fewest with
which Mann-Whitney can reach p < 0.05), one torch thread per worker (two threads on a
shared two-core machine turn other load into 10x swings), a small cache.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from oxserve.cli import main
from oxserve.experiment.arms import parse_arm
from oxserve.experiment.procedure import Settings, prepare, run_arm, run_experiment, warm_up_with_quality_gate
from oxserve.feedback.ledger import Ledger
from oxserve.feedback.stats import B_FASTER, NO_DIFFERENCE
from oxserve.feedback.workload import Workload, load_workload

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def base(tiny_model_dir):
    return {"model": str(tiny_model_dir), "dtype": "float32", "cache_memory_gib": 0.05}


def settings(base, a="", b="", workload=None, **kw) -> Settings:
    return Settings(a=parse_arm("A", a), b=parse_arm("B", b), workload=workload or load_workload("smoke"),
                    base_options=base, pairs=4, max_pairs=4, threads=1, quality_prompts=2, quality_tokens=4, **kw)


@pytest.mark.slow
def test_a_a_experiments_find_no_difference(base, data_dir, tmp_path):
    """Three real A/A experiments. A correct test at alpha = 0.05 calls a difference about one
    time in twenty by design (tests/feedback/test_feedback_stats.py measures that rate on
    simulated data), so demanding three clean verdicts would make this test flaky; more than
    one false call in three (chance ~0.7% at the nominal rate) means the procedure is broken."""
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        records = [run_experiment(settings(base, seed=k), ledger, log=lambda line: None) for k in range(3)]
    verdicts = [r.verdict for r in records]
    assert sum(v != NO_DIFFERENCE for v in verdicts) <= 1, verdicts
    for r in records:
        assert r.status == "finished" and r.config_diff == "" and len(r.samples) == 8
        assert r.quality["passed"] and r.quality["max_divergence"] == 0.0  # same code, same numbers
        assert sorted(s.arm for s in r.samples) == ["A"] * 4 + ["B"] * 4
        assert r.stats["median_b"] < r.stats["rooflines"]["B"]


@pytest.mark.slow
def test_a_real_difference_is_detected(base, data_dir, tmp_path):
    """max_num_seqs 1 vs 16 with 8 requests in flight: B batches them, A runs them one by one."""
    workload = Workload.from_dict({"name": "eight_in_flight", "num_requests": 8, "input_len": {"uniform": [8, 16]},
                                   "output_len": 12, "arrival": {"concurrency": 8},
                                   "sampling": {"temperature": 0.0, "ignore_eos": True}})
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        r = run_experiment(settings(base, "max_num_seqs=1", "max_num_seqs=16", workload), ledger, log=lambda line: None)
    assert r.verdict == B_FASTER, r.stats["reason"]
    assert r.stats["ci_low"] > 1.0 and r.stats["median_ratio"] > 1.5
    assert r.quality["passed"] and r.accepted is True
    assert r.config_diff == "options.max_num_seqs: 1 -> 16"


def test_quality_gate_fails_a_change_of_outputs_and_passes_none(base, data_dir, tmp_path):
    bf16 = warm_up_with_quality_gate(prepare(settings(base, "dtype=float32", "dtype=bfloat16", quality_bound=1e-3), tmp_path))
    assert not bf16["passed"] and bf16["max_divergence"] > 1e-3
    same = warm_up_with_quality_gate(prepare(settings(base, "cache_memory_gib=0.05", "cache_memory_gib=0.06",
                                                      quality_bound=1e-3), tmp_path))
    assert same["passed"] and same["max_divergence"] <= 1e-3
    assert same["argmax_agreement"] == 1.0 and same["compared"] == same["positions"] == 8


def test_a_git_arm_runs_the_engine_of_that_revision(base, data_dir, tmp_path):
    plan = prepare(settings(base, "", "git:HEAD"), tmp_path)
    assert plan.sources["B"] != REPO and plan.records["B"]["source"].startswith("git:HEAD (")
    result = run_arm(plan, "B", 0).result
    assert Path(result["engine"]["source"]) == plan.sources["B"].resolve()
    assert result["metrics"]["output_tokens_per_s"] > 0
    with pytest.raises(ValueError, match="not found"):
        prepare(settings(base, "", "git:no-such-revision"), tmp_path)


def test_bad_arms_fail_before_any_run(base, data_dir, tmp_path):
    with pytest.raises(ValueError, match="unknown engine option"):
        prepare(settings(base, "", "max_num_seq=4"), tmp_path)
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        prepare(settings(base, "", "max_num_seqs=0"), tmp_path)
    with pytest.raises(ValueError, match="expected key=value"):
        parse_arm("B", "max_num_seqs")


def test_a_worker_failure_is_recorded_not_lost(base, data_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # main() rewrites sys.argv
    ledger_path = tmp_path / "ledger.sqlite"
    args = ["experiment", "run", "--a", "", "--b", "cache_memory_gib=0.0000001", "--workload", "smoke",
            "--model", base["model"], "--dtype", "float32", "--cache-memory-gib", "0.05", "--threads", "1",
            "--quality-prompts", "1", "--quality-tokens", "2", "--ledger", str(ledger_path)]
    assert main(args) == 1
    assert "arm B: worker exited" in capsys.readouterr().err
    with Ledger(ledger_path) as ledger:
        (record,) = ledger.list()
    assert record.status == "failed" and "cache_memory_gib" in record.error


def test_corrupt_or_missing_ledger_is_a_clear_error_before_any_run(base, data_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # main() rewrites sys.argv
    corrupt = tmp_path / "corrupt.sqlite"
    corrupt.write_bytes(b"not a database at all" * 100)
    before = corrupt.read_bytes()
    args = ["experiment", "run", "--a", "", "--b", "", "--workload", "smoke", "--model", base["model"], "--ledger", str(corrupt)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "not a SQLite database" in err and corrupt.read_bytes() == before
    missing = tmp_path / "nowhere.sqlite"
    for command in (["list"], ["show", "1"], ["plot", "--out", str(tmp_path / "p.png")]):
        assert main(["experiment", *command, "--ledger", str(missing)]) == 2
        assert "no ledger at" in capsys.readouterr().err
    assert not missing.exists()


def test_ledger_commands_read_a_finished_experiment_in_a_new_process(base, data_dir, tmp_path):
    ledger_path = tmp_path / "ledger.sqlite"
    with Ledger(ledger_path) as ledger:
        eid = ledger.start_experiment({"options": {"max_num_seqs": 1}}, {"options": {"max_num_seqs": 16}}, load_workload("smoke"),
                                      environment={})
        for i, (arm, rate) in enumerate(zip("ABBAABBA", (10, 20, 21, 11, 10.5, 19, 20.5, 9.5), strict=True)):
            ledger.add_sample(eid, i, arm, {"output_tokens_per_s": rate}, 1.0)
        ledger.finish_experiment(eid, B_FASTER, {"median_ratio": 1.9, "reason": "x", "metric": "output_tokens_per_s",
                                                 "median_a": 10.25, "median_b": 20.25, "ci_low": 1.8, "ci_high": 2.0,
                                                 "p_value": 0.03, "n_pairs": 4, "noise_threshold": 0.02,
                                                 "confidence": 0.95, "rooflines": {"A": 1e6, "B": 1e6}},
                                 {"passed": True, "max_divergence": 0.0, "bound": 0.05, "mean_divergence": 0.0,
                                  "argmax_agreement": 1.0, "positions": 8, "prompts": 2})

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "oxserve.cli", "experiment", *args, "--ledger", str(ledger_path)],
                              capture_output=True, text=True, timeout=120, cwd=REPO)

    listed, shown, plotted = cli("list"), cli("show", str(eid)), cli("plot", "--out", str(tmp_path / "p.png"))
    assert listed.returncode == 0 and "B faster" in listed.stdout and "options.max_num_seqs: 1 -> 16" in listed.stdout
    assert shown.returncode == 0 and "median B/A 1.9000" in shown.stdout and "quality gate: passed" in shown.stdout
    assert plotted.returncode == 0 and (tmp_path / "p.png").stat().st_size > 0
