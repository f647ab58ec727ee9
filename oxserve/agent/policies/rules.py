"""The `rules` policy: a catalogue mapping diagnoses to remedies, each with a predicted gain
from a cost model, ranked by expected gain per minute of experiment.

The cost models, all from the incumbent's profile (`Diagnosis`) and this machine's ceilings:

- **Amdahl over phases.** A remedy speeds up some phases by r; the run's predicted ratio is
  1 / ((1 - s) + s / r), s the share of step time in those phases.
- **Bytes, discounted by how byte-bound the step is.** A change of bytes (dtype, W8A8, cache
  dtypes, ReplaySSM) divides a decode step's least bytes by R (`decode_step_cost`, the
  analytic model the profile and the experiments' roofline use). A step running at a fraction
  f of its roofline is mostly overhead, which fewer bytes do not remove: r = 1 + (R - 1) f.
- **A step costs O + n c** for n tokens: a per-step overhead and a cost per token, fitted
  through two measured points, the decode steps (their mean batch and time) and the prefill
  (or mixed) steps (their mean tokens and time). Decoding b1 instead of b0 sequences per step:
  r = (b1 / b0) (O + b0 c) / (O + b1 c). Prefilling P prompt tokens in chunks of n1 instead
  of n0 tokens: r = (O / n0 + c) / (O / n1 + c).
- **Threads**: Amdahl with a parallel fraction of 0.7 of the step (assumed; the measurement
  corrects it).
- **Captured decode steps** remove a share of the per-step overhead O (the Python around the
  kernels), not the per-token cost: r = (O + b c) / ((1 - x) O + b c), x = 0.5 as measured
  here (a batch-1 decode step 4.1-5.0 ms eager, 1.9-2.5 ms replayed: docs/performance.md).
- **N-gram speculation** is replayed on the profiled run's own outputs (`lookup_replay`): a
  decode step that verifies D drafts per request costs O + b (1 + D) c and yields L tokens,
  so r = L (O + b c) / (O + b (1 + D) c). An upper bound: full-depth drafts (the engine's guard
  drafts less where they do not pay), and sampled outputs accept less than greedy ones.

A rule proposes nothing when its diagnosis does not hold (e.g. the batch limit is not
binding), and only values the goal's search space lists.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from oxserve.agent.actions import Action
from oxserve.agent.diagnosis import Diagnosis
from oxserve.agent.plans import OPTION as PLAN_OPTION
from oxserve.agent.plans import kl_budget
from oxserve.agent.policy import AgentState, Outcome
from oxserve.engine.speculative import SpeculativeConfig, lookup_replay
from oxserve.experiment.procedure import _model_path, decode_step_cost
from oxserve.model.config import TextModelConfig
from oxserve.feedback.workload import Workload

PARALLEL_FRACTION = 0.7  # share of a step assumed to scale with threads
REPLAY_OVERHEAD_CUT = 0.5  # share of an eager step's per-step overhead a replayed recording removes
PROCESS_START_S = 6.0  # a worker's start and warm-up, per run
MIN_GAIN = 0.01  # predicted gains below this are not worth an experiment
BENCH_TIMEOUT_S = 600.0  # for one `oxserve bench kernels` run, the cheap check of kernel remedies


@dataclass(frozen=True)
class Context:
    state: AgentState
    d: Diagnosis
    options: dict[str, Any]  # every engine option of the incumbent (defaults filled in)
    step_bytes: Callable[[Mapping[str, Any], int], float]  # (options, batch) -> a decode step's least bytes
    bench: Callable[[str, int], dict[str, float]]  # (op, batch) -> candidate -> median µs, from `bench kernels`

    def space(self, name: str) -> tuple:
        return self.state.goal.search_space.get(name, ())

    def share(self, *phases: str) -> float:
        return sum(self.d.phase_share.get(p, 0.0) for p in phases)

    def byte_fraction(self) -> float:
        """Time-weighted roofline fraction of the decode step: how much of it bytes explain."""
        total = sum(self.d.op_share.get(op, 0.0) for op in self.d.decode_roofline)
        if not total:
            return 0.0
        return min(1.0, sum(f * self.d.op_share.get(op, 0.0) for op, f in self.d.decode_roofline.items()) / total)

    def step_model(self) -> tuple[float, float] | None:
        """(overhead µs, µs per token) of a forward pass, O + n c, fitted through the decode
        steps' point and the prefill (or mixed) steps' point; None without both."""
        d = self.d
        phase = "prefill" if "prefill" in d.phase_step_us else "mixed"
        if "decode" not in d.phase_step_us or phase not in d.phase_step_us:
            return None
        n_d, n_p = d.phase_tokens.get("decode", 0.0), d.phase_tokens.get(phase, 0.0)
        t_d, t_p = d.phase_step_us["decode"], d.phase_step_us[phase]
        if n_p <= n_d or t_p <= t_d:
            return None
        per_token = (t_p - t_d) / (n_p - n_d)
        return max(t_d - n_d * per_token, 0.0), per_token

    def bytes_ratio(self, changes: Mapping[str, Any], batch: int | None = None) -> float:
        """A decode step's least bytes now over with `changes` (at the current mean batch)."""
        b = batch or max(1, round(self.d.decode_batch))
        return self.step_bytes(self.options, b) / self.step_bytes({**self.options, **changes}, b)

    def action(self, rule: str, changes: dict, rationale: str, phase_ratio: float, shares: float, **evidence) -> Action:
        predicted = amdahl(shares, phase_ratio)
        return Action(changes, rationale, round(predicted, 4), f"rules:{rule}",
                      {"phase_ratio": round(phase_ratio, 4), "phase_share": round(shares, 4), **evidence})


