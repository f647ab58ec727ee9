"""The `search` policy: Optuna's TPE over the goal's search space -- the plain search the
reasoning policies must beat at the same experiment budget.

Each trial is a whole configuration drawn from the space; it is measured against the
incumbent like any other action (the loop's experiments, acceptance and confirmation are the
same for every policy). Its value for TPE is B's median of the goal's metric; a configuration
that failed the quality gate or a limit is worth 0 (it can never be accepted). On `--resume`
the study is rebuilt from the journal's outcomes. No profile is read.
"""

from __future__ import annotations

import optuna

from oxserve.agent.actions import Action
from oxserve.agent.policy import AgentState, Outcome

optuna.logging.set_verbosity(optuna.logging.WARNING)
STARTUP_TRIALS = 4  # random draws before TPE models the space (Optuna's default is 10: too many for ~12 experiments)
DRAWS_PER_PROPOSAL = 50  # draws that repeat the incumbent or a tried action are told and redrawn


class SearchPolicy:
    name = "search"
    needs_diagnosis = False

    def __init__(self, seed: int = 0) -> None:
        self._sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=STARTUP_TRIALS)
        self._study: optuna.Study | None = None
        self._pending: dict[str, optuna.trial.Trial] = {}  # action key -> the trial that drew it

    def propose(self, state: AgentState) -> list[Action]:
        study = self._study_for(state)
        distributions = _distributions(state)
        current = state.goal.current_options(state.incumbent)
        for _ in range(DRAWS_PER_PROPOSAL):
            trial = study.ask(distributions)
            changes = {k: v for k, v in trial.params.items() if current[k] != v}
            action = Action(changes, f"TPE trial {trial.number}", 1.0, "search", {"params": trial.params})
            if not changes or state.tried(action):
                # Known already: tell TPE what it is worth without spending an experiment.
                study.tell(trial, _known_value(state, action))
                continue
            self._pending[action.key()] = trial
            return [action]
        return []

    def observe(self, outcome: Outcome) -> None:
        trial = self._pending.pop(outcome.action.key(), None)
        if trial is not None and self._study is not None:
            self._study.tell(trial, _value(outcome))

    def _study_for(self, state: AgentState) -> optuna.Study:
        if self._study is None:
            self._study = optuna.create_study(direction="maximize", sampler=self._sampler)
            distributions = _distributions(state)
            for o in state.history:  # a resumed run: what was measured before
                base = state.goal.current_options(o.base)
                params = {**{k: base[k] for k in distributions}, **o.action.changes}
                if all(params.get(k) in d.choices for k, d in distributions.items()):
                    self._study.add_trial(optuna.trial.create_trial(params=params, distributions=distributions,
                                                                    value=_value(o)))
        return self._study


def _distributions(state: AgentState) -> dict[str, optuna.distributions.CategoricalDistribution]:
    return {name: optuna.distributions.CategoricalDistribution(list(values))
            for name, values in state.goal.search_space.items()}


def _value(outcome: Outcome) -> float:
    if outcome.quality_failed or outcome.median_b is None or any("limit" in r for r in outcome.reasons):
        return 0.0
    return float(outcome.median_b)


def _known_value(state: AgentState, action: Action) -> float:
    for o in reversed(state.history):
        if o.action.key() == action.key():
            return _value(o)
    return float(state.incumbent_rate or 0.0)

