"""Declarative benchmark workloads (YAML or JSON) and deterministic request generation.

A workload file (every key but `name`, `num_requests`, `input_len` and `output_len` is
optional)::

    name: short_chat
    description: many short chat turns
    num_requests: 200
    seed: 0
    input_len: {uniform: [32, 512]}            # or 128, {fixed: 128},
    output_len:                               # or {normal: {mean, std, clip: [lo, hi]}}
      normal: {mean: 200, std: 80, clip: [16, 512]}
    arrival: {concurrency: 16}                # or {request_rate: 4.0, burstiness: 1.0}
                                              # or {request_rate: inf}
    shared_prefix: {fraction: 0.25}           # or {length: 512}
    conversation: {turns: 10}                 # multi-turn: see below
    prompts: random                           # or held_out_code: see below
    sampling: {temperature: 0.0, ignore_eos: true}

Each prompt is `shared prefix + unique tokens`. The shared prefix of every request is a
prefix of one master sequence, so any two requests share min(their prefix lengths) tokens::

    master:   P0 P1 P2 P3 P4 P5 ...
    req 0:    P0 P1 P2 | u u u u u u       (prefix 3 = fraction * input_len)
    req 1:    P0 P1 P2 P3 P4 | u u u u u u u u u u

With `conversation: {turns: T}`, the requests form num_requests / T conversations of T
turns (request c * T + t is turn t of conversation c). Turn 0's prompt is as above (the
shared prefix is the system prompt); a later turn's prompt is the previous turn's prompt and
output followed by `input_len` new tokens, so it is known only once the previous turn has
finished: the driver sends it then (`oxserve.feedback.drive`). Arrivals apply to turn 0.

With `prompts: held_out_code`, each prompt is instead a window of real text: the source files
of the Python standard library that the trained default model never saw (one in 20, see
`oxserve.default_model.train`), in the served model's tokenizer -- the workload of code
completion, where speculative drafts have something to predict.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import yaml

# Shipped workloads live at the repository root (used from a source/editable checkout).
WORKLOADS_DIR = Path(__file__).resolve().parents[2] / "workloads"

_TOP_LEVEL_KEYS = {
    "name", "description", "num_requests", "seed", "input_len", "output_len",
    "arrival", "shared_prefix", "conversation", "sampling", "prompts",
}
PROMPT_SOURCES = ("random", "held_out_code")


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution: fixed `value`, uniform integers in [lo, hi], or
    normal(mean, std) rounded and clipped to [lo, hi]."""

    kind: str
    value: int | None = None
    lo: int | None = None
    hi: int | None = None
    mean: float | None = None
    std: float | None = None

    def __post_init__(self) -> None:
        if self.kind == "fixed":
            _require_int(self.value, "value", minimum=1)
        elif self.kind in ("uniform", "normal"):
            _require_int(self.lo, "lo", minimum=1)
            _require_int(self.hi, "hi", minimum=1)
            if self.hi < self.lo:
                raise ValueError(f"hi must be >= lo, got lo={self.lo}, hi={self.hi}")
            if self.kind == "normal":
                _require_number(self.mean, "mean")
                _require_number(self.std, "std")
                if self.std < 0:
                    raise ValueError(f"std must be >= 0, got {self.std}")
        else:
            raise ValueError(f"kind must be 'fixed', 'uniform' or 'normal', got {self.kind!r}")

    @property
    def max_value(self) -> int:
        return self.value if self.kind == "fixed" else self.hi

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "fixed":
            return np.full(n, self.value, dtype=np.int64)
        if self.kind == "uniform":
            return rng.integers(self.lo, self.hi, size=n, endpoint=True)
        draws = np.rint(rng.normal(self.mean, self.std, size=n))
        return np.clip(draws, self.lo, self.hi).astype(np.int64)

    def to_spec(self) -> Any:
        if self.kind == "fixed":
            return {"fixed": self.value}
        if self.kind == "uniform":
            return {"uniform": [self.lo, self.hi]}
        return {"normal": {"mean": self.mean, "std": self.std, "clip": [self.lo, self.hi]}}

    @classmethod
    def from_spec(cls, spec: Any) -> LengthDist:
        """Parse `128`, `{fixed: 128}`, `{uniform: [lo, hi]}` or
        `{normal: {mean, std, clip: [lo, hi]}}`."""
        if isinstance(spec, int) and not isinstance(spec, bool):
            return cls("fixed", value=spec)
        if not isinstance(spec, Mapping) or len(spec) != 1:
            raise ValueError(
                "must be an integer or a mapping with one key: fixed, uniform or normal; "
                f"got {spec!r}"
            )
        (kind, arg), = spec.items()
        if kind == "fixed":
            return cls("fixed", value=arg)
        if kind == "uniform":
            lo, hi = _pair(arg, "uniform")
            return cls("uniform", lo=lo, hi=hi)
        if kind == "normal":
            if not isinstance(arg, Mapping):
                raise ValueError(f"normal must be a mapping with mean, std, clip; got {arg!r}")
            _reject_unknown(arg, {"mean", "std", "clip"}, "normal")
            if "clip" not in arg:
                raise ValueError("normal.clip ([lo, hi]) is required: lengths must be bounded")
            lo, hi = _pair(arg["clip"], "normal.clip")
            return cls("normal", lo=lo, hi=hi, mean=arg.get("mean"), std=arg.get("std"))
        raise ValueError(f"unknown distribution {kind!r}; expected fixed, uniform or normal")