def queued_patches(state: AgentState) -> list[Action]:
    """The goal's candidate patches (code.patches), predicted as their authors wrote."""
    code = state.goal.code
    return [Action({}, c.rationale, c.predicted_ratio, "rules:queued-patch", {"file": c.name}, c.diff)
            for c in (code.candidates if code else ())]


def amdahl(share: float, ratio: float) -> float:
    share = min(max(share, 0.0), 1.0)
    return 1.0 / ((1.0 - share) + share / ratio)


def batch_limit(c: Context) -> list[Action]:
    current, concurrency = c.options["max_num_seqs"], _concurrency(c.state)
    if current >= concurrency or c.d.decode_batch < 0.8 * current:
        return []  # the limit is not what keeps batches small
    larger = [v for v in c.space("max_num_seqs") if v > current]
    fitting = [v for v in larger if v <= concurrency]
    if not larger:
        return []
    target = max(fitting) if fitting else min(larger)
    b0, b1 = c.d.decode_batch, min(target, concurrency)
    model = c.step_model()
    if model is None:  # no prefill point to fit: a memory-bound step, its bytes per token
        r = (b1 / b0) * c.step_bytes(c.options, max(1, round(b0))) / c.step_bytes(c.options, b1)
    else:  # tokens per step grow b1 / b0, the step's time O + b c grows less
        overhead, per_token = model
        r = (b1 / b0) * (overhead + b0 * per_token) / (overhead + b1 * per_token)
    return [c.action("batch_limit", {"max_num_seqs": target},
                     f"decode steps run {c.d.decode_batch:.1f} requests on average against a limit of {current} with "
                     f"{concurrency} in flight: allow {target}", r, c.share("decode", "mixed"), decode_batch=c.d.decode_batch)]


def prefill_budget(c: Context) -> list[Action]:
    current = c.options["max_num_batched_tokens"]
    prefill_share = c.share("prefill", "mixed")
    tokens = max(c.d.phase_tokens.get("prefill", 0.0), c.d.phase_tokens.get("mixed", 0.0))
    mean_prompt = _prompt_stats(c.state.goal.workload)[0]
    if prefill_share < 0.05 or mean_prompt <= current:
        return []  # prompts are not being cut into budget-sized chunks
    larger = sorted(v for v in c.space("max_num_batched_tokens") if v > current)
    if not larger:
        return []
    prompt_tokens = mean_prompt * min(_concurrency(c.state), c.options["max_num_seqs"])
    target = next((v for v in larger if v >= prompt_tokens), larger[-1])
    model = c.step_model()
    if model is None:
        return []
    overhead_us, per_token_us = model
    r = (overhead_us / current + per_token_us) / (overhead_us / target + per_token_us)
    return [c.action("prefill_budget", {"max_num_batched_tokens": target},
                     f"prefill steps are cut at the {current}-token budget ({tokens:.0f} tokens per step, "
                     f"{prefill_share:.0%} of the time): raise it to {target}", r, prefill_share,
                     overhead_us=round(overhead_us, 1), per_token_us=round(per_token_us, 3))]


