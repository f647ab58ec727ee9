import json
import math

import numpy as np
import pytest
import yaml

from oxserve.feedback.workload import (
    WORKLOADS_DIR, Arrival, LengthDist, Workload, load_workload, shipped_workloads,
)

SHIPPED = ["agent_decode_heavy", "code_completion", "code_completion_b1", "code_completion_b1_long", "code_completion_b64",
           "long_context_16k",
           "long_context_capacity", "mixed", "short_chat", "smoke"]


def smoke_dict() -> dict:
    return yaml.safe_load((WORKLOADS_DIR / "smoke.yaml").read_text())


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_workloads_load_and_round_trip(name):
    assert name in shipped_workloads()
    w = load_workload(WORKLOADS_DIR / f"{name}.yaml")
    assert w.name == name
    assert load_workload(name) == w  # bare name resolves to the shipped file
    assert Workload.from_dict(w.to_dict()) == w
    assert Workload.from_dict(json.loads(w.to_json())) == w


def test_json_files_are_accepted(tmp_path):
    path = tmp_path / "w.json"
    path.write_text(json.dumps(smoke_dict()))
    assert load_workload(path) == load_workload("smoke")


@pytest.mark.parametrize("key, value, words", [
    ("num_requests", 0, ["num_requests"]),
    ("num_requests", True, ["num_requests"]),
    ("name", "", ["name"]),
    ("seed", -1, ["seed"]),
    ("input_len", {"uniform": [10, 5]}, ["input_len", "hi"]),
    ("input_len", {"poisson": 3}, ["input_len", "poisson"]),
    ("output_len", {"normal": {"mean": 5, "std": -1, "clip": [1, 9]}}, ["output_len", "std"]),
    ("output_len", {"normal": {"mean": 5, "std": 1}}, ["output_len", "clip"]),
    ("arrival", {"concurrency": 2, "request_rate": 1.0}, ["arrival", "concurrency"]),
    ("arrival", {"request_rate": -1.0}, ["arrival", "request_rate"]),
    ("arrival", {"request_rate": 1.0, "burstiness": 0}, ["arrival", "burstiness"]),
    ("shared_prefix", {"fraction": 1.5}, ["shared_prefix", "fraction"]),
    ("shared_prefix", {"fraction": 0.5, "length": 4}, ["shared_prefix"]),
    ("sampling", {"max_tokens": 5}, ["sampling", "max_tokens"]),
    ("num_request", 3, ["num_request"]),  # a typo is an unknown key, not ignored
])
def test_validation_errors_name_the_field(key, value, words, tmp_path):
    data = smoke_dict()
    data[key] = value
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError) as exc:
        load_workload(path)
    message = str(exc.value)
    assert str(path) in message
    for word in words:
        assert word in message


def test_missing_required_key_is_named():
    data = smoke_dict()
    del data["output_len"]
    with pytest.raises(ValueError, match="output_len is required"):
        Workload.from_dict(data)


def test_direct_construction_validates():
    with pytest.raises(ValueError, match="std"):
        LengthDist("normal", lo=1, hi=10, mean=5.0, std=-2.0)
    with pytest.raises(ValueError, match="num_requests"):
        Workload("w", 0, LengthDist("fixed", value=3), LengthDist("fixed", value=3))


def test_generation_is_deterministic_per_seed():
    w = load_workload("mixed")
    first = w.requests(1000, min_token_id=10)
    assert first == w.requests(1000, min_token_id=10)
    other = w.requests(1000, rng_seed=123, min_token_id=10)
    assert [r.prompt_token_ids for r in other] != [r.prompt_token_ids for r in first]


def test_generated_requests_respect_the_spec():
    w = load_workload("mixed")
    reqs = w.requests(5000, min_token_id=100)
    assert len(reqs) == w.num_requests
    tokens = np.concatenate([r.prompt_token_ids for r in reqs])
    assert tokens.min() >= 100 and tokens.max() < 5000
    for r in reqs:
        assert 16 <= r.input_len <= 8192 and 8 <= r.output_len <= 2048
        assert r.shared_prefix_len == math.floor(0.1 * r.input_len)
        assert r.sampling["max_tokens"] == r.output_len
        assert r.sampling["temperature"] == 0.8
    # Every shared prefix is a prefix of one master sequence.
    longest = max(reqs, key=lambda r: r.shared_prefix_len)
    for r in reqs:
        n = r.shared_prefix_len
        assert r.prompt_token_ids[:n] == longest.prompt_token_ids[:n]
    arrivals = np.array([r.arrival_s for r in reqs])
    assert arrivals[0] == 0.0 and np.all(np.diff(arrivals) >= 0)


def test_poisson_arrivals_have_the_requested_rate():
    arrival = Arrival(request_rate=4.0)
    offsets = arrival.offsets(np.random.default_rng(0), 4001)
    assert np.mean(np.diff(offsets)) == pytest.approx(0.25, rel=0.05)


def test_infinite_rate_and_closed_loop_arrive_at_once():
    data = smoke_dict()
    data["arrival"] = {"request_rate": "inf"}
    w = Workload.from_dict(data)
    assert math.isinf(w.arrival.request_rate)
    assert all(r.arrival_s == 0.0 for r in w.requests(100))
    assert all(r.arrival_s == 0.0 for r in load_workload("smoke").requests(100))


def test_prompts_do_not_change_with_the_arrival_pattern():
    data = smoke_dict()
    data["arrival"] = {"request_rate": 2.0, "burstiness": 0.5}
    open_loop = Workload.from_dict(data).requests(100)
    closed = load_workload("smoke").requests(100)
    assert [r.prompt_token_ids for r in open_loop] == [r.prompt_token_ids for r in closed]


def test_smoke_is_small():
    reqs = load_workload("smoke").requests(100)
    assert len(reqs) <= 8 and all(r.input_len <= 32 and r.output_len <= 8 for r in reqs)


def test_bad_token_range_is_rejected():
    with pytest.raises(ValueError, match="min_token_id"):
        load_workload("smoke").requests(10, min_token_id=10)


def test_code_prompts_are_held_out_source_in_the_models_tokenizer():
    """`prompts: held_out_code`: each prompt is a window of stdlib source the default model
    was not trained on, and decodes back to that source."""
    from tokenizers import Tokenizer

    from oxserve.default_model import default_model
    from oxserve.default_model.train import is_held_out, source_text, stdlib_files

    w = load_workload("code_completion")
    requests = w.requests(8192, model_dir=default_model())
    assert requests == w.requests(8192, model_dir=default_model())  # same seed, same prompts
    tokenizer = Tokenizer.from_file(str(default_model() / "tokenizer.json"))
    held_out = "".join(source_text(p) or "" for p in stdlib_files() if is_held_out(p))
    for r in requests:
        assert 64 <= r.input_len <= 256
        text = tokenizer.decode(list(r.prompt_token_ids), skip_special_tokens=False)
        piece = max(text.split("<|endoftext|>"), key=len)  # a window may cross files
        assert piece[1:-1] in held_out
    with pytest.raises(ValueError, match="tokenizer"):
        w.requests(8192)
    with pytest.raises(ValueError, match="shared prefix"):
        Workload.from_dict({**w.to_dict(), "shared_prefix": {"length": 8}})
