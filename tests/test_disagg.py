"""Prefill/decode disaggregation below the HTTP layer: a prefill engine's exported caches,
sent through a real connector, let a decode engine answer exactly as one engine would."""

from __future__ import annotations

import random
import re
from dataclasses import replace

import numpy as np
import PIL.Image
import pytest
import torch

from oxserve import LLM, SamplingParams
from oxserve.disagg.connector import KVReceiver, KVSender, KVTransferError, Parcel, layout_difference
from oxserve.disagg.router import Costs, Instance, Router, prompt_size
from oxserve.disagg.snapshot import CacheSnapshot
from oxserve.llm import run_to_completion
from oxserve.structured import StructuredOutputs


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    """One engine alone, and a prefill engine sending to a decode engine over TCP."""
    kw = dict(model=str(tiny_model_dir), dtype="float32", deterministic=True, block_size=16)
    alone, prefill, decode = LLM(**kw), LLM(**kw), LLM(**kw)
    receiver = KVReceiver(decode.engine.kv_description(), "127.0.0.1")
    sender = KVSender(prefill.engine.kv_description(), "tcp", debug=True)
    yield alone, prefill, decode, lambda rid, snap: sender.send(f"127.0.0.1:{receiver.port}", rid, snap.parcel()), receiver
    sender.close()
    receiver.close()


def _split(engines, rid: str, prompt, params: SamplingParams):
    alone, prefill, decode, send, receiver = engines
    prefill.engine.add_request(f"p-{rid}", prompt, replace(params, max_tokens=1), export_caches=True)
    snap = run_to_completion(prefill.engine, {f"p-{rid}"})[f"p-{rid}"].kv_snapshot
    send(rid, snap)
    decode.engine.add_request(f"d-{rid}", prompt, params, kv_import=CacheSnapshot.of(receiver.take(rid)))
    return run_to_completion(decode.engine, {f"d-{rid}"})[f"d-{rid}"].outputs[0]


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=10, temperature=0, logprobs=3),
    SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=11, presence_penalty=0.5),
], ids=["greedy", "seeded"])  # fmt: skip
def test_split_equals_alone(engines, params):
    rng = random.Random()
    for length in (1, 15, 16, 17, 40):  # block edges and a prompt of one token
        prompt = {"prompt_token_ids": [rng.randrange(3, 8000) for _ in range(length)]}
        want = engines[0].generate([prompt], params)[0].outputs[0]
        got = _split(engines, f"{params.seed}-{length}-{rng.random()}", prompt, params)
        assert got.token_ids == want.token_ids and got.text == want.text
        assert got.logprobs == want.logprobs


def test_split_with_an_image_equals_alone(engines):
    image = PIL.Image.fromarray(np.random.default_rng(3).integers(0, 256, (40, 60, 3), dtype=np.uint8))
    prompt = {"prompt": "see <|begin_of_image|><|image|><|end_of_image|> now", "multi_modal_data": {"image": image}}
    params = SamplingParams(max_tokens=8, temperature=0)
    want = engines[0].generate([prompt], params)[0].outputs[0]
    checked = engines[2].engine.check_prompt(prompt).as_prompt()  # what a server hands the engine: placed items
    assert _split(engines, f"img-{random.random()}", checked, params).token_ids == want.token_ids


def test_an_imported_request_preempted_recomputes_and_answers_the_same(tiny_model_dir):
    kw = dict(model=str(tiny_model_dir), dtype="float32", deterministic=True, block_size=16, enable_prefix_caching=False)
    prefill, alone = LLM(**kw), LLM(**kw)
    prompts = [[7 + (i * 13 + j) % 5000 for j in range(40)] for i in range(2)]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    want = [alone.generate([{"prompt_token_ids": p}], params)[0].outputs[0].token_ids for p in prompts]
    decode = LLM(**kw, num_blocks=7)  # room for one request to finish, not two side by side
    for i, p in enumerate(prompts):
        prefill.engine.add_request(f"p{i}", {"prompt_token_ids": p}, replace(params, max_tokens=1), export_caches=True)
        snap = run_to_completion(prefill.engine, {f"p{i}"})[f"p{i}"].kv_snapshot
        decode.engine.add_request(f"d{i}", {"prompt_token_ids": p}, params, kv_import=snap)
    done = run_to_completion(decode.engine, {"d0", "d1"})
    assert decode.engine.stats().num_preemptions > 0
    assert [done[f"d{i}"].outputs[0].token_ids for i in range(2)] == want


def test_handovers_that_cannot_be_exact_are_refused(engines):
    _, prefill, decode, _, _ = engines
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    with pytest.raises(ValueError, match="max_tokens must be 1"):
        prefill.engine.add_request("x1", prompt, SamplingParams(max_tokens=3), export_caches=True)
    prefill.engine.add_request("x2", prompt, SamplingParams(max_tokens=1, temperature=0), export_caches=True)
    snap = run_to_completion(prefill.engine, {"x2"})["x2"].kv_snapshot
    with pytest.raises(ValueError, match="different prompt"):
        decode.engine.add_request("y1", {"prompt_token_ids": [5, 6, 7, 9]}, SamplingParams(max_tokens=4), kv_import=snap)
    with pytest.raises(ValueError, match="nothing is left"):
        decode.engine.add_request("y2", prompt, SamplingParams(max_tokens=1), kv_import=snap)
    with pytest.raises(ValueError, match="sent none"):
        decode.engine.add_request("y3", prompt, SamplingParams(max_tokens=4, logprobs=1), kv_import=snap)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        decode.engine.add_request("y4", prompt, SamplingParams(max_tokens=4, prompt_logprobs=1), kv_import=snap)
    assert not decode.engine.has_unfinished_requests()