@dataclass(frozen=True)
class Arrival:
    """How requests arrive: closed loop with `concurrency` requests in flight, or an open
    loop at `request_rate` requests/s (inf: all at once) with gamma-distributed gaps whose
    shape is `burstiness` (1.0 = Poisson; < 1 burstier, > 1 more regular)."""

    concurrency: int | None = None
    request_rate: float | None = None
    burstiness: float = 1.0

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.request_rate is None):
            raise ValueError("set exactly one of concurrency or request_rate")
        if self.concurrency is not None:
            _require_int(self.concurrency, "concurrency", minimum=1)
            if self.burstiness != 1.0:
                raise ValueError("burstiness applies only with request_rate")
            return
        _require_number(self.request_rate, "request_rate")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (or inf), got {self.request_rate}")
        _require_number(self.burstiness, "burstiness")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise ValueError(f"burstiness must be a finite number > 0, got {self.burstiness}")

    def offsets(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """Arrival time of each request in seconds from the start (the first at 0).
        Closed loop and infinite rate: everything is available at 0."""
        if self.concurrency is not None or math.isinf(self.request_rate):
            return np.zeros(n)
        scale = 1.0 / (self.request_rate * self.burstiness)  # mean gap = 1 / rate
        gaps = rng.gamma(self.burstiness, scale, size=max(n - 1, 0))
        return np.concatenate([[0.0], np.cumsum(gaps)])

    def to_spec(self) -> dict[str, Any]:
        if self.concurrency is not None:
            return {"concurrency": self.concurrency}
        if math.isinf(self.request_rate):
            return {"request_rate": "inf"}
        return {"request_rate": self.request_rate, "burstiness": self.burstiness}

    @classmethod
    def from_spec(cls, spec: Any) -> Arrival:
        if not isinstance(spec, Mapping):
            raise ValueError(f"must be a mapping (concurrency or request_rate), got {spec!r}")
        _reject_unknown(spec, {"concurrency", "request_rate", "burstiness"}, "arrival")
        rate = spec.get("request_rate")
        if isinstance(rate, str) and rate.strip().lower() in ("inf", ".inf", "infinity"):
            rate = math.inf
        return cls(
            concurrency=spec.get("concurrency"),
            request_rate=rate,
            burstiness=spec.get("burstiness", 1.0),
        )


@dataclass(frozen=True)
class SharedPrefix:
    """The part of each prompt shared by all requests: a `fraction` of each prompt or a
    fixed `length` in tokens (capped at the prompt length). Both 0: nothing shared."""

    fraction: float = 0.0
    length: int = 0

    def __post_init__(self) -> None:
        _require_number(self.fraction, "fraction")
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"fraction must be in [0, 1], got {self.fraction}")
        _require_int(self.length, "length", minimum=0)
        if self.fraction and self.length:
            raise ValueError("set fraction or length, not both")

    def prefix_lens(self, input_lens: np.ndarray) -> np.ndarray:
        if self.length:
            return np.minimum(input_lens, self.length)
        return np.floor(input_lens * self.fraction).astype(np.int64)

    def to_spec(self) -> dict[str, Any]:
        return {"length": self.length} if self.length else {"fraction": self.fraction}

    @classmethod
    def from_spec(cls, spec: Any) -> SharedPrefix:
        if not isinstance(spec, Mapping):
            raise ValueError(f"must be a mapping (fraction or length), got {spec!r}")
        _reject_unknown(spec, {"fraction", "length"}, "shared_prefix")
        return cls(fraction=spec.get("fraction", 0.0), length=spec.get("length", 0))


