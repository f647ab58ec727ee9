"""A controlled A/B experiment, from the arms to a verdict in the ledger.

    prepare    check both arms' options, resolve git revisions, measure (or load) the
               machine's ceilings, start the ledger record -- all before any run
    warm-up    one run per arm, discarded; it carries the quality gate: A generates on the
               fixed prompt set and scores its tokens, B scores A's tokens; and the output
               check: A's engine scores both arms' workload outputs (`compare_outputs`)
    pairs      runs in ABBA/BAAB blocks (`interleaved_order`), each in a fresh process,
               each committed to the ledger as it finishes; more blocks while the CI of
               the median ratio is wider than twice the noise threshold. Each pair gets
               prompts of its own (same lengths, other tokens, from a seed drawn
               unpredictably and sent once the engine is ready), so no run can prepare for
               its prompts or reuse another's; one pair, drawn after the runs, has its
               outputs checked like the warm-up's. Every run must return every request's
               tokens on the prompts it was given, agree with the launcher's clock (whose
               time the rate uses), leave no process behind, and find its files as it left
               them (`TreeGuard`).
    verdict    `compare`: median B/A ratio, bootstrap CI, Mann-Whitney p, noise threshold;
               a rate above the decode roofline in either arm is "suspect"

A failure at any point marks the experiment failed with the reason; the samples already
recorded stay.
"""

from __future__ import annotations

import secrets
import shutil
import statistics
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from oxserve.cache.precision import CachePlan, LayerCachePrecision
from oxserve.cache.spec import itemsize
from oxserve.config import CacheConfig, ModelConfig, SchedulerConfig
from oxserve.experiment.arms import (
    REPO_ROOT,
    Arm,
    export_revision,
    resolve_revision,
    resolved_options,
    tree_digest,
)
from oxserve.experiment.launch import WorkerError, WorkerResult, run_worker
from oxserve.experiment.quality import compare_outputs, compare_scores, quality_prompts
from oxserve.feedback.drive import PROMPT_MIN_TOKEN_ID
from oxserve.feedback.ceilings import Ceilings, load_or_measure_ceilings
from oxserve.feedback.ledger import ExperimentRecord, Ledger, environment_info
from oxserve.feedback.machine import cache_bytes
from oxserve.feedback.stats import (
    ALPHA,
    NOISE_THRESHOLD,
    compare,
    interleaved_order,
    more_pairs_needed,
    split_by_arm,
)
from oxserve.feedback.workload import Workload
from oxserve.kernels.native import cache_dir as native_cache_dir
from oxserve.model.config import TextModelConfig
from oxserve.profiling.costs import decode_step_shape, forward_cost, layer_storage
from oxserve.sampling_params import SamplingParams

STOPPED_BY_QUALITY_GATE = "the quality gate failed: pairs not run"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class Settings:
    a: Arm
    b: Arm
    workload: Workload
    base_options: Mapping[str, Any] = field(default_factory=dict)  # engine options shared by both arms
    pairs: int = 5
    max_pairs: int = 16
    noise_threshold: float = NOISE_THRESHOLD
    alpha: float = ALPHA
    metric: str = "output_tokens_per_s"
    quality_bound: float = 0.05  # nats, largest per-token logprob divergence allowed
    quality_prompts: int = 4
    quality_tokens: int = 16
    seed: int = 0
    run_timeout_s: float = 1800.0
    threads: int | None = None  # torch threads in each worker; None: torch's default
    description: str = ""
    stop_on_quality_failure: bool = False  # skip the pairs when B fails the gate (nothing could accept it)
    output_bound: float = 0.25  # nats per token B's workload outputs may fall short of A's, scored by A

    def __post_init__(self) -> None:
        if self.pairs < 1 or self.max_pairs < self.pairs:
            raise ValueError(f"need 1 <= pairs <= max_pairs, got pairs={self.pairs}, max_pairs={self.max_pairs}")
        if not self.metric.endswith("_per_s"):
            raise ValueError(f"the metric must be a rate (higher is better, *_per_s), got {self.metric!r}")
        if self.quality_bound < 0 or self.quality_prompts < 1 or self.quality_tokens < 1:
            raise ValueError("quality_bound must be >= 0, quality_prompts and quality_tokens >= 1")
        if not self.output_bound >= 0:
            raise ValueError(f"output_bound must be >= 0, got {self.output_bound}")


