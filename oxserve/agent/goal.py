"""The goal file: what the agent optimises, within which limits, over which options.

    name: from-naive
    objective:
      metric: output_tokens_per_s        # a rate of the workload run (higher is better)
      workload: agent_search             # the workload the search measures on
      held_out: agent_held_out           # measured once at the end; never seen by the search
    start: naive.yaml                    # the first incumbent's options (file, or a mapping)
    base_options: {threads: 2}           # given to every arm, never searched
    constraints:
      quality_bound: 0.05                # nats, the experiments' quality gate
      max: {tpot_p90_s: 0.5}             # medians over B's runs that must stay under these
    search_space:                        # engine option -> the values the agent may choose
      max_num_seqs: [1, 2, 4, 8, 16]
      dtype: [float32, bfloat16]
      quantization_plan: [null, sensitivity@0.01]   # a plan the agent makes within 0.01 nats/token
    budget: {wall_time_s: 3600, experiments: 20}
    experiment: {pairs: 4, max_pairs: 6, noise: 0.02, alpha: 0.05, run_timeout_s: 900, output_bound: 0.25}
    confirm: true                        # a fresh confirmation experiment before accepting
    policy: rules                        # rules | search | llm (the command line may override)
    risk:
      needs_approval: [quantization, code]  # changes to these wait for a person (`oxserve agent approve`)
    code:                                # code patches may be actions (optional; see patches.py)
      allowed: ["oxserve/engine/*", "oxserve/kernels/*"]   # files a patch may touch (fnmatch globs)
      tests: [tests/test_engine_api.py]  # run on the patched tree before any experiment
      test_timeout_s: 900
      patches:                           # candidates an engineer queued (the rules policy proposes them)
        - {file: patches/fewer_copies.diff, rationale: "...", predicted_ratio: 1.05}

Everything is checked on load: option names and values against the engine's own
configuration, workloads by loading them; a bad goal is a ValueError naming the key.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from oxserve.agent.patches import Candidate, CodeRules
from oxserve.agent.plans import MARKER as PLAN_MARKER
from oxserve.agent.plans import OPTION as PLAN_OPTION
from oxserve.agent.plans import kl_budget
from oxserve.experiment.arms import options_from_file, option_name
from oxserve.feedback.drive import RUN_METRICS
from oxserve.feedback.workload import Workload, load_workload
from oxserve.options import engine_config, flat_options, option_names

POLICIES = ("rules", "search", "llm")
CODE = "code"  # in risk.needs_approval: proven code patches wait for a person
# Options that say where and how the engine runs rather than how fast it is: never searched.
UNSEARCHABLE = frozenset({"model", "device", "seed", "master_addr", "master_port", "node_rank", "nnodes"})
_KEYS = {"name", "description", "objective", "start", "base_options", "constraints", "search_space", "budget",
         "experiment", "confirm", "policy", "risk", "code"}


@dataclass(frozen=True)
class Budget:
    wall_time_s: float = 3600.0
    experiments: int = 20

    def __post_init__(self) -> None:
        if not self.wall_time_s > 0 or self.experiments < 1:
            raise ValueError(f"budget: wall_time_s must be > 0 and experiments >= 1, got {self}")


@dataclass(frozen=True)
class ExperimentSettings:
    pairs: int = 4
    max_pairs: int = 6
    noise: float = 0.02
    alpha: float = 0.05
    run_timeout_s: float = 900.0
    output_bound: float = 0.25  # nats/token: the experiments' output check

    def __post_init__(self) -> None:
        if not 1 <= self.pairs <= self.max_pairs:
            raise ValueError(f"experiment: need 1 <= pairs <= max_pairs, got {self.pairs}, {self.max_pairs}")
        if not 0 < self.noise < 1 or not 0 < self.alpha < 1:
            raise ValueError(f"experiment: noise and alpha must be in (0, 1), got {self.noise}, {self.alpha}")
        if not self.output_bound >= 0:
            raise ValueError(f"experiment: output_bound must be >= 0, got {self.output_bound}")
        if 2 / math.comb(2 * self.pairs, self.pairs) >= self.alpha:
            raise ValueError(f"experiment: {self.pairs} pairs can never reach Mann-Whitney p < {self.alpha} "
                             f"(the least p is {2 / math.comb(2 * self.pairs, self.pairs):.3g}): nothing could be accepted")


@dataclass(frozen=True)
class Goal:
    name: str
    metric: str
    workload: Workload
    held_out: Workload | None
    start: dict[str, Any]
    base_options: dict[str, Any]
    search_space: dict[str, tuple]  # option -> allowed values, in the file's order
    quality_bound: float = 0.05
    limits: dict[str, float] = field(default_factory=dict)  # B's run-metric medians must stay <= these
    budget: Budget = Budget()
    experiment: ExperimentSettings = ExperimentSettings()
    confirm: bool = True
    policy: str = "rules"
    needs_approval: frozenset = frozenset()
    description: str = ""
    source: dict = field(default_factory=dict)  # the goal as read, for the journal
    code: CodeRules | None = None  # None: code patches are not actions of this goal

    def current_options(self, incumbent: Mapping[str, Any]) -> dict[str, Any]:
        """Every engine option of `incumbent` over base_options, the engine's defaults filled in."""
        return flat_options(engine_config({**self.base_options, **incumbent}))


