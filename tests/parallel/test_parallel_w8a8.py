"""W8A8 on parallel ranks: each rank quantizes its own piece on load (a row-parallel piece's
per-channel scales cover its share of the inputs) and SmoothQuant's calibration passes run on
all ranks in step. Quantized and cut, the model must lose no more against fp32 than quantized
alone does."""

from __future__ import annotations

import random

import pytest
from support_compressed import write_w8a8_checkpoint
from tiny_models import two_mla_checkpoint

from oxserve import LLM, SamplingParams

pytestmark = pytest.mark.slow


def _prompt_logprobs(model_dir, prompts, **options) -> list[float]:
    """The logprob of every prompt token after the first, teacher-forced."""
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    with LLM(str(model_dir), dtype="float32", enable_prefix_caching=False, **options) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [lp[t] for o, p in zip(outs, prompts) for lp, t in zip(o.prompt_logprobs[1:], p[1:])]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return two_mla_checkpoint(tmp_path_factory.mktemp("two-mla-w8a8"))


@pytest.mark.parametrize("cut", [dict(tensor_parallel_size=2), dict(tensor_parallel_size=2, enable_expert_parallel=True),
                                 dict(layer_split_size=2)], ids=["tp2", "tp2-ep", "ls2"])  # fmt: skip
def test_w8a8_on_parallel_ranks_loses_what_w8a8_alone_loses(model_dir, cut):
    rng = random.Random()
    prompts = [[rng.randrange(3, 8000) for _ in range(n)] for n in (40, 64, 25)]
    exact = _prompt_logprobs(model_dir, prompts)
    alone = _prompt_logprobs(model_dir, prompts, quantization="w8a8")
    cut_up = _prompt_logprobs(model_dir, prompts, quantization="w8a8", **cut)
    loss_alone = sum(abs(a - b) for a, b in zip(alone, exact)) / len(exact)
    loss_cut = sum(abs(a - b) for a, b in zip(cut_up, exact)) / len(exact)
    print(f"{cut}: mean |logprob - fp32| alone {loss_alone:.2e}, cut {loss_cut:.2e}")
    assert loss_alone > 1e-4, "W8A8 was meant to move the logprobs"
    assert loss_cut <= 2 * loss_alone, (loss_cut, loss_alone)
    assert cut_up != exact


@pytest.mark.parametrize("cut", [dict(tensor_parallel_size=2), dict(tensor_parallel_size=2, enable_expert_parallel=True),
                                 dict(layer_split_size=2)], ids=["tp2", "tp2-ep", "ls2"])  # fmt: skip
def test_a_prequantized_checkpoint_on_parallel_ranks_loses_what_it_loses_alone(model_dir, tmp_path, cut):
    """compressed-tensors int8 weights and experts: each rank takes its rows' (or experts')
    scales with its rows; a row-parallel piece keeps every row's scale."""
    quantized = tmp_path / "w8a8"
    write_w8a8_checkpoint(model_dir, quantized, quantize_experts=True)
    rng = random.Random()
    prompts = [[rng.randrange(3, 8000) for _ in range(n)] for n in (40, 64, 25)]
    exact = _prompt_logprobs(model_dir, prompts)
    alone = _prompt_logprobs(quantized, prompts)
    cut_up = _prompt_logprobs(quantized, prompts, **cut)
    loss_alone = sum(abs(a - b) for a, b in zip(alone, exact)) / len(exact)
    loss_cut = sum(abs(a - b) for a, b in zip(cut_up, exact)) / len(exact)
    print(f"{cut}: mean |logprob - fp32| alone {loss_alone:.2e}, cut {loss_cut:.2e}")
    assert loss_alone > 1e-4, "the checkpoint was meant to be quantized"
    assert loss_cut <= 2 * loss_alone, (loss_cut, loss_alone)