@dataclass(frozen=True)
class Plan:
    """Everything decided before the first run."""

    settings: Settings
    options: Mapping[str, Mapping[str, Any]]  # arm -> engine options its worker gets
    sources: Mapping[str, Path]  # arm -> source tree its worker imports oxserve from
    records: Mapping[str, dict]  # arm -> what the ledger stores as its config
    rooflines: Mapping[str, float]  # arm -> most output tokens/s this machine allows
    prompts: tuple[tuple[int, ...], ...]  # the quality gate's prompt set
    cache_dirs: Mapping[str, Path]  # arm -> its private OXSERVE_CACHE_DIR
    vocab_size: int
    model_dir: Path
    guard: TreeGuard  # an arm's files change only while that arm runs


def prepare(settings: Settings, workdir: Path) -> Plan:
    """Check the arms and set up their sources (git exports go under `workdir`). Raises
    ValueError on anything wrong, before any run."""
    arms = {"A": settings.a, "B": settings.b}
    options = {label: resolved_options(arm, settings.base_options) for label, arm in arms.items()}
    commits = {label: resolve_revision(arm.revision) for label, arm in arms.items() if arm.revision}
    model_dir = _model_path(options["A"])
    model_cfg = TextModelConfig.from_file(model_dir)
    ceilings = load_or_measure_ceilings(options["A"].get("device", ModelConfig().device))
    return Plan(
        settings=settings,
        options=options,
        sources={label: export_revision(commits[label], workdir / label) if label in commits else REPO_ROOT
                 for label in arms},
        records={label: {"source": _source_name(arms[label], commits.get(label)), "options": options[label]}
                 for label in arms},
        rooflines={label: tokens_per_s_roofline(model_cfg, options[label], settings.workload, ceilings)
                   for label in arms},
        prompts=tuple(map(tuple, quality_prompts(model_cfg.vocab_size, settings.quality_prompts, seed=1234 + settings.seed))),
        cache_dirs={label: private_cache(workdir / f"cache-{label}") for label in arms},
        vocab_size=model_cfg.vocab_size,
        model_dir=Path(model_dir),
        guard=TreeGuard(),
    )


def private_cache(dest: Path) -> Path:
    """An arm's own OXSERVE_CACHE_DIR: a copy of the shared native-kernel builds (so neither
    arm compiles from scratch, and nothing one writes there reaches the other) and links to
    the rest (the models there are read, not written)."""
    shared = native_cache_dir().parent
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    if shared.is_dir():
        for entry in shared.iterdir():
            if entry.name == "native":
                shutil.copytree(entry, dest / "native", ignore=shutil.ignore_patterns("tmp*"))
            else:
                (dest / entry.name).symlink_to(entry)
    return dest


def new_token_seed() -> int:
    """The prompts' contents of a pair (or the warm-up): drawn unpredictably, and sent to each
    worker only once its engine is ready (launch.py), so no run can prepare for them."""
    return secrets.randbits(62)


class TreeGuard:
    """An arm's files -- an exported tree's `oxserve` package and its private cache -- change
    only while that arm runs (a compiled kernel, bytecode): what the other arm's process wrote
    there between two runs would be a message or a trap (tree check)."""

    def __init__(self) -> None:
        self.seen: dict[Path, str] = {}

    def check(self, label: str, paths: list[Path]) -> None:
        for path in paths:
            if path in self.seen and tree_digest(path) != self.seen[path]:
                raise WorkerError(f"arm {label}: {path} changed while it was not running (tree check)")

    def record(self, paths: list[Path]) -> None:
        for path in paths:
            self.seen[path] = tree_digest(path)


