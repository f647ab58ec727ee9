"""Structured outputs: every constrained output matches its constraint, even from random
weights; unconstrained neighbours are unchanged; bad constraints fail alone, before queueing."""

from __future__ import annotations

import json
import re

import jsonschema
import llguidance as llg
import pytest
import torch

from oxserve import LLM, SamplingParams
from oxserve.structured import StructuredOutputs
from oxserve.structured.masks import BatchMasks, RequestGrammar

# Every field bounded, so even a random model must close the object within max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "where": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}},
                                                "required": ["x"], "additionalProperties": False}]},
    },
    "required": ["name", "age", "ok", "tags", "where"],
    "additionalProperties": False,
}  # fmt: skip
PROMPTS = ["The weather today", "def f(x):", "Numbers: 1, 2,", "Once upon a time"]


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(model=str(tiny_model_dir), dtype="float32", max_model_len=256)


def constrained(constraint: StructuredOutputs, seed: int | None, **kw) -> SamplingParams:
    temperature = 0.0 if seed is None else 1.0
    return SamplingParams(max_tokens=120, temperature=temperature, seed=seed, structured_outputs=constraint, **kw)


@pytest.mark.parametrize("seed", [None, 1, 2])
def test_json_schema_outputs_validate(llm, seed):
    params = constrained(StructuredOutputs(json=json.dumps(SCHEMA)), seed)
    for out in llm.generate(PROMPTS, params):
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)


def test_regex_choice_and_grammars(llm):
    regex = r"[A-Z][a-z]{2,5}-[0-9]{3}"
    choices = ("yes", "no", 'say "maybe"')
    lark = 'start: "(" num ("," num)* ")"\nnum: /[0-9]{1,3}/'
    gbnf = 'root ::= "<" [a-c]+ ">"'
    for seed in (3, 4):
        assert re.fullmatch(regex, llm.generate(PROMPTS[:1], constrained(StructuredOutputs(regex=regex), seed))[0].outputs[0].text)
        assert llm.generate(PROMPTS[:1], constrained(StructuredOutputs(choice=choices), seed))[0].outputs[0].text in choices
        text = llm.generate(PROMPTS[:1], constrained(StructuredOutputs(grammar=lark), seed))[0].outputs[0].text
        assert re.fullmatch(r"\([0-9]{1,3}(,[0-9]{1,3})*\)", text), text
        text = llm.generate(PROMPTS[:1], constrained(StructuredOutputs(grammar=gbnf), seed))[0].outputs[0].text
        assert re.fullmatch(r"<[a-c]+>", text), text


def test_unconstrained_neighbours_are_unchanged(llm):
    free = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, free)]
    mixed = llm.generate(PROMPTS * 2, [free] * 4 + [constrained(StructuredOutputs(json=json.dumps(SCHEMA)), i) for i in range(4)])
    assert [o.outputs[0].token_ids for o in mixed[:4]] == alone
    for out in mixed[4:]:
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)


def test_constraint_starts_after_its_token(llm):
    """`after_token_id` (a reasoning block's end): the output is free up to that token, constrained after it."""
    free = llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0].outputs[0].token_ids
    trigger = free[2]  # greedy output reaches it after three tokens
    out = llm.generate(PROMPTS[:1], constrained(StructuredOutputs(regex="[0-9]{4}", after_token_id=trigger), None))[0].outputs[0]
    assert out.token_ids[:3] == free[:3]
    rest = llm.tokenizer.decode(out.token_ids[3:])
    assert re.fullmatch("[0-9]{4}", rest), rest


@pytest.mark.parametrize(
    "constraint,needle",
    [
        (lambda: StructuredOutputs(regex="[a-"), "regex constraint cannot be compiled"),
        (lambda: StructuredOutputs(json='{"type": "object", "properties": {"a": {"type": "strnig"}}}'), "strnig"),
        (lambda: StructuredOutputs(json="{not json"), "not valid JSON"),
        (lambda: StructuredOutputs(grammar="start: undefined_rule"), "grammar constraint cannot be compiled"),
        (lambda: StructuredOutputs(regex="a", choice=("a",)), "exactly one"),
        (lambda: StructuredOutputs(choice=()), "non-empty"),
    ],
)
def test_bad_constraints_fail_before_queueing(llm, constraint, needle):
    engine = llm.engine
    running = engine.add_request(None, "still running", SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    with pytest.raises(ValueError, match=needle):
        llm.generate(["x"], SamplingParams(structured_outputs=constraint()))
    finished = [o for _ in range(20) for o in engine.step() if o.finished]
    assert [(o.request_id, len(o.outputs[0].token_ids)) for o in finished] == [(running, 8)]


def test_batch_mask_equals_each_matchers_own_mask(llm):
    """The batched bitmask and its unpacking against one matcher at a time, token by token."""
    compiler = llm.engine.grammars
    vocab = compiler.vocab_size
    constraints = [StructuredOutputs(json=json.dumps(SCHEMA)), StructuredOutputs(regex="[a-z]+ [0-9]+"), None]
    grammars = [None if c is None else RequestGrammar.of(c, compiler.matcher(c)) for c in constraints]
    masks = BatchMasks(vocab)
    g = torch.Generator().manual_seed(0)
    for _ in range(12):
        logits = torch.randn(len(grammars), vocab, generator=g)
        masked = logits.clone()
        masks.apply(masked, grammars)
        for row, grammar in enumerate(grammars):
            if grammar is None:
                assert torch.equal(masked[row], logits[row])
                continue
            bits = torch.frombuffer(bytearray(grammar.matcher.compute_bitmask()), dtype=torch.int32)
            allowed = torch.tensor([(int(bits[t // 32]) >> (t % 32)) & 1 for t in range(vocab)], dtype=torch.bool)
            assert torch.equal(masked[row].isfinite(), allowed)
            assert torch.equal(masked[row][allowed], logits[row][allowed])
            if not grammar.matcher.is_stopped():
                grammar.accept(int(masked[row].argmax()))


def test_lark_literal_round_trips_through_the_grammar_engine(llm):
    tokenizer = llm.engine.grammars.tokenizer
    for text in ['quote " and \\ backslash', "tab\tnewline\n", "ünï 東京"]:
        grammar = llg.LLMatcher.grammar_from_lark(f"start: {json.dumps(text)}")
        matcher = llg.LLMatcher(tokenizer, grammar)
        assert matcher.consume_tokens(llm.tokenizer.encode(text)) and matcher.is_accepting(), text


def test_markup_tokens_are_text_to_the_grammar_engine(llm):
    """GLM's <tool_call>, <think>... are single tokens added as text: a grammar writes them
    by their text (a forced tool call spells its own markup) and a JSON string may hold them;
    the real special tokens stay unwritable."""
    tokenizer = llm.engine.grammars.tokenizer
    text = "<tool_call>f<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>"
    ids = llm.tokenizer.encode(text)
    assert len(ids) == 9  # the tags are single tokens
    matcher = llg.LLMatcher(tokenizer, llg.LLMatcher.grammar_from_lark(f"start: {json.dumps(text)}"))
    assert matcher.consume_tokens(ids) and matcher.is_accepting()
    json_string = llg.LLMatcher(tokenizer, llg.LLMatcher.grammar_from_json_schema('{"type": "string"}'))
    assert json_string.consume_tokens(llm.tokenizer.encode('"<think>x</think>"'))
    special = llm.tokenizer.encode("<|user|>")
    assert len(special) == 1 and tokenizer.is_special_token(special[0])
    assert not llg.LLMatcher(tokenizer, llg.LLMatcher.grammar_from_regex(".*")).consume_token(special[0])
