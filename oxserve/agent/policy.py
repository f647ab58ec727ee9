"""What a policy sees and returns: the loop's state in, ranked actions out, outcomes back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from oxserve.agent.actions import Action
from oxserve.agent.diagnosis import Diagnosis
from oxserve.agent.goal import Goal


@dataclass(frozen=True)
class Outcome:
    """How a tested action fared against the incumbent of its time."""

    action: Action
    base: dict[str, Any]  # the incumbent it was measured against
    accepted: bool
    reasons: tuple[str, ...]  # why not accepted (empty when accepted)
    experiment_ids: tuple[int, ...] = ()
    ratio: float | None = None  # median B/A of the first experiment
    median_b: float | None = None  # B's median of the goal's metric
    quality_failed: bool = False

    def to_dict(self) -> dict:
        return {"action": self.action.to_dict(), "base": self.base, "accepted": self.accepted,
                "reasons": list(self.reasons), "experiment_ids": list(self.experiment_ids), "ratio": self.ratio,
                "median_b": self.median_b, "quality_failed": self.quality_failed}


@dataclass
class AgentState:
    goal: Goal
    incumbent: dict[str, Any]  # options over base_options
    incumbent_rate: float | None  # the incumbent's median metric when last measured
    diagnosis: Diagnosis | None  # the incumbent's profile (None for policies that do not read it)
    history: list[Outcome] = field(default_factory=list)

    def tried(self, action: Action) -> bool:
        """Tested already against this incumbent, or failed the quality gate against any:
        a precision that moved the outputs once will move them again."""
        for o in self.history:
            if o.action.key() == action.key() and (o.base == self.incumbent or o.quality_failed):
                return True
        return False


class Policy(Protocol):
    name: str
    needs_diagnosis: bool  # the loop profiles each new incumbent for it

    def propose(self, state: AgentState) -> list[Action]:
        """Actions to test next, best first; the loop runs the first that is untried and passes
        its checks. An empty list ends the search."""

    def observe(self, outcome: Outcome) -> None:
        """The measured outcome of an action this policy proposed."""