def guarded(plan: Plan, label: str) -> list[Path]:
    """What the tree check watches for an arm: its export's package (not this checkout, which
    people edit) and its cache's kernel builds."""
    paths = [plan.cache_dirs[label] / "native"]
    return paths + ([plan.sources[label] / "oxserve"] if plan.sources[label] != REPO_ROOT else [])


def run_arm(plan: Plan, label: str, seed: int, quality: dict | None = None) -> WorkerResult:
    """One workload run of an arm on the prompts of `seed`, checked: its files untouched since
    its last run, every request answered in full on the prompts it was given; its rate and
    total time are the launcher's (the worker's own are kept as worker_*)."""
    s = plan.settings
    job = {"options": dict(plan.options[label]), "workload": s.workload.to_dict(), "threads": s.threads,
           "quality": quality}
    done = _run_guarded(plan, label, job, f"arm {label}", seed)
    check_completeness(plan, label, seed, done.outputs)
    metrics = done.result["metrics"]
    metrics["worker_total_time_s"], metrics["worker_output_tokens_per_s"] = metrics["total_time_s"], metrics["output_tokens_per_s"]
    metrics["total_time_s"] = done.timed_s
    metrics["output_tokens_per_s"] = metrics["num_output_tokens"] / done.timed_s
    return done


def _run_guarded(plan: Plan, label: str, job: dict, name: str, seed: int | None = None) -> WorkerResult:
    """A worker on arm `label`'s tree and cache, which must be as its last run left them."""
    plan.guard.check(label, guarded(plan, label))
    done = run_worker(plan.sources[label], job, plan.settings.run_timeout_s, name, plan.cache_dirs[label], seed)
    plan.guard.record(guarded(plan, label))
    return done


def check_completeness(plan: Plan, label: str, seed: int, outputs: list[dict]) -> None:
    """Every request answered, on its own prompt (a later turn's: the previous turn's prompt
    and output, then its own message), with all its tokens where nothing could stop it early
    (ignore_eos, no stop strings); never more than it asked for (output check)."""
    requests = plan.settings.workload.requests(plan.vocab_size, min_token_id=PROMPT_MIN_TOKEN_ID,
                                               model_dir=plan.model_dir, token_seed=seed)
    if len(outputs) != len(requests):
        raise WorkerError(f"arm {label}: answered {len(outputs)} of the workload's {len(requests)} requests (output check)")
    for k, (request, out) in enumerate(zip(requests, outputs, strict=True)):
        sampling = request.sampling
        expected = request.prompt_token_ids
        if request.turn > 0:
            expected = tuple(outputs[k - 1]["prompt"]) + tuple(outputs[k - 1]["output"]) + expected
        if tuple(out["prompt"]) != tuple(expected):
            raise WorkerError(f"arm {label}: request {request.index} was not answered on its own prompt (output check)")
        wanted, got = sampling["max_tokens"], len(out["output"])
        exact = sampling.get("ignore_eos") and not sampling.get("stop") and not sampling.get("stop_token_ids")
        if got > wanted or got < 1 or (exact and got != wanted):
            raise WorkerError(f"arm {label}: request {request.index} returned {got} tokens, asked for "
                              f"{wanted}{' (ignore_eos)' if exact else ''} (output check)")


def check_outputs(plan: Plan, seed: int, a: WorkerResult, b: WorkerResult) -> dict:
    """A's engine scores both arms' outputs on the prompts of `seed`: see `compare_outputs`."""
    s = plan.settings
    job = {"options": dict(plan.options["A"]), "threads": s.threads, "verify": {"runs": {"A": a.outputs, "B": b.outputs}}}
    scored = _run_guarded(plan, "A", job, "output check (arm A)").result["verify"]
    greedy = [SamplingParams(**s.workload.sampling).greedy] * len(a.outputs)  # (every request samples alike)
    return {**compare_outputs(scored["A"], scored["B"], s.output_bound, greedy, [o["output"] for o in a.outputs],
                              [o["output"] for o in b.outputs]), "token_seed": seed}


