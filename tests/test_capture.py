"""Captured decode steps (`oxserve.engine.capture`): a replay gives the eager step's results
bit for bit, on any shape, and a step a replay could not repeat runs eagerly."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch

from oxserve import LLM, SamplingParams
from oxserve.engine.capture import CapturedDecode, StepRecording
from oxserve.engine import sampler
from oxserve.kernels.call_list import CallRun
from oxserve.kernels import rows as row_kernels
from oxserve.model.batch import BatchRequest, make_forward_batch
from oxserve.default_model import default_model
from oxserve.model.config import TextModelConfig
from oxserve.telemetry import Tracer, span
from test_speculative import pin_the_guard
from tiny_models import TINY_SHAPE


def _run(model: str | None, dtype: str, eager: bool, prompts, params, **options):
    llm = LLM(model=model, dtype=dtype, enforce_eager=eager, **{"max_num_seqs": 4, **options})
    try:
        outs = llm.generate(prompts, params)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], llm.engine.runner.captured
    finally:
        llm.close()


def _record_every_size(monkeypatch) -> None:
    """Recordings cost nothing: each batch size of a shrinking batch is recorded as met, not
    served by a larger recording (`DecodePadding.size_for`), so a run meets many shapes."""
    monkeypatch.setattr(CapturedDecode, "recording_s", property(lambda self: 0.0))


def _steady_replays(monkeypatch) -> list[tuple]:
    """The shapes of the replays whose inputs the runner wrote in place (`replay_steady`),
    as they happen."""
    shapes = []
    replay = CapturedDecode.replay_steady
    monkeypatch.setattr(CapturedDecode, "replay_steady", lambda self, r: shapes.append(r.decode_shape) or replay(self, r))
    return shapes


def _workload(seed: int, vocab: int, longest: int, requests: int = 6):
    """Prompts of random lengths and outputs of random lengths: the batch shrinks as requests
    finish, contexts cross blocks, indexer pools and the indexer's top-k."""
    rng = random.Random(seed)
    prompts = [{"prompt_token_ids": [rng.randrange(32, vocab) for _ in range(rng.randrange(1, longest))]}
               for _ in range(requests)]  # fmt: skip
    params = [SamplingParams(max_tokens=rng.randrange(20, 90), ignore_eos=True, logprobs=2, seed=rng.randrange(1 << 30),
                             temperature=rng.choice([0.0, 0.8]), top_p=rng.choice([1.0, 0.9])) for _ in prompts]
    return prompts, params


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_replayed_decode_steps_equal_eager_ones(tiny_model_dir, dtype, monkeypatch):
    """bf16 (oxserve's own kernels): bit for bit. fp32 runs torch's CPU kernels, whose last bits
    move with the addresses of their inputs even between two eager runs (vectorised reductions
    peel unaligned heads): the same tokens up to a near-tie, logprobs within fp32 rounding."""
    _record_every_size(monkeypatch)
    steady = _steady_replays(monkeypatch)
    prompts, params = _workload(random.randrange(1 << 30), TINY_SHAPE["vocab_size"], 120)
    if dtype == "float32":
        params = [dataclasses.replace(p, temperature=0.0) for p in params]
    eager, none = _run(str(tiny_model_dir), dtype, True, prompts, params, max_model_len=256)
    replayed, captured = _run(str(tiny_model_dir), dtype, False, prompts, params, max_model_len=256)
    assert none is None
    assert captured.refused == {}
    assert captured.captures >= 3 and captured.replays > 5 * captured.captures  # batch sizes and context bounds
    assert len(steady) > captured.replays / 2 and len(set(steady)) >= 2  # (a first replay of a shape builds its plan)
    if dtype == "bfloat16":
        assert replayed == eager  # tokens and logprobs, exactly
        return
    for (tokens_e, logprobs_e), (tokens_r, logprobs_r) in zip(eager, replayed):
        same = next((i for i, (a, b) in enumerate(zip(tokens_e, tokens_r)) if a != b), len(tokens_e))
        for i in range(same):
            assert logprobs_e[i].keys() == logprobs_r[i].keys()
            assert all(abs(logprobs_e[i][t] - logprobs_r[i][t]) < 1e-4 for t in logprobs_e[i])
        if same < len(tokens_e):  # only where the top two were within rounding of each other
            top = sorted(logprobs_e[same].values(), reverse=True)
            assert top[0] - top[1] < 1e-4


