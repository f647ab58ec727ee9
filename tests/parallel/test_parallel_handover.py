"""Prefill/decode handover between instances cut among parallel ranks: a snapshot is the whole
model's (rank 0 joins the ranks' pieces; each importing rank cuts out its own KDA heads), so an
instance at TP 2 or Layer Split 2 hands over to one cut differently, or not at all, and the
decode answers as one process would."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from tiny_models import two_mla_checkpoint

from oxserve import LLM, SamplingParams
from oxserve.llm import run_to_completion

pytestmark = pytest.mark.slow

BASE = dict(dtype="float32", block_size=16, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return two_mla_checkpoint(tmp_path_factory.mktemp("two-mla-handover"))


def _export(llm: LLM, rid: str, prompt: dict, params: SamplingParams):
    llm.engine.add_request(rid, prompt, replace(params, max_tokens=1), export_caches=True)
    return run_to_completion(llm.engine, {rid})[rid].kv_snapshot


def _import(llm: LLM, rid: str, prompt: dict, params: SamplingParams, snap):
    llm.engine.add_request(rid, prompt, params, kv_import=snap)
    return run_to_completion(llm.engine, {rid})[rid].outputs[0]


def test_handover_between_differently_cut_instances(model_dir):
    """One process hands over to 4 ranks (TP 2 x LS 2: heads and MLA layers both cut), and the
    4 ranks hand back: exported with ReplaySSM rings to fold, imported into write-back states."""
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=2, ignore_eos=True)
    rng = random.Random()
    prompts = [{"prompt_token_ids": [rng.randrange(3, 8000) for _ in range(n)]} for n in (5, 16, 37)]
    with LLM(**BASE, model=str(model_dir)) as one:
        want = [o.outputs[0] for o in one.generate(prompts, params)]
        from_one = [_export(one, f"to-{i}", p, params) for i, p in enumerate(prompts)]
        # (Two parallel instances cannot share this process: it has one default process group.)
        with LLM(**BASE, model=str(model_dir), kda_decode="replay", tensor_parallel_size=2, layer_split_size=2) as four:
            # The handshake's layout is the whole model's on every side, however it is cut.
            assert four.engine.kv_description() == one.engine.kv_description()
            got = [_import(four, f"in-{i}", p, params, snap) for i, (p, snap) in enumerate(zip(prompts, from_one))]
            from_four = [_export(four, f"back-{i}", p, params) for i, p in enumerate(prompts)]
        got += [_import(one, f"home-{i}", p, params, snap) for i, (p, snap) in enumerate(zip(prompts, from_four))]
    for g, w in zip(got, want + want):
        assert g.token_ids == w.token_ids
        for token, a, b in zip(g.token_ids, g.logprobs, w.logprobs):
            assert abs(a[token] - b[token]) < 1e-3
