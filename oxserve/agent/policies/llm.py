"""The `llm` policy: a language model behind any OpenAI-compatible endpoint proposes actions.

It sees the incumbent's diagnosis, the ledger, the allowed actions and the guardrails, and
answers JSON, constrained by a JSON schema listing the search space where the endpoint can.
The answer is data, never instructions: parsed, checked by hand against the schema's shape
(`jsonschema` is only a test dependency), and every action passes `check_action`. Whatever
fails -- prose, broken JSON, extra keys such as "command" (or "patch", unless the goal has a
`code` section), options or values outside the search space, ratios that are not positive
numbers, patches outside the path rules, endpoint errors -- is rejected and counted in
`rejected` (the loop journals each entry); `propose` never raises. Where the goal allows
code, every item carries a "patch" (a unified diff, "" for none).

Values must match the search space as typed (8 is not 8.0, and True is not 1). Models
stringify, so a string is read as the one allowed value whose str() or JSON it is exactly
("8" -> 8, "false" -> False, "bfloat16" stays "bfloat16").
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from oxserve.agent.actions import Action, check_action
from oxserve.agent.goal import Goal
from oxserve.agent.policy import AgentState, Outcome

MAX_ACTIONS = 4
HISTORY = 20  # outcomes shown: the prompt must fit a small context
ANSWER_CHARS = 500  # of each rejected answer kept for the journal
RATIONALE_CHARS = 400  # a longer rationale is cut, not refused
_ITEM_KEYS = ("changes", "rationale", "predicted_ratio")
PATCH_CHARS = 20_000  # a longer diff is refused

SYSTEM = """You tune the oxserve LLM inference engine by changing its options. Each change you propose is \
measured in a controlled A/B experiment against the incumbent and adopted only if it proves a gain in {metric} \
(higher is better) without hurting output quality.
Rules:
- Change only the options listed under "allowed", each to one of its listed values, typed exactly as listed.
- You cannot run commands or read or write files: propose {what} only.
- At most {n} actions, best first; do not repeat a change the ledger shows was tested against this incumbent.
- predicted_ratio is your predicted B/A ratio of {metric} (1.1 means 10% higher); it must be > 0.
- Answer with JSON only, no prose: {{"actions": [{{"changes": {{"<option>": <value>}}, "rationale": "<why, from \
the diagnosis>", "predicted_ratio": <number>}}]}}"""
CODE_RULES = """
You may also change code: give each action a "patch", a unified diff (git format, paths a/... b/...) against the \
incumbent's code, or "" for none. A patch may touch only files matching {allowed}; the measuring harness, the \
agent, tests and workloads are off limits, and a patch that reaches for clocks or the harness is refused. It must \
pass {tests} before it is measured."""