def load_goal(path: str | Path) -> Goal:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"cannot read goal file {path}: {e.strerror or e}") from e
    except yaml.YAMLError as e:
        raise ValueError(f"goal file {path} is not valid YAML: {e}") from e
    try:
        return goal_from_dict(data, path.parent)
    except ValueError as e:
        raise ValueError(f"goal file {path}: {e}") from e


def goal_from_dict(data: Any, base_dir: Path = Path(".")) -> Goal:
    if not isinstance(data, Mapping):
        raise ValueError(f"a goal is a mapping, got {type(data).__name__}")
    unknown = sorted(set(data) - _KEYS)
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(_KEYS))})")
    objective = _mapping(data, "objective", required=True)
    metric = str(objective.get("metric", "output_tokens_per_s"))
    if not metric.endswith("_per_s"):
        raise ValueError(f"objective.metric must be a rate (*_per_s, higher is better), got {metric!r}")
    if metric not in RUN_METRICS:
        raise ValueError(f"objective.metric {metric!r} is not a metric runs report ({', '.join(RUN_METRICS)})")
    if "workload" not in objective:
        raise ValueError("objective.workload is required")
    workload = _workload(objective["workload"], base_dir, "objective.workload")
    held_out = _workload(objective["held_out"], base_dir, "objective.held_out") if objective.get("held_out") else None
    if held_out is not None and held_out.to_dict() == workload.to_dict():
        raise ValueError("objective.held_out must differ from objective.workload (the search must never see it)")

    base_options = _options(data.get("base_options") or {}, base_dir, "base_options")
    start = _options(data.get("start") or {}, base_dir, "start")
    code = _code(_mapping(data, CODE), base_dir) if data.get(CODE) is not None else None
    space = _search_space(_mapping(data, "search_space", required=code is None), base_options, code, base_dir)
    engine_config({**base_options, **start})  # the start must be a valid configuration
    for name, value in start.items():
        if name in space and value not in space[name]:
            raise ValueError(f"start: {name}={value!r} is not among search_space.{name} {list(space[name])}")

    constraints = _mapping(data, "constraints")
    limits = {str(k): float(v) for k, v in (constraints.get("max") or {}).items()}
    unknown_limits = sorted(set(limits) - set(RUN_METRICS))
    if unknown_limits:
        raise ValueError(f"constraints.max: {', '.join(unknown_limits)} not among the metrics runs report "
                         f"({', '.join(RUN_METRICS)})")
    risk = _mapping(data, "risk")
    needs_approval = frozenset(option_name(n) for n in risk.get("needs_approval") or ())
    unknown_risk = sorted(needs_approval - set(option_names()) - {CODE})
    if unknown_risk:
        raise ValueError(f"risk.needs_approval: unknown option(s) {', '.join(unknown_risk)}")
    policy = str(data.get("policy", "rules"))
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    try:
        budget = Budget(**_mapping(data, "budget"))
        experiment = ExperimentSettings(**_mapping(data, "experiment"))
    except TypeError as e:
        raise ValueError(f"budget/experiment: {e}") from e
    quality_bound = float(constraints.get("quality_bound", 0.05))
    if quality_bound < 0:
        raise ValueError(f"constraints.quality_bound must be >= 0, got {quality_bound}")
    return Goal(
        name=str(data.get("name", "goal")), metric=metric, workload=workload, held_out=held_out, start=start,
        base_options=base_options, search_space=space, quality_bound=quality_bound, limits=limits, budget=budget,
        experiment=experiment, confirm=bool(data.get("confirm", True)), policy=policy, needs_approval=needs_approval,
        description=str(data.get("description", "")),
        source=json.loads(json.dumps(dict(data), default=str)), code=code,
    )