def test_replayssm_decode_steps_are_replayed_across_ring_folds(tiny_model_dir, monkeypatch):
    """With ReplaySSM rings (length 5: a fold every few steps), the ring counts change every
    step; the kernels take them as a tensor, which a replay refills, and fold by themselves."""
    _record_every_size(monkeypatch)
    prompts, params = _workload(random.randrange(1 << 30), TINY_SHAPE["vocab_size"], 120)
    rings = dict(max_model_len=256, kda_decode="replay", kda_replay_len=5)
    eager, _ = _run(str(tiny_model_dir), "bfloat16", True, prompts, params, **rings)
    replayed, captured = _run(str(tiny_model_dir), "bfloat16", False, prompts, params, **rings)
    assert captured.refused == {} and captured.captures >= 3 and captured.replays > 5 * captured.captures
    assert replayed == eager


@pytest.mark.parametrize("logprobs", [1, None])
def test_speculative_decoding_replays_its_decode_and_verify_steps(monkeypatch, logprobs):
    """n-gram speculation on held-out code through the trained model, drafting wherever lookup
    finds something (guard pinned, so both runs draft alike): steps that verify drafts replay
    as plain decode steps do (the ring counts refilled, the rings folded by the kernel, the
    conv states staged for rejections as recorded), and the outputs are the eager run's
    exactly. Plain greedy requests (no logprobs) verify on the argmax that the captured step
    (replayed, or recording) made with its logits, not with a pass of their own."""
    from oxserve.default_model.train import held_out_windows
    from oxserve.engine import scheduler, speculative
    from oxserve.engine.capture import CapturedDecode, step_key
    from oxserve.engine.spec_guard import MAX_DEPTH, MIN_FLOOR

    monkeypatch.setattr(scheduler, "draft_depth", lambda request, k, floor: k)
    monkeypatch.setattr(scheduler.DraftCost, "budget", lambda self, decodes: (MIN_FLOOR, MAX_DEPTH))
    replayed_verifies = []
    run = CapturedDecode.run

    def counting_run(self, input_ids, batch, recurs=False):
        if batch.num_verifies and step_key(input_ids, batch)[0] in self.recordings:
            replayed_verifies.append(batch.num_verifies)
        return run(self, input_ids, batch, recurs)

    monkeypatch.setattr(CapturedDecode, "run", counting_run)
    sampler_passes = []  # the verifies that made their own pass over the logits (penalties first)
    penalties = speculative.apply_penalties
    monkeypatch.setattr(speculative, "apply_penalties", lambda x, rows: sampler_passes.append(1) or penalties(x, rows))
    prompts = [{"prompt_token_ids": p} for p in held_out_windows(default_model(), 6, 96, random.randrange(1 << 30))]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, logprobs=logprobs)
    # Rings of 5 (k + 2): runs of up to 4 tokens fold a ring mid-request, at any count.
    spec = dict(kda_decode="replay", kda_replay_len=5, speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')
    runs = []
    for eager in (True, False):
        llm = LLM(dtype="bfloat16", enforce_eager=eager, max_num_seqs=2, **spec)
        try:
            sampler_passes.clear()
            outs = llm.generate(prompts, params)
            stats = llm.engine.stats()
            runs.append(([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs],
                         (stats.spec_draft_tokens, stats.spec_accepted_tokens), llm.engine.runner.captured))
        finally:
            llm.close()
        if eager:
            verifies = len(sampler_passes)
    (eager, eager_drafts, _), (replayed, drafts, captured) = runs
    assert drafts == eager_drafts and 0 < drafts[1] < drafts[0]  # the same drafts, kept and rejected
    assert captured.refused == {} and len(replayed_verifies) > 10
    assert replayed == eager
    assert verifies > 10 and len(sampler_passes) == (verifies if logprobs else 0)  # captured greedy verifies: none


def test_the_default_model_replays_its_decode_steps_exactly():
    """The shipped model in bf16, where every product runs on the panel kernels."""
    prompts = ["The quick brown fox", "Once upon a time " * 30, "a b c " * 90]
    params = SamplingParams(max_tokens=150, temperature=0.0, ignore_eos=True, logprobs=1)
    eager, _ = _run(None, "bfloat16", True, prompts, params)
    replayed, captured = _run(None, "bfloat16", False, prompts, params)
    assert captured.refused == {} and captured.replays > 100
    assert replayed == eager
    plans = [r._plan for r in captured.recordings.values() if r._plan is not None]
    assert plans and all(any(isinstance(step[1], CallRun) for step in plan) for plan in plans)  # kernel runs made from C
    # Every op is native, in one run of calls: a torch op left in a step costs a dispatch every
    # replay on cold code (the indexer's top-k: 130-150 us at batch 32) and splits the run.
    torch_ops = {str(step[2][0]) for plan in plans for step in plan if not isinstance(step[1], CallRun)}
    assert torch_ops == set() and all(len(plan) == 1 for plan in plans), torch_ops


def test_mtp_passes_of_the_default_model_replay_as_one_run_of_native_calls(monkeypatch):
    """The MTP layer's embedding, input norms and residual adds are native calls: a captured
    MTP pass is one run of them (its torch ops ran on cold code: ~0.6 ms a pass at batch 1 on
    an AVX2 EPYC, against ~0.16 ms of kernels), with the eager engine's drafts and outputs."""
    pin_the_guard(monkeypatch)
    prompts = ["def fibonacci(n):\n    ", "import os\nimport sys\n" * 5]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=1)
    runs = []
    for eager in (True, False):
        llm = LLM(dtype="bfloat16", enforce_eager=eager, max_num_seqs=2,
                  speculative_config='{"method": "mtp", "num_speculative_tokens": 2}')  # fmt: skip
        try:
            outs, stats = llm.generate(prompts, params), llm.engine.stats()
            runs.append(([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs],
                         (stats.spec_draft_tokens, stats.spec_accepted_tokens), llm.engine.runner.drafter.captured))
        finally:
            llm.close()
    (eager, eager_drafts, _), (replayed, drafts, captured) = runs
    assert replayed == eager and drafts == eager_drafts and drafts[1] > 0
    plans = [r._plan for r in captured.recordings.values() if r._plan is not None]
    assert captured.replays > 10 and plans
    assert all(len(plan) == 1 and isinstance(plan[0][1], CallRun) for plan in plans)