def test_layouts_that_differ_are_refused_at_the_handshake(tiny_model_dir):
    kw = dict(model=str(tiny_model_dir), dtype="float32", block_size=16)
    base = LLM(**kw).engine.kv_description()
    int8 = LLM(**kw, kv_cache_dtype="int8").engine.kv_description()
    blocks = LLM(**{**kw, "block_size": 32}).engine.kv_description()
    assert layout_difference(base, base) is None
    assert "latent" in layout_difference(base, int8)
    assert "block_size" in layout_difference(base, blocks)
    receiver = KVReceiver(base, "127.0.0.1")
    try:
        with pytest.raises(KVTransferError, match="refused.*latent"):
            KVSender(int8).send(f"127.0.0.1:{receiver.port}", "t", Parcel({}, {"x": torch.zeros(2)}))
    finally:
        receiver.close()


@pytest.mark.parametrize("transport", ["tcp", "gloo"])
def test_connector_delivers_every_dtype_whole(transport):
    description = {"model": "m", "layout": [["block_size", 16]]}
    receiver = KVReceiver(description, "127.0.0.1")
    sender = KVSender(description, transport, debug=True)
    try:
        tensors = {"bf16": torch.randn(300, 64).bfloat16(), "fp32": torch.randn(3, 4, 5), "i8": torch.randint(-128, 127, (7,), dtype=torch.int8),
                   "fp8": torch.randn(9, 3).to(torch.float8_e4m3fn), "big": torch.randn(1 << 20)}  # fmt: skip
        snap = CacheSnapshot(list(range(20)), 3, {3: -0.25, 4: -2.0}, b"\x01\x02", tensors)
        for i in range(2):  # the second goes over the same link
            sender.send(f"127.0.0.1:{receiver.port}", f"t{i}", snap.parcel())
            got = CacheSnapshot.of(receiver.take(f"t{i}"))
            assert got.parcel().checksum() == snap.parcel().checksum() and got.first_logprobs == snap.first_logprobs
            assert got.generator_state == snap.generator_state and got.prompt_token_ids == snap.prompt_token_ids
        with pytest.raises(KVTransferError, match="nothing arrived"):
            receiver.take("never", timeout_s=0.2)
    finally:
        sender.close()
        receiver.close()


def test_router_splits_when_measured_costs_say_it_pays():
    costs = Costs()
    assert costs.split_pays(600, running=1, queued=0) and not costs.split_pays(100, running=1, queued=0)  # the prior
    assert not costs.split_pays(600, running=0, queued=0)  # nobody to stall
    costs.prefill_s_per_token.add(0.002)
    costs.handover_s.add(0.1)
    assert costs.split_pays(100, running=1, queued=0)  # 0.2 s of stall against a 0.1 s handover
    assert not costs.split_pays(30, running=1, queued=0) and not costs.split_pays(10_000, running=0, queued=0)
    assert costs.split_pays(100, running=4, queued=2) and not costs.split_pays(100, running=2, queued=2)  # the prefill queue counts
    assert costs.split_pays(100, running=2, queued=2, max_stall_s=0.15)  # a 0.2 s stall is longer than any decode may see
    costs.learn_prompt(400, 0, 100)
    costs.learn_prompt(40, 2, 410)
    assert costs.estimate_tokens(400, 1) == pytest.approx(100 + 200)
    assert prompt_size({"messages": [{"role": "user", "content": [{"type": "text", "text": "abc"},
                                                                   {"type": "image_url", "image_url": {"url": "x"}}]}]}) == (3, 1)  # fmt: skip
    router = Router([Instance("p", "prefill")], [Instance("d", "decode", "h:1")], "auto")
    decode = router.decode[0]
    assert not router.should_split({"prompt": "x" * 10_000, "n": 2}, decode)  # a handover carries one sample
    assert not router.should_split({"prompt": "x" * 10_000, "max_tokens": 1}, decode)  # nothing left to decode
    assert not router.should_split({"prompt": "x" * 10_000, "max_tokens": 5}, decode)  # an idle decode instance
    decode.in_flight = 3
    assert router.should_split({"prompt": "x" * 10_000, "max_tokens": 5}, decode)


def test_split_under_a_grammar_continues_the_prefill_s_first_token(engines):
    """The decode instance's grammar starts past the token the prefill instance sampled."""
    regex = r"[a-c]{3}-[0-9]{4}"
    params = SamplingParams(max_tokens=12, temperature=0.7, seed=3, structured_outputs=StructuredOutputs(regex=regex))
    prompt = {"prompt_token_ids": [11, 12, 13, 14, 15]}
    want = engines[0].generate([prompt], params)[0].outputs[0]
    got = _split(engines, f"regex-{random.random()}", prompt, params)
    assert re.fullmatch(regex, got.text) and got.token_ids == want.token_ids


def test_media_that_cannot_be_sampled_is_refused():
    from oxserve.multimodal.processor import MediaProcessor, ProcessorConfig, Video

    with pytest.raises(ValueError, match="too short"):
        MediaProcessor(ProcessorConfig()).video(Video(np.zeros((10, 64, 64, 3), np.uint8), fps=30.0))
