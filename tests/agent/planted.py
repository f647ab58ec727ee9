"""A policy for tests: it proposes fixed actions, to plant what the loop's defences must catch."""

from __future__ import annotations

from oxserve.agent.actions import Action
from oxserve.agent.policy import AgentState


class Planted:
    name = "planted"
    needs_diagnosis = False

    def __init__(self, actions: list[Action]) -> None:
        self.actions = actions

    def propose(self, state: AgentState) -> list[Action]:
        return list(self.actions)

    def observe(self, outcome) -> None:
        pass