@pytest.mark.parametrize("deterministic", [False, True])
def test_plain_greedy_steps_take_the_argmax_their_replay_made(monkeypatch, deterministic):
    """A replayed decode step computes each row's argmax with its logits, and the sampler takes
    it for plain greedy rows (no logprobs, penalties or grammar) instead of making its own
    pass: the same tokens as eager steps, where the sampler makes it every step. Only for
    those very logits: deterministic mode replays one request at a time and samples their
    concatenation, so the sampler makes its own pass there."""
    prompts = ["The quick brown fox", "def fibonacci(n):", "import os\n" * 20]
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    passes = []
    own_pass = sampler.greedy_tokens
    monkeypatch.setattr(sampler, "greedy_tokens", lambda logits: passes.append(len(logits)) or own_pass(logits))
    eager, _ = _run(None, "bfloat16", True, prompts, params, deterministic=deterministic)
    eager_passes = len(passes)
    replayed, captured = _run(None, "bfloat16", False, prompts, params, deterministic=deterministic)
    assert replayed == eager and captured.replays > 40
    assert eager_passes >= 60
    if deterministic:
        assert len(passes) == 2 * eager_passes
    else:
        assert len(passes) - eager_passes <= 3  # the replayed run's: its prefill steps only


@pytest.mark.parametrize("options", [{}, {"kda_decode": "replay", "kda_replay_len": 5}, {"kv_cache_dtype": "int8"},
                                     {"kv_cache_dtype": "fp8", "kda_state_dtype": "bfloat16", "kda_decode": "replay",
                                      "kda_replay_len": 5},
                                     {"compile_sizes": "1,8", "kda_decode": "replay", "kda_replay_len": 3}],
                         ids=["write-back", "replay-rings", "int8-cache", "fp8-cache-bf16-checkpoints", "many-rows-a-step"])