@dataclass(frozen=True)
class Conversation:
    """Multi-turn: each conversation has `turns` requests, each extending the last."""

    turns: int = 1

    def __post_init__(self) -> None:
        _require_int(self.turns, "turns", minimum=1)

    def to_spec(self) -> dict[str, Any]:
        return {"turns": self.turns}

    @classmethod
    def from_spec(cls, spec: Any) -> Conversation:
        if not isinstance(spec, Mapping):
            raise ValueError(f"must be a mapping (turns), got {spec!r}")
        _reject_unknown(spec, {"turns"}, "conversation")
        return cls(turns=spec.get("turns", 1))


@dataclass(frozen=True)
class WorkloadRequest:
    """One generated request. `sampling` already carries max_tokens = output_len."""

    index: int
    prompt_token_ids: tuple[int, ...]
    output_len: int
    arrival_s: float
    shared_prefix_len: int
    sampling: Mapping[str, Any] = field(hash=False)
    # Multi-turn: the conversation and turn; for turn > 0, prompt_token_ids is the new
    # message only, sent after the previous turn's prompt and output.
    conversation: int | None = None
    turn: int = 0

    @property
    def input_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class Workload:
    name: str
    num_requests: int
    input_len: LengthDist
    output_len: LengthDist
    arrival: Arrival = field(default_factory=lambda: Arrival(concurrency=1))
    shared_prefix: SharedPrefix = field(default_factory=SharedPrefix)
    conversation: Conversation = field(default_factory=Conversation)
    # Passed through to the engine's sampling parameters; it validates the values.
    sampling: Mapping[str, Any] = field(default_factory=dict, hash=False)
    seed: int = 0
    description: str = ""
    prompts: str = "random"  # or "held_out_code": windows of code the default model never saw

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(f"name must be a non-empty string, got {self.name!r}")
        _require_int(self.num_requests, "num_requests", minimum=1)
        _require_int(self.seed, "seed", minimum=0)
        for name, kind in (("input_len", LengthDist), ("output_len", LengthDist),
                           ("arrival", Arrival), ("shared_prefix", SharedPrefix), ("conversation", Conversation)):
            if not isinstance(getattr(self, name), kind):
                raise ValueError(f"{name} must be a {kind.__name__}")
        if self.conversation.turns > 1 and self.shared_prefix.fraction:
            raise ValueError("a conversation's shared prefix is a system prompt: give its length, not a fraction")
        if self.prompts not in PROMPT_SOURCES:
            raise ValueError(f"prompts must be one of {', '.join(PROMPT_SOURCES)}, got {self.prompts!r}")
        if self.prompts != "random" and (self.shared_prefix.fraction or self.shared_prefix.length
                                         or self.conversation.turns > 1):  # fmt: skip
            raise ValueError("prompts from text have no shared prefix or conversation turns")
        if self.num_requests % self.conversation.turns:
            raise ValueError(f"num_requests ({self.num_requests}) must be a multiple of conversation turns "
                             f"({self.conversation.turns})")
        if not isinstance(self.description, str):
            raise ValueError(f"description must be a string, got {self.description!r}")
        _check_sampling(self.sampling)
        object.__setattr__(self, "sampling", MappingProxyType(dict(self.sampling)))

    def requests(
        self, vocab_size: int, rng_seed: int | None = None, min_token_id: int = 0, model_dir: str | Path | None = None,
        token_seed: int | None = None,
    ) -> list[WorkloadRequest]:
        """Generate the requests: token ids in [min_token_id, vocab_size) (set
        min_token_id to skip low special ids), or text in the tokenizer of the model at
        `model_dir` (`prompts: held_out_code`). Same seed, same requests; independent
        random streams keep, e.g., the prompts unchanged when only the arrival changes.
        `token_seed` draws other prompt contents for the same lengths, arrivals and sampling
        (experiments give each pair prompts of their own, from a seed drawn at random, so
        nothing learned from one run's prompts can serve another's)."""
        _require_int(vocab_size, "vocab_size", minimum=1)
        _require_int(min_token_id, "min_token_id", minimum=0)
        if min_token_id >= vocab_size:
            raise ValueError(f"min_token_id ({min_token_id}) must be < vocab_size ({vocab_size})")
        seed = self.seed if rng_seed is None else rng_seed
        len_rng, out_rng, arrival_rng, token_rng = (
            np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(4)
        )
        if token_seed is not None:
            token_rng = np.random.default_rng(np.random.SeedSequence([seed, token_seed]).spawn(4)[3])
        n = self.num_requests
        input_lens = self.input_len.sample(len_rng, n)
        output_lens = self.output_len.sample(out_rng, n)
        arrivals = self.arrival.offsets(arrival_rng, n)
        turns = self.conversation.turns
        if turns > 1:  # the shared prefix is the system prompt, before turn 0's own tokens
            prefix_lens = np.where(np.arange(n) % turns == 0, self.shared_prefix.length, 0)
        else:
            prefix_lens = self.shared_prefix.prefix_lens(input_lens)
        master = token_rng.integers(min_token_id, vocab_size, size=int(prefix_lens.max()))
        text = self._text_tokens(model_dir) if self.prompts != "random" else None
        out = []
        for i in range(n):
            n_unique = int(input_lens[i] - prefix_lens[i]) if turns == 1 else int(input_lens[i])
            if text is not None:
                start = int(token_rng.integers(0, len(text) - n_unique))
                unique = text[start : start + n_unique]
            else:
                unique = token_rng.integers(min_token_id, vocab_size, size=n_unique)
            prompt = np.concatenate([master[: prefix_lens[i]], unique])
            out.append(WorkloadRequest(
                index=i,
                prompt_token_ids=tuple(prompt.tolist()),
                output_len=int(output_lens[i]),
                arrival_s=float(arrivals[i // turns]),
                shared_prefix_len=int(prefix_lens[i]),
                sampling=MappingProxyType({**self.sampling, "max_tokens": int(output_lens[i])}),
                conversation=i // turns if turns > 1 else None,
                turn=i % turns,
            ))
        return out

    def _text_tokens(self, model_dir: str | Path | None) -> np.ndarray:
        if model_dir is None:
            raise ValueError(f"workload {self.name} takes its prompts from text: it needs the model's tokenizer")
        from oxserve.default_model.train import held_out_tokens

        tokens = held_out_tokens(model_dir)
        if len(tokens) <= self.input_len.max_value:
            raise ValueError(f"the held-out code has {len(tokens)} tokens, fewer than a prompt of this workload")
        return tokens

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "num_requests": self.num_requests,
            "seed": self.seed,
            "input_len": self.input_len.to_spec(),
            "output_len": self.output_len.to_spec(),
            "arrival": self.arrival.to_spec(),
            "shared_prefix": self.shared_prefix.to_spec(),
            **({"conversation": self.conversation.to_spec()} if self.conversation.turns > 1 else {}),
            **({"prompts": self.prompts} if self.prompts != "random" else {}),
            "sampling": dict(self.sampling),
        }

    def to_json(self) -> str:
        """Canonical text of the workload (what the ledger stores)."""
        return json.dumps(self.to_dict(), sort_keys=True, indent=1)

    @classmethod
    def from_dict(cls, data: Any) -> Workload:
        if not isinstance(data, Mapping):
            raise ValueError(f"a workload must be a mapping, got {type(data).__name__}")
        _reject_unknown(data, _TOP_LEVEL_KEYS, "workload")
        for key in ("name", "num_requests", "input_len", "output_len"):
            if key not in data:
                raise ValueError(f"{key} is required")
        kwargs: dict[str, Any] = {
            key: data[key] for key in ("name", "num_requests", "seed", "description", "sampling", "prompts")
            if key in data
        }
        parsers = {"input_len": LengthDist.from_spec, "output_len": LengthDist.from_spec,
                   "arrival": Arrival.from_spec, "shared_prefix": SharedPrefix.from_spec,
                   "conversation": Conversation.from_spec}
        for key, parse in parsers.items():
            if key in data:
                kwargs[key] = _prefixed(key, parse, data[key])
        return cls(**kwargs)


def load_workload(path_or_name: str | Path) -> Workload:
    """Load a workload from a .yaml/.yml/.json file, or a shipped one by bare name
    ("smoke" -> workloads/smoke.yaml)."""
    path = Path(path_or_name)
    if not path.exists() and path.suffix == "" and path.name == str(path_or_name):
        path = WORKLOADS_DIR / f"{path_or_name}.yaml"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"cannot read workload file {path}: {e.strerror or e}") from e
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise ValueError(f"{path}: not valid {path.suffix.lstrip('.') or 'YAML'}: {e}") from e
    try:
        return Workload.from_dict(data)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e


