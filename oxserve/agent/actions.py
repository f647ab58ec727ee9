"""What the agent may do, and the first, cheapest check of every proposal.

An action is a set of engine option changes over the incumbent and/or a code patch (a
unified diff, see patches.py), with the reason for it and the effect its policy predicts
(the B/A ratio of the goal's metric). Whoever proposes it -- a rule, the search, a language
model -- it passes `check_action` before anything runs: every option must be in the goal's
search space with one of its listed values, the result must be a valid engine
configuration, a patch must keep to the goal's path rules and stay clear of the harness,
and it must change something.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from oxserve.agent.goal import CODE, Goal
from oxserve.agent.patches import check_patch, digest
from oxserve.experiment.arms import REPO_ROOT
from oxserve.options import engine_config


@dataclass(frozen=True)
class Action:
    changes: Mapping[str, Any]  # engine option -> new value
    rationale: str  # why: the diagnosis it answers
    predicted_ratio: float  # predicted B/A of the goal's metric
    origin: str  # the rule, "search", or "llm"
    evidence: Mapping[str, Any] = field(default_factory=dict)  # the numbers behind the prediction
    patch: str = ""  # a unified diff against the incumbent's code ("": none)

    def key(self) -> str:
        """The same changes give the same key, whoever proposed them."""
        return json.dumps({**self.changes, **({"patch": digest(self.patch)} if self.patch else {})}, sort_keys=True)

    def describe(self) -> str:
        parts = [f"{k}={v}" for k, v in sorted(self.changes.items())]
        return ",".join(parts + ([f"patch {digest(self.patch)}"] if self.patch else []))

    def to_dict(self) -> dict:
        return {"changes": dict(self.changes), "rationale": self.rationale, "predicted_ratio": self.predicted_ratio,
                "origin": self.origin, "evidence": dict(self.evidence), "patch": self.patch}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Action:
        return cls(d["changes"], d["rationale"], d["predicted_ratio"], d["origin"], d.get("evidence", {}), d.get("patch", ""))


def check_action(action: Action, goal: Goal, incumbent: Mapping[str, Any]) -> list[str]:
    """The reasons `action` may not run against `incumbent` (empty: it may)."""
    problems = []
    if not action.changes and not action.patch:
        problems.append("it changes nothing")
    current = goal.current_options(incumbent)
    for name, value in action.changes.items():
        if name not in goal.search_space:
            problems.append(f"{name} is not in the goal's search space ({', '.join(goal.search_space)})")
        elif value not in goal.search_space[name]:
            problems.append(f"{name}={value!r} is not among the allowed values {list(goal.search_space[name])}")
        elif current.get(name) == value:
            problems.append(f"{name} is already {value!r}" + ("" if name in incumbent else " (the engine's default)"))
    if not (isinstance(action.predicted_ratio, (int, float)) and math.isfinite(action.predicted_ratio)
            and action.predicted_ratio > 0):
        problems.append(f"predicted ratio {action.predicted_ratio!r} is not a positive number")
    if action.patch:
        problems += check_patch(action.patch, goal.code, REPO_ROOT)
    if not problems:
        try:
            engine_config({**goal.base_options, **incumbent, **action.changes})
        except ValueError as e:
            problems.append(f"not a valid engine configuration: {e}")
    return problems


def needs_approval(action: Action, goal: Goal) -> list[str]:
    """The options of `action` (and `code`, for a patch) that the goal's risk rules reserve for a person."""
    touched = set(action.changes) | ({CODE} if action.patch else set())
    return sorted(touched & goal.needs_approval)

