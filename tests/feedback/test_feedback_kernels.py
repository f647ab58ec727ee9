"""`oxserve bench kernels`: the engine's ops pass against plain references; candidates that
return wrong values, leave outputs unwritten, or memorise inputs they have seen are rejected."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from tiny_models import TINY_TEXT_CONFIG

from oxserve.cli import main
from oxserve.model.config import TextModelConfig
from oxserve.profiling.opbench import REGISTRY, BenchShapes
from oxserve.profiling.opbench.harness import run_case
from oxserve.profiling.opbench.registry import Op

CFG = TextModelConfig.from_hf_dict(TINY_TEXT_CONFIG)
SHAPES = BenchShapes(batches=(1, 3), contexts=(24,))
CPU = torch.device("cpu")
REQUIRED_OPS = {
    "kda.chunked", "kda.recurrent_step", "kda.recurrent_step_bf16_state", "mla.attention_int8", "mla.attention_fp8", "conv.step", "conv.chunk", "mla.attention", "dsa.indexer", "dsa.store_keys",
    "moe.router", "moe.experts", "hc.collapse", "hc.expand", "rmsnorm", "lm_head",
}


def run(op_name: str, candidate, dtype=torch.float32, case_index: int = 0, reps: int = 4):
    op = REGISTRY[op_name]
    case = op.cases(CFG, SHAPES, dtype, CPU)[case_index]
    return run_case(op, CFG, case, "under test", candidate, CPU, warmup=1, reps=reps)


def test_every_model_op_is_registered():
    assert REQUIRED_OPS <= set(REGISTRY)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_implementations_pass(dtype):
    results = [run_case(op, CFG, case, name, candidate, CPU, warmup=1, reps=2)
               for op in REGISTRY.values() for case in op.cases(CFG, SHAPES, dtype, CPU)
               for name, candidate in op.candidates.items()]
    failed = [(r.op, r.case, r.reason) for r in results if not r.passed]
    assert not failed
    assert all(r.timing.median_us > 0 for r in results)


def test_wrong_values_are_rejected():
    def off_by_ten_percent(cfg, inputs):
        real = REGISTRY["rmsnorm"].candidates["torch"](cfg, inputs)

        def run_(out):
            real(out)
            out[0].mul_(1.1)
        return run_

    result = run("rmsnorm", off_by_ten_percent)
    assert not result.passed and "wrong on input set 0" in result.reason and "max error" in result.reason


def test_unwritten_outputs_are_rejected():
    def half_written(cfg, inputs):
        real = REGISTRY["kda.recurrent_step"].candidates["torch"](cfg, inputs)
        scratch = None

        def run_(out):
            nonlocal scratch
            scratch = scratch or tuple(torch.empty_like(t) for t in out)
            real(scratch)
            out[0][: out[0].shape[0] // 2 + 1].copy_(scratch[0][: out[0].shape[0] // 2 + 1])
            out[1].copy_(scratch[1])
        return run_

    result = run("kda.recurrent_step", half_written, case_index=1)  # batch 3: rows 2.. stay poisoned
    assert not result.passed and "NaN" in result.reason


def test_memorising_the_first_input_is_rejected():
    memo = []

    def first_input_only(cfg, inputs):
        real = REGISTRY["moe.experts"].candidates["engine"](cfg, inputs)

        def run_(out):
            if not memo:
                real(out)
                memo.append(out[0].clone())
            out[0].copy_(memo[0])
        return run_

    result = run("moe.experts", first_input_only)
    assert not result.passed and "input set 1" in result.reason


def test_replaying_seen_inputs_is_caught_on_inputs_regenerated_after_timing():
    """Right on every input it saw before (the check and the timed calls rotate through the
    same input sets), and fast on them; wrong on new ones: only the check after timing sees it."""
    seen: dict[tuple, torch.Tensor] = {}

    def replay(cfg, inputs):
        real = REGISTRY["lm_head"].candidates["torch"](cfg, inputs)

        def run_(out):
            key = tuple(inputs["x"].flatten()[:4].tolist())  # a cheap fingerprint of the input
            if key not in seen and len(seen) < 3:
                real(out)
                seen[key] = out[0].clone()
            out[0].copy_(seen.get(key, next(iter(seen.values()))))
        return run_

    result = run("lm_head", replay)
    assert not result.passed and "regenerated after timing" in result.reason
    assert result.timing is not None  # it got through the timed calls


def test_weights_may_be_prepared_at_bind_and_the_recheck_brings_new_ones():
    """lm_head's weight is a model weight: the same in every input set, so a copy made when the
    candidate binds (as a packed layout is) stays right; the recheck after timing regenerates
    it and binds anew, so a copy kept from an earlier binding is caught."""
    def prepared_at_bind(keep_first: bool):
        kept: list[torch.Tensor] = []

        def bind(cfg, inputs):
            kept.append(inputs["weight"].double().clone())
            weight = kept[0] if keep_first else kept[-1]

            def run_(out):
                out[0].copy_(inputs["x"].double() @ weight.T)
            return run_
        return bind

    assert run("lm_head", prepared_at_bind(keep_first=False)).passed
    stale = run("lm_head", prepared_at_bind(keep_first=True))
    assert not stale.passed and "regenerated after timing" in stale.reason


def test_a_crashing_candidate_is_rejected_not_fatal():
    def broken(cfg, inputs):
        def run_(out):
            raise RuntimeError("kernel launch failed")
        return run_

    result = run("conv.step", broken)
    assert not result.passed and "kernel launch failed" in result.reason


def test_a_reference_mismatch_in_selection_ops_is_detected():
    """The DSA indexer's check judges selections by score: a wrong pool is rejected."""
    def off_by_one_pool(cfg, inputs):
        real = REGISTRY["dsa.indexer"].candidates["torch"](cfg, inputs)

        def run_(out):
            real(out)
            first = out[0][:, 0]
            first.copy_(torch.where(first >= cfg.index_kpool, first - cfg.index_kpool, first + cfg.index_kpool))
        return run_

    assert not run("dsa.indexer", off_by_one_pool, case_index=1).passed


def test_cli_table_json_and_exit_status(tiny_model_dir, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # main() rewrites sys.argv
    code = main(["bench", "kernels", "--model", str(tiny_model_dir), "--ops", "rmsnorm,kda.recurrent_step,dsa.indexer",
                 "--batch", "2", "--context", "16", "--reps", "2", "--warmup", "1", "--ceilings", "none", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0
    assert {r["op"] for r in doc["results"]} == {"rmsnorm", "kda.recurrent_step", "dsa.indexer"}
    assert all(r["passed"] and r["timing"]["median_us"] > 0 for r in doc["results"])


def test_registering_a_candidate_benches_it(monkeypatch):
    op: Op = REGISTRY["hc.expand"]
    monkeypatch.setitem(op.candidates, "zeros", lambda cfg, inputs: lambda out: out[0].zero_())
    results = {r.impl: r for r in (run_case(op, CFG, op.cases(CFG, SHAPES, torch.float32, CPU)[0], name, c, CPU,
                                            warmup=1, reps=2) for name, c in op.candidates.items())}
    assert results["torch"].passed and not results["zeros"].passed
