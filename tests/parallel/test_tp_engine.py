"""The engine with tensor parallelism: rank 0 in this process, the other ranks spawned and
joined over gloo. It must generate what the single-process engine generates, and a rank that
dies must stop it within seconds, with a clear error and no process left behind."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

from oxserve import LLM, SamplingParams
from oxserve.parallel.workers import ParallelError, mismatch

pytestmark = pytest.mark.slow

# A small pool (preemption), short chunks (chunked prefill), prompt logprobs and a seeded sample.
OPTIONS = dict(dtype="float32", num_blocks=30, block_size=4, max_num_batched_tokens=24, max_num_seqs=4,
               enable_prefix_caching=True)  # fmt: skip


def _run(model_dir, prompts, size):
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    scoring = SamplingParams(max_tokens=10, temperature=0.0, prompt_logprobs=2, ignore_eos=True)
    seeded = SamplingParams(max_tokens=10, temperature=0.8, seed=11, ignore_eos=True)
    with LLM(str(model_dir), tensor_parallel_size=size, **OPTIONS) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [scoring, seeded, greedy, greedy])
        # A second turn of each, one at a time (no prompt logprobs): it starts from the first turn's cached blocks and KDA states.
        turns = [p + o.outputs[0].token_ids + [7, 8, 9] for p, o in zip(prompts, outs)]
        outs += [llm.generate({"prompt_token_ids": p}, greedy)[0] for p in turns]
        stats = llm.engine.stats()
    return outs, stats


def test_tp2_engine_generates_what_one_process_generates(tiny_model_dir):
    rng = random.Random()
    shared = [rng.randrange(2, 8000) for _ in range(20)]
    prompts = [shared + [rng.randrange(2, 8000) for _ in range(n)] for n in (30, 5, 12, 40)]
    single, _ = _run(tiny_model_dir, prompts, 1)
    tp, stats = _run(tiny_model_dir, prompts, 2)
    assert stats.num_preemptions > 0, "the pool was meant to force preemption"
    assert stats.prefix_hits > 0, "the second round was meant to start from cached prefixes"
    for a, b in zip(single, tp):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        if a.prompt_logprobs is not None:
            for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
                assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-3 for t in x)


def test_a_rank_that_dies_stops_the_engine_with_a_clear_error(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), tensor_parallel_size=2, collective_timeout=30, **OPTIONS)
    engine = llm.engine
    ranks = list(engine.workers.processes)
    try:
        engine.add_request("a", {"prompt_token_ids": list(range(2, 40))}, SamplingParams(max_tokens=50, ignore_eos=True))
        engine.step()
        os.kill(ranks[0].pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(ParallelError, match=r"rank\(s\) 1 exited|failed while"):
            for _ in range(50):
                engine.step()
        assert time.monotonic() - started < 10
        with pytest.raises(ParallelError, match="already failed"):
            engine.step()
    finally:
        llm.close()
    assert not any(p.is_alive() for p in ranks)


def test_a_rank_that_hangs_stops_the_engine_after_the_collective_timeout(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), tensor_parallel_size=2, collective_timeout=3, **OPTIONS)
    engine = llm.engine
    ranks = list(engine.workers.processes)
    try:
        engine.add_request("a", {"prompt_token_ids": list(range(2, 40))}, SamplingParams(max_tokens=50, ignore_eos=True))
        engine.step()
        os.kill(ranks[0].pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(ParallelError, match="failed while .*[Tt]imed out"):
            for _ in range(50):
                engine.step()
        assert time.monotonic() - started < 3 + 5
    finally:
        llm.close()  # kills the stopped rank
    assert not any(p.is_alive() for p in ranks)


def test_ranks_that_built_different_things_are_named():
    rank0 = {"oxserve": "0.1", "torch": "2.13.0", "config": "c", "shapes": [("w", (4, 2), "float32")], "layout": (8, 4, 2)}
    assert mismatch([rank0, dict(rank0)]) is None
    other = {**rank0, "shapes": [("w", (2, 2), "float32")], "torch": "2.12.0"}
    assert mismatch([rank0, dict(rank0), other]) == (
        "tensor-parallel rank 2 differs from rank 0 in shapes, torch: every rank must run the same oxserve, torch and checkpoint"
    )
