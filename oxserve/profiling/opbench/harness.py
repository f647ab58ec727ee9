"""Check a candidate against its reference, then time it, so that it cannot game either.

For each (case, candidate):

    1. inputs   N_SETS input sets from distinct seeds (an op's weights: the first set's in
                all); the reference's outputs for each
    2. bind     the candidate once to *live* input tensors; each call first copies a set's
                values into them (same storage, new values) and NaN-poisons the outputs
    3. check    every set in turn: wrong values, unwritten outputs, or stale values from
                a previous input (cached by identity, or computed at bind time) fail here
    4. time     warm-up, then `reps` timed calls over the rotating sets; every timed
                call's output is checked too, so timing cannot skip the work
    5. recheck  inputs regenerated *after* timing (new seed, new tensors, new binding):
                an implementation that memorised the inputs it saw fails here
    6. roofline a time below the minimum that the op's bytes and FLOPs allow on this
                machine is rejected as a broken measurement ("suspect")

The copy and the poisoning happen outside the timed region; the device is synchronised
around it.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from oxserve.feedback.ceilings import Ceilings
from oxserve.model.config import TextModelConfig
from oxserve.profiling.opbench.checks import poison
from oxserve.profiling.opbench.registry import Candidate, Case, Inputs, Op

N_SETS = 3
FRESH_SEED_OFFSET = 1_000_003


@dataclass(frozen=True)
class Timing:
    median_us: float
    p10_us: float
    p90_us: float
    min_us: float
    reps: int


@dataclass(frozen=True)
class Result:
    op: str
    case: str
    impl: str
    passed: bool
    reason: str  # why it was rejected; "" when passed
    timing: Timing | None
    bytes: float
    flops: float
    roofline_us: float | None

    @property
    def roofline_fraction(self) -> float | None:
        if self.timing is None or self.roofline_us is None:
            return None
        return self.roofline_us / self.timing.median_us

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("op", "case", "impl", "passed", "reason", "bytes", "flops", "roofline_us")}
        d["timing"] = None if self.timing is None else vars(self.timing)
        d["roofline_fraction"] = self.roofline_fraction
        return d


class Rejected(Exception):
    pass


def run_case(
    op: Op, cfg: TextModelConfig, case: Case, impl: str, candidate: Candidate, device: torch.device,
    *, warmup: int = 3, reps: int = 20, seed: int = 0, ceilings: Ceilings | None = None, cache_bytes: int = 0,
) -> Result:
    sets = [case.make_inputs(_generator(device, seed + k)) for k in range(N_SETS)]
    sets = [{**s, **{w: sets[0][w] for w in op.weights}} for s in sets]
    refs = [op.reference(cfg, s) for s in sets]
    bytes_, flops = case.cost(sets[0])
    roofline_us = _roofline_us(ceilings, case, bytes_, flops, cache_bytes)
    timing = None
    try:
        live = {k: v.clone() for k, v in sets[0].items()}
        out = case.make_outputs(live)
        run = candidate(cfg, live)

        def call(k: int) -> None:
            _load(live, sets[k])
            poison(out)
            _sync(device)

        for k in range(N_SETS):
            call(k)
            run(out)
            _expect(op, cfg, out, refs[k], sets[k], f"input set {k}")
        for r in range(warmup):
            call(r % N_SETS)
            run(out)
        times = []
        for r in range(reps):
            call(r % N_SETS)
            t0 = time.perf_counter()
            run(out)
            _sync(device)
            times.append((time.perf_counter() - t0) * 1e6)
            _expect(op, cfg, out, refs[r % N_SETS], sets[r % N_SETS], f"timed call {r}")
        timing = _timing(times)
        fresh = case.make_inputs(_generator(device, seed + FRESH_SEED_OFFSET))
        fresh_out = case.make_outputs(fresh)
        poison(fresh_out)
        candidate(cfg, fresh)(fresh_out)
        _sync(device)
        _expect(op, cfg, fresh_out, op.reference(cfg, fresh), fresh, "inputs regenerated after timing")
        if roofline_us is not None and timing.median_us < roofline_us:
            raise Rejected(f"suspect: {timing.median_us:.2f} µs is below the roofline minimum "
                           f"{roofline_us:.2f} µs for its bytes and FLOPs (the timing misses work)")
    except Rejected as e:
        return Result(op.name, case.label, impl, False, str(e), timing, bytes_, flops, roofline_us)
    except Exception as e:  # a candidate that crashes is rejected, not the whole bench
        return Result(op.name, case.label, impl, False, f"raised {type(e).__name__}: {e}", timing, bytes_, flops, roofline_us)
    return Result(op.name, case.label, impl, True, "", timing, bytes_, flops, roofline_us)


def _expect(op: Op, cfg, out, ref, inputs: Inputs, where: str) -> None:
    problem = op.check(cfg, out, ref, inputs)
    if problem:
        raise Rejected(f"wrong on {where}: {problem}")


def _roofline_us(ceilings: Ceilings | None, case: Case, bytes_: float, flops: float, cache_bytes: int) -> float | None:
    """Least time the op can take. Data that fits in cache may be served faster than memory
    bandwidth, so then only the FLOPs bound it."""
    if ceilings is None:
        return None
    memory = bytes_ if bytes_ > cache_bytes else 0.0
    return ceilings.min_time_s(memory, flops, case.precision) * 1e6


def _load(live: Inputs, values: Inputs) -> None:
    for name, tensor in live.items():
        tensor.copy_(values[name])


def _generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timing(times: list[float]) -> Timing:
    ordered = sorted(times)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return Timing(statistics.median(times), pick(0.1), pick(0.9), ordered[0], len(times))