def test_decode_batches_run_padded_to_the_captured_sizes(tiny_model_dir, monkeypatch, options):
    """Batches of 7 and 5 requests replay the recordings of 8 and 6 (sizes 1, 2, 3, 4, 6, 8)
    with padding rows, which share one state slot and cache block (ReplaySSM rings folding
    there too; with sizes 1 and 8, up to six padding rows a step, whose rings of 3 fold within
    it): the requests' outputs are the eager run's, bit for bit."""
    from oxserve.engine import padding as padding_module
    from oxserve.engine.padding import DecodePadding

    padded, steady = [], _steady_replays(monkeypatch)
    rows = DecodePadding.rows
    monkeypatch.setattr(DecodePadding, "rows", lambda self, count: padded.append(count) or rows(self, count))
    monkeypatch.setattr(padding_module, "STEADY_WINDOW", 1000)  # no size runs steady
    prompts, params = _workload(random.randrange(1 << 30), TINY_SHAPE["vocab_size"], 120, requests=7)
    runs = [_run(str(tiny_model_dir), "bfloat16", eager, prompts, params, max_model_len=256, max_num_seqs=8, **options)
            for eager in (True, False)]  # fmt: skip
    (eager, _), (replayed, captured) = runs
    assert replayed == eager
    assert {len(r.inputs[0]) for r in captured.recordings.values()} <= {1, 2, 3, 4, 6, 8} and captured.refused == {}
    assert sum(1 for n in padded if n) > 5 and captured.replays > 5 * captured.captures
    assert len(steady) > captured.replays / 2 and any(shape[0] > 5 for shape in steady)  # (of 6 and 8: padded)
    if "compile_sizes" in options:
        assert max(padded) >= 5


