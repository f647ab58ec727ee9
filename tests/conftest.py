"""Shared fixtures: a tiny glm5_next checkpoint with a tokenizer, built once per session."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests import hf_reference as a plain module

from oxserve.default_model import build_checkpoint  # noqa: E402
from tiny_models import TINY_TEXT_CONFIG  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("tiny-model"), TINY_TEXT_CONFIG, seed=7, dtype=torch.float32)


@pytest.fixture(scope="session")
def no_top_k_model_dir(tmp_path_factory) -> Path:
    """The tiny model with an indexer that selects every pool at test lengths and a router that
    picks every expert: without a top-k pick, rounding cannot flip a selection, so outputs are
    continuous in it. For comparisons across computations that round differently (chunking,
    ReplaySSM folds, tensor-parallel sums): with two experts of four, about one run in fifty
    diverged at a first token whose top two were 0.037 apart -- a flipped pick."""
    every = {"index_topk": 512, "num_experts_per_tok": TINY_TEXT_CONFIG["n_routed_experts"]}
    return build_checkpoint(tmp_path_factory.mktemp("no-top-k"), {**TINY_TEXT_CONFIG, **every}, seed=7, dtype=torch.float32)


@pytest.fixture(scope="module", autouse=True)
def collect_garbage_after_module():
    """An engine that a test left in a reference cycle holds its caches (2 GiB by default)
    until the collector runs: collect before the next module, so that the suite's memory does
    not add up (the engine itself leaves no cycle: tests/test_capture.py checks it with the
    collector off)."""
    yield
    gc.collect()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """OXSERVE_DATA_DIR for the module: the machine's ceilings (measured once) and the default ledger."""
    path = tmp_path_factory.mktemp("data")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OXSERVE_DATA_DIR", str(path))
        yield path


def pytest_terminal_summary(terminalreporter):
    """Print how much of the reference comparisons the near-tie rule excused, and bf16 fidelity."""
    from hf_reference import FIDELITY_LINES, TALLY

    if FIDELITY_LINES:
        terminalreporter.section("bf16 fidelity against HF fp32")
        for line in FIDELITY_LINES:
            terminalreporter.write_line(line)
    if not TALLY.total:
        return
    terminalreporter.section("positions compared with the HF reference")
    terminalreporter.write_line(" compared / total  (near ties decided HF's way)")
    for test, (compared, total, ties) in sorted(TALLY.per_test.items()):
        terminalreporter.write_line(f"{compared:6d} / {total:6d}  ({ties})  {test}")
    terminalreporter.write_line(
        f"{TALLY.compared:6d} / {TALLY.total:6d}  ({TALLY.ties_broken})  all ({TALLY.compared / TALLY.total:.1%})"
    )
    if TALLY.reference_positions:
        terminalreporter.write_line(f"near ties in HF's choices: {TALLY.near_ties} of {TALLY.reference_positions} positions "
                                    f"({TALLY.near_ties / TALLY.reference_positions:.2%})")


def pytest_sessionfinish(session, exitstatus):
    """Fail the session when near ties excused more than a tenth of all compared positions,
    or were more than MAX_SUITE_TIE_RATE of the positions HF ran."""
    from hf_reference import MAX_SUITE_TIE_RATE, MIN_SUITE_FRACTION, TALLY

    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if TALLY.near_ties > MAX_SUITE_TIE_RATE * TALLY.reference_positions:
        reporter.write_line(f"FAILED: {TALLY.near_ties} of {TALLY.reference_positions} reference positions were near ties "
                            f"(> {MAX_SUITE_TIE_RATE:.0%}): the margin rule excuses too much", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if TALLY.total and TALLY.compared < MIN_SUITE_FRACTION * TALLY.total:
        reporter.write_line(
            f"FAILED: only {TALLY.compared} of {TALLY.total} reference positions were compared "
            f"(< {MIN_SUITE_FRACTION:.0%}): the near-tie rule excused too much", red=True,
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
