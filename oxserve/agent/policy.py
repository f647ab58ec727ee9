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
    base_revision: str | None = None  # the incumbent's code (None: the working tree)
    revision: str | None = None  # the candidate's code: its patch committed on base_revision

    def to_dict(self) -> dict:
        return {"action": self.action.to_dict(), "base": self.base, "accepted": self.accepted,
                "reasons": list(self.reasons), "experiment_ids": list(self.experiment_ids), "ratio": self.ratio,
                "median_b": self.median_b, "quality_failed": self.quality_failed,
                "base_revision": self.base_revision, "revision": self.revision}

    @classmethod
    def from_dict(cls, d) -> Outcome:
        return cls(Action.from_dict(d["action"]), d["base"], d["accepted"], tuple(d["reasons"]),
                   tuple(d["experiment_ids"]), d["ratio"], d["median_b"], d["quality_failed"],
                   d.get("base_revision"), d.get("revision"))


@dataclass
class AgentState:
    goal: Goal
    incumbent: dict[str, Any]  # options over base_options
    incumbent_rate: float | None  # the incumbent's median metric when last measured
    diagnosis: Diagnosis | None  # the incumbent's profile (None for policies that do not read it)
    history: list[Outcome] = field(default_factory=list)
    revision: str | None = None  # the incumbent's code (None: the working tree)

    def tried(self, action: Action) -> bool:
        """Tested already against this incumbent, or holds every change of one that failed the
        quality gate against any: a precision that moved the outputs once will move them
        again, whatever else comes with it."""
        for o in self.history:
            here = o.base == self.incumbent and o.base_revision == self.revision
            if o.action.key() == action.key() and here:
                return True
            if o.quality_failed and _holds(action, o.action):
                return True
        return False


def _holds(action: Action, failed: Action) -> bool:
    """Whether `action` makes every change `failed` made (its options and its patch)."""
    same_options = all(k in action.changes and action.changes[k] == v for k, v in failed.changes.items())
    return same_options and (not failed.patch or failed.patch == action.patch) and bool(failed.changes or failed.patch)


class Policy(Protocol):
    name: str
    needs_diagnosis: bool  # the loop profiles each new incumbent for it

    def propose(self, state: AgentState) -> list[Action]:
        """Actions to test next, best first; the loop runs the first that is untried and passes
        its checks. An empty list ends the search."""

    def observe(self, outcome: Outcome) -> None:
        """The measured outcome of an action this policy proposed."""