def test_a_steady_batch_size_runs_unpadded():
    """Padding serves the sizes a ramp or a tail passes through; a size that takes half of the
    last 64 decode steps runs as it is (17 padded to 24 cost a step 12-23% more)."""
    from oxserve.engine.padding import STEADY_WINDOW, DecodePadding

    padding = DecodePadding((1, 2, 4, 8), slot=0, block=0, block_size=16)
    assert [padding.size_for(n) for n in (8, 7, 5, 3, 2, 1, 9)] == [8, 8, 8, 4, 2, 1, 9]
    sizes = [padding.size_for(5) for _ in range(STEADY_WINDOW)]
    steady = sizes.index(5)  # the step at which 5 had half the window
    assert set(sizes[:steady]) == {8} and set(sizes[steady:]) == {5} and steady == STEADY_WINDOW // 2 - 2  # (one 5 before)
    assert [padding.size_for(3) for _ in range(STEADY_WINDOW // 2 + 1)][0] == 4  # 5 falls out of the window again
    assert padding.size_for(5) == 8


def test_a_size_is_recorded_once_its_padding_has_cost_what_a_recording_costs():
    """With size 8 recorded (a 4 ms replay) and a recording costing 10 ms, a batch of 2 runs
    padded to 8 (each step charged 6/8 of 4 ms to size 2) until the padding has cost 10 ms,
    then is recorded as itself; sizes the recorded one serves, or that no larger recording
    holds, are not charged."""
    from oxserve.engine.padding import DecodePadding

    padding = DecodePadding((1, 2, 4, 8), slot=0, block=0, block_size=16)
    assert [padding.size_for(2, {8: 0.004}, 0.010) for _ in range(5)] == [8, 8, 8, 2, 8]
    assert padding.size_for(2, {2: 0.002, 8: 0.004}, 0.010) == 2
    assert padding.size_for(5, {8: 0.004}, 0.010) == 8 and padding.size_for(9, {8: 0.004}, 0.010) == 9
    assert padding.size_for(3, {3: 0.002, 8: 0.004}, 0.010) == 3  # (a size once steady, recorded as it was)
    assert padding.size_for(1, {}, 0.010) == 1


def test_a_shrinking_batch_replays_its_full_size_while_recording_would_cost_more(tiny_model_dir, monkeypatch):
    """Requests that finish one by one leave batches of 7 to 1, each met for a step or two:
    they replay the recording of 8 with padding rows (here recordings cost more than any
    padding), and give the eager run's outputs."""
    monkeypatch.setattr(CapturedDecode, "recording_s", property(lambda self: float("inf")))
    prompts = [{"prompt_token_ids": [40 + i] * (20 + i)} for i in range(8)]  # contexts stay within 64 tokens
    params = [SamplingParams(max_tokens=10 + 2 * i, temperature=0.0, ignore_eos=True, logprobs=1) for i in range(8)]
    eager, _ = _run(str(tiny_model_dir), "bfloat16", True, prompts, params, max_model_len=256, max_num_seqs=8)
    replayed, captured = _run(str(tiny_model_dir), "bfloat16", False, prompts, params, max_model_len=256, max_num_seqs=8)
    assert replayed == eager
    assert {len(r.inputs[0]) for r in captured.recordings.values()} == {8} and captured.replays >= 20
    # One recording a context bound: a batch of 8 and one padded to 8 share it (padding rows
    # leave the block table's width as it is).
    bounds = [r.decode_shape[1] for r in captured.recordings.values()]
    assert len(bounds) == len(set(bounds))


def test_padding_rows_have_a_block_and_slot_of_their_own_within_the_budget():
    """The runner's caches hold one block and one state slot more than the scheduler hands
    out, and the planner counts them in `cache_memory_gib`."""
    llm = LLM(dtype="bfloat16", cache_memory_gib=0.05)
    try:
        runner, manager = llm.engine.runner, llm.engine.cache
        assert runner.layout.num_blocks == manager.blocks.size + 1 == runner.padding.block + 1
        assert runner.layout.num_slots == manager.slots.size + 1 == runner.padding.slot + 1
        held = sum(t.nbytes for cache in runner.caches for t in _tensors_of(cache))
        assert 0.9 * 0.05 * 2**30 < held <= 0.05 * 2**30
    finally:
        llm.close()
    eager = LLM(dtype="bfloat16", cache_memory_gib=0.05, enforce_eager=True)
    assert eager.engine.runner.padding is None and eager.engine.runner.layout.num_blocks > manager.blocks.size
    eager.close()


def _tensors_of(cache) -> list[torch.Tensor]:
    found = []
    for value in vars(cache).values():
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif hasattr(value, "__dict__"):
            found += _tensors_of(value)
    return found


def test_compile_sizes_choose_the_batch_sizes_captured(tiny_model_dir):
    prompts = [{"prompt_token_ids": [40 + i] * (5 + 7 * i)} for i in range(3)]
    params = [SamplingParams(max_tokens=10 + 10 * i, temperature=0.0, ignore_eos=True) for i in range(3)]
    eager, _ = _run(str(tiny_model_dir), "bfloat16", True, prompts, params, max_model_len=256)
    replayed, captured = _run(str(tiny_model_dir), "bfloat16", False, prompts, params, max_model_len=256,
                              compile_sizes="2")  # fmt: skip
    assert replayed == eager
    assert captured.replays > 0 and {len(r.inputs[0]) for r in captured.recordings.values()} == {2}  # input_ids [2]


def test_default_capture_sizes_grow_by_at_most_half_up_to_max_num_seqs():
    from oxserve.config import ModelConfig, default_capture_sizes

    assert default_capture_sizes(64) == (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
    assert default_capture_sizes(1) == (1,) and default_capture_sizes(100)[-3:] == (64, 96, 100)
    for most in range(1, 300):
        sizes = default_capture_sizes(most)
        assert sizes[0] == 1 and sizes[-1] == most and list(sizes) == sorted(set(sizes))
        assert all(b <= 1.5 * a for a, b in zip(sizes[2:], sizes[3:]))
    assert ModelConfig(compile_sizes="8, 2,2").capture_sizes(64) == (2, 8)


@pytest.mark.parametrize("sizes", ["", "0,2", "two"])
def test_bad_compile_sizes_are_refused(sizes):
    with pytest.raises(ValueError, match="compile_sizes"):
        LLM(compile_sizes=sizes)


def _decode_batch(contexts: list[int], block_size: int = 16):
    requests = [BatchRequest(c, 1, list(range(i * 8, i * 8 + 8)), i, True) for i, c in enumerate(contexts)]
    cfg = TextModelConfig.from_file(Path(default_model()) / "config.json")
    return make_forward_batch(requests, cfg, block_size, 64, "cpu")


def test_a_replay_recomputes_torch_ops_and_native_calls_on_new_inputs():
    """A toy step mixing a native kernel, torch ops, a view and an in-place write to state kept
    between steps: each replay equals the eager step on that step's inputs."""
    weight = torch.randn(32, dtype=torch.bfloat16)
    state = torch.zeros(8, 32, dtype=torch.bfloat16)

    def step(input_ids, batch, state):
        x = torch.nn.functional.embedding(input_ids, table).to(torch.bfloat16)
        normed = row_kernels.rms_norm_native(x, weight, 1e-6)  # native on CPU bf16
        state.index_copy_(0, batch.state_slots, normed)
        return (normed.float() * batch.positions[:, None] + state.sum(0)).view(-1)

    table = torch.randn(100, 32)
    eager_state, replay_state = state.clone(), state.clone()
    captured = CapturedDecode(lambda ids, b: step(ids, b, replay_state))
    for contexts in ([3, 9], [4, 10], [5, 11], [12, 2]):  # one shape: sequences up to 16
        batch = _decode_batch(contexts)
        ids = torch.randint(0, 100, (2,))
        expected = step(ids, batch, eager_state)
        assert torch.equal(captured.run(ids, batch), expected)
        assert torch.equal(replay_state, eager_state)
    assert captured.captures == 1 and captured.replays == 2 and captured.refused == {}  # recorded when met again


def test_a_steady_step_after_a_copied_batch_writes_its_rows_again():
    """A steady step's rows are written into the recording (`steady_decodes`), which skips
    table rows that still hold their request's blocks; a step replayed through `run` copies its
    own batch in, so the steady step after it must write every row again."""
    cfg = TextModelConfig.from_file(Path(default_model()) / "config.json")

    def step(input_ids, batch):
        return batch.block_tables.sum(1) * 1000 + batch.cache_rows * 10 + input_ids

    def requests(first_block: int) -> list[BatchRequest]:
        return [BatchRequest(c, 1, list(range(first_block + 8 * i, first_block + 8 * i + 8)), i, True)
                for i, c in enumerate([3, 9])]  # fmt: skip

    def batch_of(reqs):
        return make_forward_batch(reqs, cfg, 16, 64, "cpu")

    captured = CapturedDecode(step)
    ids, steady = torch.tensor([5, 7]), requests(0)  # (the same block lists each step, as a request's own)
    for _ in range(2):  # recorded, then a replay that builds its plan
        captured.run(ids, batch_of(steady), recurs=True)
    shape = (2, batch_of(steady).seq_len_bound, batch_of(steady).block_tables.shape[1])
    for first_block in (0, 16, 0, 32):
        recording = captured.steady_decodes(shape)
        recording.decode_rows.write(steady, [5, 7], 64, cfg.index_kpool)
        assert torch.equal(captured.replay_steady(recording), step(ids, batch_of(steady)))
        other = batch_of(requests(first_block))  # through `run`: its batch copied in
        assert torch.equal(captured.run(ids, other), step(ids, other))


def test_a_traced_replay_times_the_spans_of_the_step_it_repeats():
    """The profiler sees replayed steps as served: each span of the recorded step is timed over
    the recorded calls made inside it (none: zero long), at the depth the step ran at."""
    weight = torch.randn(32, dtype=torch.bfloat16)
    table = torch.randn(100, 32, dtype=torch.bfloat16)

    def step(input_ids, batch):
        with span(batch.tracer, "embed"):
            x = torch.nn.functional.embedding(input_ids, table)
        with span(batch.tracer, "norm"):
            normed = row_kernels.rms_norm_native(x, weight, 1e-6)
        with span(batch.tracer, "view"):
            flat = normed.view(-1)  # a view: nothing to repeat
        with span(batch.tracer, "scale", track="model", note=1):
            return flat * 2

    captured = CapturedDecode(step)
    for contexts, traced in (([3, 9], False), ([4, 10], True), ([5, 11], False), ([6, 12], True)):
        batch, ids = _decode_batch(contexts), torch.randint(0, 100, (2,))
        tracer = batch.tracer = Tracer() if traced else None
        with span(tracer, "forward", track="engine"):
            assert torch.equal(captured.run(ids, batch), step(ids, dataclasses.replace(batch, tracer=None)))
        if traced:
            forward, *ops = sorted(tracer.spans, key=lambda s: s.start_us)  # stable: spans in the order they ended
            assert [s.name for s in ops] == ["embed", "norm", "view", "scale"]
            assert all(s.depth == 1 and s.track == "model" for s in ops) and ops[-1].args == {"note": 1}
            assert forward.start_us <= ops[0].start_us and ops[-1].start_us + ops[-1].dur_us <= forward.start_us + forward.dur_us
            assert all(s.dur_us > 0 for s in ops if s.name != "view")
    assert ops[2].dur_us == 0  # in the replay (the last step)
    assert captured.captures == 1 and captured.replays == 2  # the traced eager step recorded; replays traced or not


def test_a_step_that_reads_context_lengths_or_tensor_values_runs_eagerly():
    bodies = (lambda ids, b: ids * sum(b.context_lens), lambda ids, b: ids * int(ids.sum().item()),
              lambda ids, b: ids + 1 if bool((ids == 2).any()) else ids, lambda ids, b: ids[ids > 1])
    for body in bodies:
        calls = []
        captured = CapturedDecode(lambda ids, b: calls.append(1) or body(ids, b))
        for contexts in ([3, 9], [4, 10], [5, 11]):
            batch, ids = _decode_batch(contexts), torch.tensor([1, 2])
            assert torch.equal(captured.run(ids, batch), body(ids, batch))  # right on every step
        assert len(calls) == 3 and captured.recordings == {} and len(captured.refused) == 1  # refused at step 2


def test_a_kernel_that_fails_in_a_replay_fails_the_step_loudly():
    recording = StepRecording()
    recording.calls.append((lambda: -2, (), 0))  # returned 0 when recorded
    with pytest.raises(RuntimeError, match="returned -2"):
        recording.replay()


def test_deterministic_mode_replays_each_request_alone(tiny_model_dir):
    """One forward pass per request: every pass's logits survive the passes after it (a replay
    reuses its recording's logits tensor)."""
    prompts, params = _workload(random.randrange(1 << 30), TINY_SHAPE["vocab_size"], 60)
    eager, _ = _run(str(tiny_model_dir), "bfloat16", True, prompts, params, max_model_len=256, deterministic=True)
    replayed, captured = _run(str(tiny_model_dir), "bfloat16", False, prompts, params, max_model_len=256,
                              deterministic=True)  # fmt: skip
    assert captured.replays > 0 and replayed == eager


def test_teacher_forced_decode_through_replays_equals_eager(tiny_model_dir):
    """`model.forced` (what the fidelity tests run) decodes through captured steps by default."""
    from oxserve.model.forced import forced_logits
    from oxserve.model.loader import load_model

    model = load_model(tiny_model_dir, dtype=torch.bfloat16).model
    tokens = [random.randrange(32, TINY_SHAPE["vocab_size"]) for _ in range(random.randrange(30, 90))]
    decode_from = random.randrange(1, 20)
    eager = forced_logits(model, tokens, 7, decode_from, shuffle=random.Random(1))
    replayed = forced_logits(model, tokens, 7, decode_from, shuffle=random.Random(1), captured=True)
    assert torch.equal(replayed, eager)


def test_recordings_are_dropped_least_recently_replayed_first_past_their_memory_budget():
    """Each recording holds its step's intermediate tensors; past the budget the oldest go."""
    state = torch.zeros(8, 64)

    def step(ids, batch):
        state.index_copy_(0, batch.state_slots, torch.ones(len(ids), 64) * ids[:, None])
        return state.sum(0)

    captured = CapturedDecode(step)
    for contexts in ([3], [3], [3, 4], [3, 4], [3, 4, 5], [3, 4, 5]):  # each shape recorded on its second step
        captured.run(torch.arange(len(contexts)), _decode_batch(contexts))
    sizes = [r.nbytes for r in captured.recordings.values()]
    assert len(sizes) == 3 and all(size >= 64 * 4 for size in sizes)
    captured.max_bytes = sum(sizes) - 1  # one more recording must push one out, or more
    captured.run(torch.arange(1), _decode_batch([3]))  # a replay: shape 1 becomes the most recent
    for contexts in ([6, 7, 8, 9], [6, 7, 8, 9]):
        captured.run(torch.arange(4), _decode_batch(contexts))
    assert [len(r.inputs[0]) for r in captured.recordings.values()] == [1, 4]  # 2 then 3 dropped: 1 + 4 rows fit
    assert captured.nbytes <= captured.max_bytes


def test_a_dropped_engine_frees_its_caches_without_waiting_for_the_garbage_collector(tiny_model_dir):
    """The replays' forward holds the model and caches, not the runner, and a recording's
    watched batch values (which point back at it) are not kept: no reference cycle."""
    import gc
    import weakref

    llm = LLM(model=str(tiny_model_dir), dtype="bfloat16", max_model_len=256)
    llm.generate(["a b c"] * 2, SamplingParams(max_tokens=12, ignore_eos=True))
    assert llm.engine.runner.captured.replays > 0
    runner = weakref.ref(llm.engine.runner)
    recordings = [weakref.ref(r) for r in llm.engine.runner.captured.recordings.values()]  # they hold the caches
    gc.collect()
    gc.disable()
    try:
        del llm
        assert runner() is None and recordings and all(r() is None for r in recordings)
    finally:
        gc.enable()


def test_recording_does_not_import_the_compiler(tiny_model_dir):
    """A dispatch mode would import torch._dynamo (~1 s) on its first use to wrap its hook;
    nothing is compiled here, so a process that records a step never pays for it."""
    import subprocess
    import sys

    probe = (f"import sys; from oxserve import LLM, SamplingParams; llm = LLM(model={str(tiny_model_dir)!r}, "
             "dtype='bfloat16', max_model_len=256); llm.generate(['a b'] * 2, SamplingParams(max_tokens=8, ignore_eos=True)); "
             "assert llm.engine.runner.captured.captures > 0; print('torch._dynamo' in sys.modules)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.split()[-1] == "False"
