"""The HTTP API fuzzed from its own OpenAPI schema with schemathesis: every operation, with
bodies and parameters drawn from the declared models and from values that break them. No
answer may be a 5xx, every answer must match the schema (errors in OpenAI's shape), and what
the schema forbids must be refused; the server serving and idle after each run."""

from __future__ import annotations

import os
import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import (
    allow_header_conformance,
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from server_harness import serve, tiny_model  # noqa: F401  (tiny_model: fixture)

from oxserve.server import openapi

EXAMPLES = int(os.environ.get("OXSERVE_FUZZ_EXAMPLES", "40"))  # per operation and mode; more for a deeper local run
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection, allow_header_conformance]  # fmt: skip


@pytest.fixture(scope="module")
def fuzzed_server(tiny_model, tmp_path_factory):
    with serve(tiny_model, log_dir=tmp_path_factory.mktemp("fuzz")) as s:
        yield s


def _operations(base_url: str) -> list:
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


@pytest.mark.slow
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_every_operation_survives_its_fuzzed_inputs(fuzzed_server, mode):
    """Positive: inputs the schema allows (may still be refused: a model name that is not
    served, a prompt over the context). Negative: inputs it forbids, which must get a 4xx."""
    failures = []
    served = httpx.get(f"{fuzzed_server.base_url}/v1/models").json()["data"][0]["id"]
    for operation in _operations(fuzzed_server.base_url):

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES, deadline=None, phases=[Phase.generate], suppress_health_check=list(HealthCheck),
                  database=None)  # fmt: skip
        def fuzz(case) -> None:
            if mode is GenerationMode.POSITIVE and isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
                case.body["model"] = served  # else nearly every generation would be a 404 for its model
            case.call_and_validate(checks=CHECKS, timeout=60)

        try:
            fuzz()
        except Unsatisfiable:  # negative mode, an operation with nothing to break (no body, string ids)
            assert mode is GenerationMode.NEGATIVE, operation.path
        except Exception as e:  # every operation is fuzzed; all failures are reported together
            failures.append(f"{operation.method.upper()} {operation.path}: {e}")
    assert not failures, "\n\n".join(failures)
    assert httpx.get(f"{fuzzed_server.base_url}/health").status_code == 200
    metrics = fuzzed_server.metrics()
    assert metrics["oxserve:num_requests_running"] == 0 and metrics["oxserve:num_requests_waiting"] == 0


def test_the_schema_declares_every_body(fuzzed_server):
    base = fuzzed_server.base_url
    # The declared success bodies are what the routes answer, logprobs and all.
    completion = httpx.post(f"{base}/v1/completions", json={"prompt": [11, 12], "max_tokens": 3, "logprobs": 2}).json()
    chat = httpx.post(f"{base}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                                           "logprobs": True, "top_logprobs": 2}).json()  # fmt: skip
    openapi.Completion.model_validate(completion)
    openapi.ChatCompletion.model_validate(chat)
    openapi.ModelList.model_validate(httpx.get(f"{base}/v1/models").json())
    spec = httpx.get(f"{fuzzed_server.base_url}/openapi.json").json()
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            if method == "post" and not path.endswith("/cancel"):
                assert op.get("requestBody"), f"{method} {path} declares no body"
            assert "4XX" in op["responses"] and "422" not in op["responses"], f"{method} {path}"