def latency_limit(c: Context) -> list[Action]:
    """A run metric over the goal's limit (e.g. TPOT p90): smaller prefill chunks stall the
    decodes batched with them for less time. Its cost in speed is predicted (r < 1); it is
    proposed first all the same, since the judge adopts a repair that costs little."""
    broken = {name: c.d.metrics[name] for name, bound in c.state.goal.limits.items()
              if c.d.metrics.get(name, 0.0) > bound}
    smaller = sorted(v for v in c.space("max_num_batched_tokens") if v < c.options["max_num_batched_tokens"])
    model = c.step_model()
    if not broken or not smaller or model is None:
        return []
    current, target = c.options["max_num_batched_tokens"], smaller[-1]
    overhead_us, per_token_us = model
    r = (overhead_us / current + per_token_us) / (overhead_us / target + per_token_us)
    return [c.action("latency_limit", {"max_num_batched_tokens": target},
                     f"{', '.join(f'{k} {v:.4g}' for k, v in broken.items())} over the goal's limit: prefill in "
                     f"{target}-token chunks instead of {current}", r, c.share("prefill", "mixed"), repairs=sorted(broken))]


def _byte_change(rule: str, option: str, value: Any, when: Callable[[Context], str | None]) -> Callable[[Context], list[Action]]:
    """A remedy that moves fewer bytes per step: r = 1 + (R - 1) f over the whole run."""

    def propose(c: Context) -> list[Action]:
        if value not in c.space(option) or c.options[option] == value:
            return []
        reason = when(c)
        if reason is None:
            return []
        big_r = c.bytes_ratio({option: value})
        f = c.byte_fraction()
        return [c.action(rule, {option: value}, f"{reason}: {option}={value} moves x{big_r:.2f} fewer bytes per decode "
                         f"step, which runs at {f:.0%} of its roofline", 1 + (big_r - 1) * f, 1.0,
                         bytes_ratio=round(big_r, 4), byte_fraction=round(f, 4))]

    propose.__name__ = rule
    return propose


def sensitivity_plan(c: Context) -> list[Action]:
    """A per-layer plan made by `oxserve quantize sensitivity` within a KL budget (plans.py):
    it quantizes at most every layer, so W8A8's byte model bounds its gain from above."""
    markers = sorted((v for v in c.space(PLAN_OPTION) if kl_budget(v) is not None), key=kl_budget)
    if not markers or c.options.get(PLAN_OPTION) or c.options["quantization"] == "w8a8":
        return []
    reason = _decode_dominates(c)
    if reason is None:
        return []
    big_r, f, marker = c.bytes_ratio({"quantization": "w8a8"}), c.byte_fraction(), markers[0]  # the most careful first
    return [c.action("sensitivity_plan", {PLAN_OPTION: marker},
                     f"{reason}: a plan from `oxserve quantize sensitivity` within {kl_budget(marker)} nats/token moves "
                     f"at most x{big_r:.2f} fewer bytes per decode step, which runs at {f:.0%} of its roofline",
                     1 + (big_r - 1) * f, 1.0, bytes_ratio=round(big_r, 4), byte_fraction=round(f, 4))]


def _decode_dominates(c: Context) -> str | None:
    share = c.share("decode")
    return f"decode is {share:.0%} of the time" if share >= 0.3 else None


def _experts_memory_bound(c: Context) -> str | None:
    share = sum(c.d.op_share.get(op, 0.0) for op in ("moe.experts", "moe.shared", "moe.experts_and_shared"))
    return f"the experts are {share:.0%} of the time" if share >= 0.15 else None


def _kda_state_traffic(c: Context) -> str | None:
    share = sum(s for op, s in c.d.op_share.items() if op.startswith("kda."))
    return f"KDA ops are {share:.0%} of the time" if share >= 0.15 and c.share("decode") >= 0.3 else None


def _cache_limits_batch(c: Context) -> str | None:
    if c.d.preemptions > 0:
        return f"{c.d.preemptions} preemptions: the cache is full"
    return None


def threads(c: Context) -> list[Action]:
    current = c.options["threads"] or c.d.threads
    more = [v for v in c.space("threads") if current < v <= c.d.cpus]
    if not more:
        return []
    target = max(more)
    r = 1.0 / ((1 - PARALLEL_FRACTION) + PARALLEL_FRACTION * current / target)
    return [c.action("threads", {"threads": target}, f"{current} of {c.d.cpus} CPUs in use", r, 1.0)]


