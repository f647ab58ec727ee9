"""The engine with tensor parallelism or Layer Split: rank 0 in this process, the other ranks
spawned and joined over gloo. It must generate what the single-process engine generates, and
a rank that dies must stop it within seconds, with a clear error and no process left behind."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from test_speculative import SPEC, OracleProposer, pin_the_guard
from tiny_models import two_mla_checkpoint

from oxserve import LLM, SamplingParams
from oxserve.cache.planner import plan_cache, plan_split_cache
from oxserve.cache.spec import ElsewhereCacheSpec
from oxserve.config import CacheConfig, ParallelConfig, SchedulerConfig
from oxserve.engine.engine import check_parallel
from oxserve.model.loader import load_model
from oxserve.options import engine_config
from oxserve.parallel.layer_split import LayerSplit
from oxserve.parallel.workers import ParallelError, free_port, mismatch

pytestmark = pytest.mark.slow

# A small pool (preemption), short chunks (chunked prefill), prompt logprobs and a seeded sample.
OPTIONS = dict(dtype="float32", num_blocks=30, block_size=4, max_num_batched_tokens=24, max_num_seqs=4,
               enable_prefix_caching=True)  # fmt: skip


def _run(model_dir, prompts, tp, ls=1, ep=False):
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    scoring = SamplingParams(max_tokens=10, temperature=0.0, prompt_logprobs=2, ignore_eos=True)
    seeded = SamplingParams(max_tokens=10, temperature=0.8, seed=11, ignore_eos=True)
    with LLM(str(model_dir), tensor_parallel_size=tp, layer_split_size=ls, enable_expert_parallel=ep, **OPTIONS) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [scoring, seeded, greedy, greedy])
        # A second turn of each, one at a time (no prompt logprobs): it starts from the first turn's cached blocks and KDA states.
        turns = [p + o.outputs[0].token_ids + [7, 8, 9] for p, o in zip(prompts, outs)]
        outs += [llm.generate({"prompt_token_ids": p}, greedy)[0] for p in turns]
        stats = llm.engine.stats()
    return outs, stats


@pytest.fixture(scope="module")
def two_mla_model_dir(tmp_path_factory):
    return two_mla_checkpoint(tmp_path_factory.mktemp("two-mla"))


@pytest.mark.parametrize("tp,ls,ep", [(2, 1, False), (2, 1, True), (1, 2, False)], ids=["tp2", "tp2-ep", "ls2"])
def test_parallel_engine_generates_what_one_process_generates(no_top_k_model_dir, two_mla_model_dir, tp, ls, ep):
    # Tensor-parallel sums round differently from one process's, and on a model with top-k picks
    # a rounding-level difference can flip a pick (conftest.py): the likely cause of one tp2
    # failure in 19 runs.
    # A layer split computes each layer as one process does: bit for bit on any model.
    model_dir = two_mla_model_dir if ls > 1 else no_top_k_model_dir
    rng = random.Random()
    shared = [rng.randrange(2, 8000) for _ in range(20)]
    prompts = [shared + [rng.randrange(2, 8000) for _ in range(n)] for n in (30, 5, 12, 40)]
    single, _ = _run(model_dir, prompts, 1)
    parallel, stats = _run(model_dir, prompts, tp, ls, ep)
    assert stats.num_preemptions > 0, "the pool was meant to force preemption"
    assert stats.prefix_hits > 0, "the second round was meant to start from cached prefixes"
    for a, b in zip(single, parallel):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        if a.prompt_logprobs is not None:
            for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
                assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-3 for t in x)


# A rank that dies fails rank 0's next collective at once; one that hangs, after the timeout.
FAULTS = [
    (signal.SIGKILL, 30, r"rank\(s\) 1 exited|failed while", 10),
    (signal.SIGSTOP, 3, "failed while .*[Tt]imed out", 3 + 5),
]


@pytest.mark.parametrize("fault,timeout,error,within_s", FAULTS, ids=["dies", "hangs"])
def test_a_rank_that_dies_or_hangs_stops_the_engine_with_a_clear_error(tiny_model_dir, fault, timeout, error, within_s):
    llm = LLM(str(tiny_model_dir), tensor_parallel_size=2, collective_timeout=timeout, **OPTIONS)
    engine = llm.engine
    ranks = list(engine.workers.processes)
    try:
        engine.add_request("a", {"prompt_token_ids": list(range(2, 40))}, SamplingParams(max_tokens=50, ignore_eos=True))
        engine.step()
        os.kill(ranks[0].pid, fault)
        started = time.monotonic()
        with pytest.raises(ParallelError, match=error):
            for _ in range(50):
                engine.step()
        assert time.monotonic() - started < within_s
        with pytest.raises(ParallelError, match="already failed"):
            engine.step()
    finally:
        llm.close()  # kills a stopped rank
    assert not any(p.is_alive() for p in ranks)


def test_ranks_that_built_different_things_are_named():
    rank0 = {"oxserve": "0.1", "torch": "2.13.0", "config": "c", "shapes": [("w", (4, 2), "float32")], "layout": (8, 4, 2)}
    assert mismatch([rank0, dict(rank0)]) is None
    other = {**rank0, "shapes": [("w", (2, 2), "float32")], "torch": "2.12.0"}
    assert mismatch([rank0, dict(rank0), other]) == (
        "parallel rank 2 differs from rank 0 in shapes, torch: every rank must run the same oxserve, torch and checkpoint"
    )


def test_layer_split_2_holds_twice_the_tokens_in_the_same_memory_per_rank(two_mla_model_dir):
    """Capacity, from the planner alone (the specs need no process group)."""
    cache, scheduler = CacheConfig(cache_memory_gib=0.01), SchedulerConfig(max_num_seqs=4)
    whole = load_model(two_mla_model_dir, dtype=torch.float32).model
    split = load_model(two_mla_model_dir, dtype=torch.float32, ls=LayerSplit(0, 2)).model
    one = plan_cache(cache, scheduler, whole.cache_specs(torch.float32), 4096)
    per_rank = [split.cache_specs(torch.float32, ls_rank=s) for s in range(2)]
    assert [isinstance(spec, ElsewhereCacheSpec) for spec in per_rank[0]] != [
        isinstance(spec, ElsewhereCacheSpec) for spec in per_rank[1]], "each rank caches other layers"  # fmt: skip
    two = plan_split_cache(cache, scheduler, per_rank, 4096)
    assert two.block_size == one.block_size
    assert two.num_blocks >= 1.8 * one.num_blocks, (one, two)


def test_ranks_on_a_second_host_join_with_node_rank(tiny_model_dir):
    """Two "hosts" on this machine: `oxserve serve --nnodes 2 --node-rank 1` runs rank 1 (no
    engine, no HTTP server) and exits 0 when the engine on host 0 closes."""
    port = free_port()
    parallel = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-port", str(port)]
    host1 = subprocess.Popen([sys.executable, "-m", "oxserve.cli", "serve", "--model", str(tiny_model_dir), *parallel,
                              "--node-rank", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        prompts = [[random.randrange(2, 8000) for _ in range(n)] for n in (9, 30)]
        greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        with LLM(str(tiny_model_dir), **OPTIONS) as llm:
            single = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)]
        with LLM(str(tiny_model_dir), tensor_parallel_size=2, nnodes=2, master_port=port, **OPTIONS) as llm:
            assert llm.engine.workers.processes == [], "host 0 runs rank 0 only; rank 1 is host 1's"
            two = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)]
        assert two == single
        assert host1.wait(timeout=20) == 0, host1.stdout.read()
    finally:
        host1.kill()
        host1.wait()


def test_a_second_host_needs_a_known_port():
    with pytest.raises(ValueError, match="explicit master_port"):
        ParallelConfig(tensor_parallel_size=2, nnodes=2)
    with pytest.raises(ValueError, match="do not divide among nnodes=2"):
        ParallelConfig(tensor_parallel_size=3, nnodes=2, master_port=29500)


@pytest.mark.parametrize("tp,ls", [(2, 1), (1, 2)], ids=["tp2", "ls2"])
def test_speculative_greedy_on_parallel_ranks_equals_plain_greedy(tiny_model_dir, two_mla_model_dir, tp, ls, monkeypatch):
    """Drafts accepted and rejected: rank 0 tells the other ranks what each request kept, so
    their KDA states (and rings) undo the same tokens, and the output is plain greedy's."""
    pin_the_guard(monkeypatch)  # (the guard runs in this process: rank 0's scheduler)
    model_dir = two_mla_model_dir if ls > 1 else tiny_model_dir
    rng = random.Random()
    prompts = [[rng.randrange(20, 8000) for _ in range(n)] for n in (7, 33, 60)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    with LLM(str(model_dir), **OPTIONS) as llm:
        plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    with LLM(str(model_dir), tensor_parallel_size=tp, layer_split_size=ls, speculative_config=SPEC, kda_replay_len=5,
             **OPTIONS) as llm:  # fmt: skip
        llm.engine.proposer = OracleProposer({tuple(p): o for p, o in zip(prompts, plain)}, 0.3, rng.randrange(99))
        spec = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        stats = llm.engine.stats()
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    assert spec == plain


def test_an_engine_on_a_host_other_than_the_first_is_refused_by_name():
    with pytest.raises(ValueError, match="only host 0 runs the engine"):
        check_parallel(engine_config({"tensor_parallel_size": 2, "nnodes": 2, "node_rank": 1, "master_port": 29500}))
