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


def _handover(prefill: LLM, decode: LLM, rid: str, prompt: dict, params: SamplingParams):
    prefill.engine.add_request(f"p-{rid}", prompt, replace(params, max_tokens=1), export_caches=True)
    snap = run_to_completion(prefill.engine, {f"p-{rid}"})[f"p-{rid}"].kv_snapshot
    decode.engine.add_request(f"d-{rid}", prompt, params, kv_import=snap)
    return run_to_completion(decode.engine, {f"d-{rid}"})[f"d-{rid}"].outputs[0]


BOTH = dict(tensor_parallel_size=2, layer_split_size=2)  # 4 ranks: heads and MLA layers both cut


# (Two parallel instances cannot share this process: it has one default process group.)
@pytest.mark.parametrize("prefill_cut,decode_cut,kda", [(BOTH, {}, "write-back"), ({}, BOTH, "replay")],
                         ids=["tp2xls2-to-one", "one-to-tp2xls2"])  # fmt: skip
def test_handover_between_differently_cut_instances(model_dir, prefill_cut, decode_cut, kda):
    kw = dict(BASE, model=str(model_dir), kda_decode=kda)
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=2, ignore_eos=True)
    rng = random.Random()
    prompts = [{"prompt_token_ids": [rng.randrange(3, 8000) for _ in range(n)]} for n in (5, 16, 37)]
    with LLM(**kw) as alone:
        want = [o.outputs[0] for o in alone.generate(prompts, params)]
        whole_layout = alone.engine.kv_description()
    with LLM(**kw, **prefill_cut) as prefill, LLM(**kw, **decode_cut) as decode:
        # The handshake's layout is the whole model's on every side, however it is cut.
        assert prefill.engine.kv_description() == whole_layout == decode.engine.kv_description()
        got = [_handover(prefill, decode, f"{i}-{rng.random()}", p, params) for i, p in enumerate(prompts)]
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        for token, a, b in zip(g.token_ids, g.logprobs, w.logprobs):
            assert abs(a[token] - b[token]) < 1e-3