def captured_steps(c: Context) -> list[Action]:
    """Per-step overhead dominates decode steps: record them and replay the recordings."""
    model = c.step_model()
    if not c.options["enforce_eager"] or False not in c.space("enforce_eager") or model is None:
        return []
    overhead, per_token = model
    batch = max(c.d.decode_batch, 1.0)
    step = overhead + batch * per_token
    if overhead / step < 0.3 or c.share("decode") < 0.3:
        return []
    r = step / ((1 - REPLAY_OVERHEAD_CUT) * overhead + batch * per_token)
    return [c.action("captured_steps", {"enforce_eager": False},
                     f"a decode step of {batch:.1f} requests is {overhead / step:.0%} per-step overhead ({overhead:.0f} of "
                     f"{step:.0f} µs): record decode steps and replay them", r, c.share("decode"),
                     overhead_us=round(overhead, 1), per_token_us=round(per_token, 3))]


def ngram_speculation(c: Context) -> list[Action]:
    """Outputs that repeat their context: n-gram drafts, the best of the goal's configs."""
    model = c.step_model()
    if c.options["speculative_config"] or not c.d.sequences or model is None or c.share("decode") < 0.3:
        return []
    overhead, per_token = model
    batch = max(c.d.decode_batch, 1.0)
    best = None
    for value in c.space("speculative_config"):
        config = SpeculativeConfig.parse(value)
        if config is None or config.method != "ngram":
            continue
        steps, drafted, accepted = (sum(x) for x in zip(*(lookup_replay(p, o, config) for p, o in c.d.sequences)))
        if not steps or not drafted:
            continue
        per_step, drafts = (steps + accepted) / steps, drafted / steps
        r = per_step * (overhead + batch * per_token) / (overhead + batch * (1 + drafts) * per_token)
        if best is None or r > best[0]:
            best = (r, value, accepted / drafted, per_step, drafts)
    if best is None:
        return []
    r, value, rate, per_step, drafts = best
    return [c.action("ngram_speculation", {"speculative_config": value},
                     f"n-gram lookup replayed on this run's outputs keeps {rate:.0%} of its drafts: {per_step:.2f} "
                     f"tokens a decode step for {drafts:.2f} drafts verified", r, c.share("decode"),
                     acceptance_rate=round(rate, 4), tokens_per_step=round(per_step, 4), drafts_per_step=round(drafts, 4))]


LINEAR_OPS = ("lm_head", "moe.shared", "mlp.dense", "kda.qkv_proj", "kda.out", "mla.q_proj", "mla.kv_proj", "mla.o_proj")


def packed_linears(c: Context) -> list[Action]:
    """The cheap check first: `oxserve bench kernels` times the LM head both ways at the decode
    batch (checked against its reference); the ratio is taken for every projection."""
    if c.options["linear_kernel"] == "auto" or "auto" not in c.space("linear_kernel"):
        return []
    batch = max(1, round(c.d.decode_batch))
    times = c.bench("lm_head", batch)
    if "engine" not in times or "torch" not in times:
        return []
    kernel_ratio = times["torch"] / times["engine"]  # the engine candidate is what linear_kernel=auto runs
    share = sum(c.d.op_share.get(op, 0.0) for op in LINEAR_OPS)
    return [c.action("packed_linears", {"linear_kernel": "auto"},
                     f"projections and the LM head are {share:.0%} of the time; `bench kernels` times the packed "
                     f"LM head at x{kernel_ratio:.2f} of F.linear's speed at batch {batch}", kernel_ratio, share,
                     bench_us=times)]


def prefix_caching(c: Context) -> list[Action]:
    fraction = _prompt_stats(c.state.goal.workload)[1]
    if c.options["enable_prefix_caching"] or True not in c.space("enable_prefix_caching") or fraction <= 0.05:
        return []
    return [c.action("prefix_caching", {"enable_prefix_caching": True},
                     f"prompts share {fraction:.0%} of their tokens", 1 / (1 - min(fraction, 0.95)), c.share("prefill", "mixed"))]


CATALOGUE: tuple[Callable[[Context], list[Action]], ...] = (
    latency_limit,
    batch_limit,
    prefill_budget,
    threads,
    captured_steps,
    ngram_speculation,
    _byte_change("bf16_weights", "dtype", "bfloat16", _decode_dominates),
    _byte_change("w8a8_experts", "quantization", "w8a8", _experts_memory_bound),
    _byte_change("int8_cache", "kv_cache_dtype", "int8", _cache_limits_batch),
    _byte_change("fp8_cache", "kv_cache_dtype", "fp8", _cache_limits_batch),
    _byte_change("replay_ssm", "kda_decode", "replay", _kda_state_traffic),
    sensitivity_plan,
    packed_linears,
    prefix_caching,
)