def shipped_workloads() -> list[str]:
    """Names of the workloads shipped in workloads/."""
    return sorted(p.stem for p in WORKLOADS_DIR.glob("*.yaml"))


# --- validation helpers -------------------------------------------------------------


def _require_int(value: Any, name: str, minimum: int) -> None:
    # bool is an int subclass; `num_requests: true` is a typo, not 1.
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _require_number(value: Any, name: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
        raise ValueError(f"{name} must be a number, got {value!r}")


def _pair(value: Any, name: str) -> tuple[Any, Any]:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ValueError(f"{name} must be a [lo, hi] pair, got {value!r}")
    return value[0], value[1]


def _reject_unknown(spec: Mapping, allowed: set[str], where: str) -> None:
    unknown = sorted(set(spec) - allowed)
    if unknown:
        raise ValueError(f"unknown key(s) in {where}: {', '.join(map(str, unknown))} "
                         f"(allowed: {', '.join(sorted(allowed))})")


def _prefixed(key: str, parse, spec: Any):
    """Run a sub-parser and name the top-level field in its error message."""
    try:
        return parse(spec)
    except ValueError as e:
        raise ValueError(f"{key}: {e}") from e


def _check_sampling(sampling: Any) -> None:
    if not isinstance(sampling, Mapping):
        raise ValueError(f"sampling must be a mapping, got {sampling!r}")
    for key, value in sampling.items():
        if not isinstance(key, str):
            raise ValueError(f"sampling keys must be strings, got {key!r}")
        if key == "max_tokens":
            raise ValueError("sampling.max_tokens is set per request from output_len; remove it")
        if not _is_json_scalar(value) and not (
            isinstance(value, (list, tuple)) and all(map(_is_json_scalar, value))
        ):
            raise ValueError(f"sampling.{key} must be a scalar or a list of scalars, got {value!r}")


def _is_json_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))