def schema(goal: Goal) -> dict:
    """The answer's JSON schema; `changes` may name only search-space options, with their values."""
    changes = {"type": "object", "additionalProperties": False, "minProperties": 1,
               "properties": {name: {"enum": list(values)} for name, values in goal.search_space.items()}}
    keys = item_keys(goal)
    item = {"type": "object", "additionalProperties": False, "required": list(keys),
            "properties": {"changes": changes, "rationale": {"type": "string", "maxLength": RATIONALE_CHARS},
                           "predicted_ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 100}}}
    if "patch" in keys:
        changes["minProperties"] = 0
        item["properties"]["patch"] = {"type": "string", "maxLength": PATCH_CHARS}
    return {"type": "object", "additionalProperties": False, "required": ["actions"],
            "properties": {"actions": {"type": "array", "maxItems": MAX_ACTIONS, "items": item}}}


def system_prompt(goal: Goal) -> str:
    code = goal.code
    text = SYSTEM.format(metric=goal.metric, n=MAX_ACTIONS,
                         what="option changes" if code is None else "option changes and code patches")
    if code is not None:
        text += CODE_RULES.format(allowed=", ".join(code.allowed), tests=" ".join(code.tests) or "the tests")
    return text


def item_keys(goal: Goal) -> tuple[str, ...]:
    return _ITEM_KEYS + (("patch",) if goal.code is not None else ())


class LLMPolicy:
    name = "llm"
    needs_diagnosis = True

    def __init__(self, base_url: str, model: str, api_key: str = "none", max_tokens: int = 1024,
                 temperature: float = 0.0, timeout_s: float = 300.0, max_retries: int = 2, attempts: int = 2):
        import openai  # only this policy needs it

        # The client retries connection errors, timeouts, 429s and 5xx itself (max_retries); an empty
        # proposal ends the search, so a transient failure must not.
        self.client = openai.OpenAI(base_url=base_url, api_key=api_key, timeout=timeout_s, max_retries=max_retries)
        self.model, self.max_tokens, self.temperature = model, max_tokens, temperature
        self.attempts = attempts  # questions per propose, each after the last answer gave no usable action
        self.use_schema = True  # until the endpoint rejects response_format
        self.answers = 0
        self.rejected: list[dict] = []

    def observe(self, outcome: Outcome) -> None:  # the ledger in the next prompt carries it
        pass

    def propose(self, state: AgentState) -> list[Action]:
        messages = [{"role": "system", "content": system_prompt(state.goal)},
                    {"role": "user", "content": prompt(state)}]
        for _ in range(self.attempts):
            answer = self._ask(messages, schema(state.goal))
            if answer is None:
                return []  # the endpoint failed (recorded); asking again at once would fail the same way
            actions, problems = self._read(answer, state)
            if actions or not problems:
                return actions  # an empty list is the model's "nothing left to try"
            # Tell the model why, so that a second answer can differ (at temperature 0 it would not).
            messages += [{"role": "assistant", "content": answer[:2000]},
                         {"role": "user", "content": "No action of that answer can run: " + "; ".join(problems)[:1000]
                          + ". Answer again, following the rules."}]
        return []

    def _ask(self, messages: list[dict], answer_schema: dict) -> str | None:
        """The model's answer, or None after recording why there is none."""
        import openai

        self.answers += 1
        kwargs = dict(model=self.model, messages=messages, max_tokens=self.max_tokens, temperature=self.temperature)
        response_format = {"type": "json_schema",
                           "json_schema": {"name": "agent_actions", "strict": True, "schema": answer_schema}}
        try:
            try:
                reply = self.client.chat.completions.create(
                    **kwargs, **({"response_format": response_format} if self.use_schema else {}))
            except openai.BadRequestError:
                if not self.use_schema:
                    raise
                reply = self.client.chat.completions.create(**kwargs)
                self.use_schema = False  # this endpoint cannot constrain: validation alone guards
            content = reply.choices[0].message.content
            if not isinstance(content, str):
                raise ValueError(f"no text in the reply ({content!r})")
            return content
        except Exception as e:  # anything the endpoint does is its failure, never ours to raise
            self._reject("", f"endpoint error: {type(e).__name__}: {str(e)[:300]}")
            return None

    def _read(self, answer: str, state: AgentState) -> tuple[list[Action], list[str]]:
        """The answer's runnable actions, and why the others cannot run (each rejection recorded)."""
        try:
            items = parse_answer(answer, item_keys(state.goal))
        except ValueError as e:
            self._reject(answer, str(e))
            return [], [str(e)]
        actions, problems, seen = [], [], set()
        space = state.goal.search_space
        for i, item in enumerate(items):
            changes = {k: _typed(v, space[k]) if k in space else v for k, v in item["changes"].items()}
            why = [f"{k}={item['changes'][k]!r} is not among the allowed values {list(space[k])} (as typed)"
                   for k, v in changes.items() if v is _NONE]
            action = Action(changes, item["rationale"][:RATIONALE_CHARS], item["predicted_ratio"], "llm",
                            patch=item.get("patch", ""))
            why = why or check_action(action, state.goal, state.incumbent)
            if why:
                problems.append(f"action {i}: {'; '.join(why)}")
                self._reject(answer, problems[-1])
            elif state.tried(action) or action.key() in seen:
                problems.append(f"action {i}: {action.describe()} was tested already against this incumbent")
            else:
                seen.add(action.key())
                actions.append(action)
        return actions, problems

    def _reject(self, answer: str, reason: str) -> None:
        self.rejected.append({"answer": answer[:ANSWER_CHARS], "reason": reason})


def parse_answer(answer: str, keys: tuple[str, ...] = _ITEM_KEYS) -> list[dict]:
    """The answer's action items, checked against `schema`'s shape (not its enums: `check_action`
    names the option or value at fault; nor the rationale's length: it is cut); ValueError says
    what is wrong."""
    text = answer.strip()
    fence = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", text, re.DOTALL)
    try:
        data = json.loads(fence.group(1) if fence else text)
    except (ValueError, RecursionError):  # RecursionError: nesting too deep to be an answer
        raise ValueError("not JSON") from None
    if not isinstance(data, dict) or set(data) != {"actions"}:
        keys = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"not an object with exactly the key 'actions' (got {keys})")
    items = data["actions"]
    if not isinstance(items, list) or len(items) > MAX_ACTIONS:
        raise ValueError(f"'actions' must be a list of at most {MAX_ACTIONS}")
    for i, item in enumerate(items):
        if not isinstance(item, dict) or set(item) != set(keys):
            extra = sorted(set(item) - set(keys)) if isinstance(item, dict) else []
            raise ValueError(f"action {i} must have exactly the keys {', '.join(keys)}"
                             + (f"; unexpected key(s) {', '.join(map(str, extra))}" if extra else ""))
        if "patch" in keys and (not isinstance(item["patch"], str) or len(item["patch"]) > PATCH_CHARS):
            raise ValueError(f"action {i}: patch must be a unified diff of at most {PATCH_CHARS} characters")
        ratio = item["predicted_ratio"]
        if not isinstance(item["changes"], dict) or not isinstance(item["rationale"], str):
            raise ValueError(f"action {i}: changes must be an object and rationale a string")
        # float(): an integer too large for a float is as wrong as NaN (math.isfinite would raise on it)
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not _finite(ratio) or ratio <= 0:
            raise ValueError(f"action {i}: predicted_ratio {ratio!r} is not a positive number")
    return items


def _finite(x: int | float) -> bool:
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


def _typed(value: Any, allowed: tuple) -> Any:
    """The allowed value `value` stands for, as typed in the search space (1 is not True), else _NONE."""
    exact = [a for a in allowed if type(a) is type(value) and a == value]
    if not exact and isinstance(value, str):
        exact = [a for a in allowed if value in (str(a), json.dumps(a))]
    return exact[0] if len(exact) == 1 else _NONE


_NONE = object()  # no allowed value


def prompt(state: AgentState) -> str:
    """The user message: goal, incumbent, allowed actions, diagnosis and ledger, compact."""
    goal, d, current = state.goal, state.diagnosis, state.goal.current_options(state.incumbent)
    lines = [f"Goal: maximise {goal.metric} on workload {goal.workload.name!r}"
             + (f"; limits (must stay under): {_j(goal.limits)}" if goal.limits else ""),
             f"Incumbent options: {_j(state.incumbent)}; {goal.metric}: {_num(state.incumbent_rate)}",
             "Allowed (option: values; now):"]
    lines += [f"- {name}: {_j(list(vs))}; now {_j(current.get(name))}" for name, vs in goal.search_space.items()]
    if d is not None:
        ops = dict(sorted(d.op_share.items(), key=lambda kv: -kv[1])[:8])
        lines += ["Diagnosis:", *(f"  {h}" for h in d.headline[:4]),
                  f"phase share of step time: {_j(d.phase_share)}; mean step us: {_j(d.phase_step_us)}",
                  f"tokens per forward pass: {_j(d.phase_tokens)}; decode batch {_num(d.decode_batch)}; "
                  f"preemptions {d.preemptions}; threads {d.threads} of {d.cpus} CPUs",
                  f"op share of step time (top): {_j(ops)}",
                  f"decode roofline fraction by op: {_j({k: v for k, v in d.decode_roofline.items() if k in ops})}",
                  f"biggest gaps: {_j(list(d.gaps))}", f"run metrics: {_j(d.metrics)}"]
    shown = state.history[-HISTORY:]
    lines.append(f"Ledger (last {len(shown)} of {len(state.history)} tested):" if shown
                 else "Ledger: nothing tested yet.")
    for o in shown:
        verdict = "accepted" if o.accepted else "rejected: " + "; ".join(o.reasons)[:200]
        base = "" if o.base == state.incumbent else f" (against {_j(o.base)})"
        lines.append(f"- {_j(dict(o.action.changes))}{base}: predicted x{_num(o.action.predicted_ratio)}, "
                     f"measured x{_num(o.ratio)}, {verdict}")
    return "\n".join(lines)


def _num(x: Any) -> Any:
    return float(f"{x:.3g}") if isinstance(x, float) and math.isfinite(x) else x


def _j(x: Any) -> str:
    """Compact JSON with floats to 3 significant digits."""
    def rounded(v: Any) -> Any:
        if isinstance(v, dict):
            return {str(k): rounded(w) for k, w in v.items()}
        return [rounded(w) for w in v] if isinstance(v, (list, tuple)) else _num(v)
    return json.dumps(rounded(x), separators=(",", ":"), default=str)