class RulesPolicy:
    name = "rules"
    needs_diagnosis = True

    def __init__(self) -> None:
        self._benched: dict[tuple, dict[str, float]] = {}
        self.rejected: list[dict] = []  # remedies dropped because their cheap check failed (the loop journals them)

    def propose(self, state: AgentState) -> list[Action]:
        if state.diagnosis is None:
            raise ValueError("the rules policy needs the incumbent's diagnosis")
        options = state.goal.current_options(state.incumbent)
        context = Context(state, state.diagnosis, options, self._step_bytes(state), self._bench(state, options))
        proposed = [a for rule in CATALOGUE for a in rule(context)]
        repairs = [a for a in proposed if a.evidence.get("repairs")]  # the goal's limits come first
        # A remedy its own model expects to lose is not worth an experiment.
        gains = [a for a in proposed if a not in repairs and a.predicted_ratio > 1.0 + MIN_GAIN]
        gains += queued_patches(state)  # an engineer queued them to be settled: whatever their prediction
        minutes = experiment_minutes(state)
        return repairs + sorted(gains, key=lambda a: (a.predicted_ratio - 1) / minutes(a.predicted_ratio), reverse=True)

    def observe(self, outcome: Outcome) -> None:
        pass  # the diagnosis of the next incumbent is what the rules read

    def _bench(self, state: AgentState, options: Mapping[str, Any]) -> Callable[[str, int], dict[str, float]]:
        def bench(op: str, batch: int) -> dict[str, float]:
            key = (op, batch, options["dtype"], options["threads"])
            if key not in self._benched:
                try:
                    self._benched[key] = bench_kernel(op, batch, options)
                except BenchError as e:  # the remedies resting on it are not proposed; the run goes on
                    self._benched[key] = {}
                    self.rejected.append({"reason": f"the cheap check failed, so the remedies resting on it are not proposed: {e}",
                                          "check": {"op": op, "batch": batch}})
            return self._benched[key]

        return bench

    def _step_bytes(self, state: AgentState) -> Callable[[Mapping[str, Any], int], float]:
        cfg = TextModelConfig.from_file(_model_path(state.goal.base_options))
        return lambda options, batch: decode_step_cost(cfg, options, batch).bytes


def experiment_minutes(state: AgentState) -> Callable[[float], float]:
    """Minutes one experiment of a change predicted at ratio r costs: warm-ups and pairs,
    each run the incumbent's time (A) or that over r (B), plus process starts."""
    goal, d = state.goal, state.diagnosis
    run_s = d.metrics.get("total_time_s", 60.0) if d else 60.0
    runs = goal.experiment.pairs + 1  # per arm, with the warm-up
    factor = 2 if goal.confirm else 1
    return lambda r: factor * runs * (run_s + run_s / max(r, 0.1) + 2 * PROCESS_START_S) / 60.0


def _concurrency(state: AgentState) -> int:
    w = state.goal.workload
    return w.arrival.concurrency or w.num_requests


def _prompt_stats(w: Workload) -> tuple[float, float]:
    """(mean prompt tokens, mean shared-prefix fraction) of the workload's requests."""
    lens = w.input_len.sample(np.random.default_rng(w.seed), w.num_requests)
    return float(lens.mean()), float((w.shared_prefix.prefix_lens(lens) / lens).mean())


class BenchError(RuntimeError):
    """`oxserve bench kernels` failed, timed out or printed no results."""


def bench_kernel(op: str, batch: int, options: Mapping[str, Any]) -> dict[str, float]:
    """candidate -> median µs of `oxserve bench kernels` for one op (every candidate checked
    against the op's reference first; a failed check leaves the candidate out)."""
    command = [sys.executable, "-m", "oxserve.cli", "bench", "kernels", "--ops", op, "--batch", str(batch),
               "--dtype", options["dtype"], "--threads", str(options["threads"] or 1), "--json"]
    if options.get("model"):
        command += ["--model", str(options["model"])]
    shown = f"`oxserve {' '.join(command[3:])}`"
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise BenchError(f"{shown} took over {BENCH_TIMEOUT_S:g} s") from e
    try:
        results = json.loads(done.stdout)["results"]
    except (json.JSONDecodeError, KeyError):
        raise BenchError(f"{shown} exited {done.returncode} without results: {done.stderr.strip()[-500:]}") from None
    return {r["impl"]: r["timing"]["median_us"] for r in results if r["passed"] and r.get("timing")}