def warm_up_with_quality_gate(plan: Plan) -> dict:
    """The discarded warm-up run of each arm, carrying the quality gate and the output check;
    returns their result (passed only if both pass)."""
    prompts = [list(p) for p in plan.prompts]
    seed = new_token_seed()
    a = run_arm(plan, "A", seed, {"prompts": prompts, "max_tokens": plan.settings.quality_tokens})
    reference = a.result["quality"]
    b = run_arm(plan, "B", seed, {"prompts": prompts, "tokens": reference["tokens"]})
    gate = compare_scores(reference["scores"], b.result["quality"]["scores"], plan.settings.quality_bound)
    return with_outputs(gate, "warm_up", check_outputs(plan, seed, a, b))


def with_outputs(quality: dict, name: str, outputs: dict) -> dict:
    """The quality record with one more output check in it; passed only if all pass."""
    checks = {**quality.get("outputs", {}), name: outputs}
    gate = quality.get("gate_passed", quality["passed"])
    return {**quality, "outputs": checks, "gate_passed": gate, "passed": gate and all(c["passed"] for c in checks.values())}


def run_experiment(settings: Settings, ledger: Ledger, log: Callable[[str], None] | None = None) -> ExperimentRecord:
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    with tempfile.TemporaryDirectory(prefix="oxserve-experiment-") as tmp:
        plan = prepare(settings, Path(tmp))
        eid = ledger.start_experiment(plan.records["A"], plan.records["B"], settings.workload,
                                      description=settings.description, environment=environment_info())
        log(f"experiment {eid}: A = {settings.a.spec or 'defaults'}, B = {settings.b.spec or 'defaults'}, "
            f"workload {settings.workload.name}")
        try:
            quality = warm_up_with_quality_gate(plan)
            out = quality["outputs"]["warm_up"]
            log(f"warm-up done; quality gate {'passed' if quality['gate_passed'] else 'FAILED'}: max divergence "
                f"{quality['max_divergence']:.4g} nats (bound {settings.quality_bound}), mean {quality['mean_divergence']:.4g}; "
                f"output check {'passed' if out['passed'] else 'FAILED'}: B's outputs {out['shortfall']:.4g} nats/token "
                f"less likely than A's under A (bound {settings.output_bound})")
            if not quality["passed"] and settings.stop_on_quality_failure:
                ledger.fail_experiment(eid, STOPPED_BY_QUALITY_GATE, quality)
                return ledger.get(eid)
            a, b, runs = _measure_pairs(plan, ledger, eid, log)
            pair = secrets.randbelow(len(runs))  # drawn now: no run could know whether it would be checked
            seed, checked = runs[pair]
            quality = with_outputs(quality, f"pair_{pair}", check_outputs(plan, seed, checked["A"], checked["B"]))
            log(f"output check of pair {pair}: {'passed' if quality['passed'] else 'FAILED'}")
            comparison = compare(a, b, noise_threshold=settings.noise_threshold, alpha=settings.alpha,
                                 roofline=max(plan.rooflines.values()))
            stats = {**comparison.to_dict(), "metric": settings.metric, "rooflines": dict(plan.rooflines),
                     "medians": _medians(ledger.get(eid))}
            ledger.finish_experiment(eid, comparison.verdict, stats, quality)
        except BaseException as e:  # incl. Ctrl-C: the record says why it stopped
            ledger.fail_experiment(eid, f"{type(e).__name__}: {e}")
            raise
    return ledger.get(eid)