def _mapping(data: Mapping, key: str, required: bool = False) -> Mapping:
    value = data.get(key)
    if value is None:
        if required:
            raise ValueError(f"{key} is required")
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{key} must be a mapping, got {type(value).__name__}")
    return value


def _workload(spec: Any, base_dir: Path, key: str) -> Workload:
    if isinstance(spec, Mapping):
        try:
            return Workload.from_dict(spec)
        except ValueError as e:
            raise ValueError(f"{key}: {e}") from e
    path = base_dir / str(spec)
    return load_workload(path if path.exists() else str(spec))


def _options(spec: Any, base_dir: Path, key: str) -> dict[str, Any]:
    if isinstance(spec, Mapping):
        options = {option_name(k): v for k, v in spec.items()}
    else:
        path = base_dir / str(spec)
        options = options_from_file(path if path.exists() else Path(str(spec)))
    try:
        engine_config(options)
    except ValueError as e:
        raise ValueError(f"{key}: {e}") from e
    return options


def _code(raw: Mapping, base_dir: Path) -> CodeRules:
    unknown = sorted(set(raw) - {"allowed", "tests", "test_timeout_s", "patches"})
    if unknown:
        raise ValueError(f"code: unknown key(s) {', '.join(unknown)}")
    allowed = raw.get("allowed")
    if not isinstance(allowed, list) or not allowed or not all(isinstance(g, str) and g for g in allowed):
        raise ValueError("code.allowed must be a non-empty list of path globs (the files a patch may touch)")
    tests = raw.get("tests") or []
    if not isinstance(tests, list) or not all(isinstance(t, str) for t in tests):
        raise ValueError("code.tests must be a list of pytest arguments")
    candidates = []
    for i, entry in enumerate(raw.get("patches") or []):
        if not isinstance(entry, Mapping) or "file" not in entry:
            raise ValueError(f"code.patches[{i}] must be a mapping with a file")
        path = base_dir / str(entry["file"])
        try:
            diff = path.read_text(encoding="utf-8")
        except OSError as e:
            raise ValueError(f"code.patches[{i}]: cannot read {path}: {e.strerror or e}") from e
        ratio = float(entry.get("predicted_ratio", 1.0))
        if not (math.isfinite(ratio) and ratio > 0):
            raise ValueError(f"code.patches[{i}].predicted_ratio must be a positive number")
        candidates.append(Candidate(diff, str(entry.get("rationale", f"queued patch {path.name}")), ratio, path.name))
    return CodeRules(tuple(allowed), tuple(tests), float(raw.get("test_timeout_s", 900.0)), tuple(candidates))


def _plan_value(value: Any, base_dir: Path) -> Any:
    """A quantization plan in the search space: none, a `sensitivity@B` marker (a plan the
    agent makes, plans.py) or a plan file (made absolute; it must exist)."""
    if value is None or kl_budget(value) is not None:
        return value
    path = base_dir / str(value)
    if not path.is_file():
        raise ValueError(f"search_space.{PLAN_OPTION}: {value!r} is neither a plan file nor {PLAN_MARKER}<KL budget>")
    return str(path.resolve())


def _search_space(raw: Mapping, base_options: Mapping[str, Any], code: CodeRules | None = None,
                  base_dir: Path = Path(".")) -> dict[str, tuple]:
    space = {}
    for key, values in raw.items():
        name = option_name(key)
        if name not in option_names():
            raise ValueError(f"search_space: unknown engine option {key!r}")
        if name in UNSEARCHABLE or name in base_options:
            raise ValueError(f"search_space: {name} is fixed (where the engine runs, or in base_options), not searched")
        if not isinstance(values, (list, tuple)) or not values:
            raise ValueError(f"search_space.{name} must be a non-empty list of values, got {values!r}")
        if name == PLAN_OPTION:
            values = [_plan_value(v, base_dir) for v in values]
        for value in values:
            try:
                engine_config({**base_options, name: value})
            except ValueError as e:
                raise ValueError(f"search_space.{name}: value {value!r} is not valid: {e}") from e
        space[name] = tuple(values)
    if not space and code is None:
        raise ValueError("search_space is empty and the goal has no code section: nothing to search")
    return space