def _measure_pairs(plan: Plan, ledger: Ledger, eid: int, log) -> tuple:
    """Interleaved runs, each committed as it ends, until enough pairs; (a, b) paired samples
    and, per pair, its token seed and runs {label: WorkerResult} (for the output check)."""
    s = plan.settings
    order: list[str] = []
    values: list[float] = []
    runs: list[tuple[int, dict[str, WorkerResult]]] = []
    wanted, block = s.pairs, 0
    while wanted:
        for label in interleaved_order(wanted, seed=s.seed + block):
            if len(order) % 2 == 0:  # runs 2k and 2k+1 form pair k, on prompts of their own
                runs.append((new_token_seed(), {}))
            seed, pair = runs[-1]
            pair[label] = done = run_arm(plan, label, seed)
            metrics = done.result["metrics"]
            ledger.add_sample(eid, len(order), label, metrics, done.wall_time_s)
            order.append(label)
            values.append(metrics[s.metric])
            log(f"run {len(order)} ({label}): {s.metric} = {values[-1]:.4g}")
        block += 1
        a, b = split_by_arm(order, values)
        wanted = more_pairs_needed(a, b, max_pairs=s.max_pairs, ci_width_threshold=2 * s.noise_threshold)
    return a, b, runs


def tokens_per_s_roofline(cfg: TextModelConfig, options: Mapping[str, Any], workload: Workload, ceilings: Ceilings) -> float:
    """Most output tokens/s the machine allows: the largest decode batch the run can form,
    over the least time a decode step of that batch can take (its analytic bytes and FLOPs).
    A step whose bytes fit in cache is bounded by its FLOPs alone."""
    batch = largest_decode_batch(options, workload)
    cost = decode_step_cost(cfg, options, batch)
    memory = cost.bytes if cost.bytes > cache_bytes(ceilings.device) else 0.0
    return batch / ceilings.min_time_s(memory, cost.flops, cost.precision)


def largest_decode_batch(options: Mapping[str, Any], workload: Workload) -> int:
    if options.get("deterministic"):
        return 1  # one request per forward pass
    return min(options.get("max_num_seqs", SchedulerConfig().max_num_seqs), workload.num_requests,
               workload.arrival.concurrency or workload.num_requests)


def decode_step_cost(cfg: TextModelConfig, options: Mapping[str, Any], batch: int):
    """The analytic minimum bytes and FLOPs of one decode step of `batch` requests under
    `options` (weight dtype, W8A8, cache dtypes, ReplaySSM rings)."""
    dtype = DTYPES[options.get("dtype", ModelConfig().dtype)]
    kv, kda = options.get("kv_cache_dtype", CacheConfig().kv_cache_dtype), options.get("kda_state_dtype", CacheConfig().kda_state_dtype)
    int8 = set(range(cfg.num_hidden_layers)) if options.get("quantization") == "w8a8" else set()
    conv = options.get("kda_conv_dtype", CacheConfig().kda_conv_dtype)
    plan = CachePlan(LayerCachePrecision(latent=kv, index_keys=kv, kda_state=kda, kda_conv=conv))
    cache = CacheConfig()
    replay = options.get("kda_replay_len", cache.kda_replay_len) if options.get("kda_decode", cache.kda_decode) == "replay" else 0
    storage = layer_storage(cfg, dtype, int8, plan, replay)
    return forward_cost(cfg, decode_step_shape(batch), itemsize(dtype), storage)


def _model_path(options: Mapping[str, Any]) -> Path:
    if options.get("model"):
        return Path(options["model"])
    from oxserve.default_model import default_model

    return default_model()


def _source_name(arm: Arm, commit: str | None) -> str:
    return "working tree" if commit is None else f"git:{arm.revision} ({commit[:12]})"


def _medians(record: ExperimentRecord) -> dict[str, dict[str, float]]:
    """Median of every recorded metric, per arm."""
    out = {}
    for arm in ("A", "B"):
        names = sorted({k for s in record.samples if s.arm == arm for k in s.metrics})
        out[arm] = {k: statistics.median(record.metric_values(k, arm)) for k in names}
    return out
