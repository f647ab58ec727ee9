"""`oxserve bench throughput`: one offline workload on oxserve and on HF transformers'
`generate` (same checkpoint, prompts, output lengths) in one run, plus the decode floor of
this machine and decode step time at growing contexts.

Phases on oxserve are told apart by step: a step that computes any prompt token counts as
prefill time, a step with only decodes as decode time. On HF, prefill is the time to the
first generated token (a logits processor stamps it), decode the rest.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from oxserve.cli import add_engine_arguments, engine_config_from_args
from oxserve.engine.engine import DTYPES, LLMEngine
from oxserve.sampling_params import RequestOutputKind, SamplingParams
from oxserve.telemetry import Tracer


@dataclass
class PhaseRates:
    prefill_tok_s: float
    decode_tok_s: float
    output_tok_s: float
    total_s: float

    def as_dict(self) -> dict:
        return {k: round(v, 2) for k, v in self.__dict__.items()}


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    parser.add_argument("--num-prompts", type=int, default=32, help="requests in the workload (default: %(default)s)")
    parser.add_argument("--input-len", type=int, default=512, help="prompt tokens per request (default: %(default)s)")
    parser.add_argument("--output-len", type=int, default=128, help="generated tokens per request, ignore_eos (default: %(default)s)")
    parser.add_argument("--skip-hf", action="store_true", help="do not run the HF transformers side")
    parser.add_argument(
        "--context-lens", default="512,4096,16384",
        help="contexts at which to time single-request decode steps, comma-separated; empty to skip (default: %(default)s)",
    )
    parser.add_argument("--bench-seed", type=int, default=0, help="seed of the random prompts (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    config = engine_config_from_args(args)
    start = time.perf_counter()
    engine = LLMEngine(config)
    start_s = time.perf_counter() - start  # the first engine of the process: one-time imports included
    prompts = _random_prompts(args.num_prompts, args.input_len, engine, args.bench_seed)
    print(f"model {engine.model_path}  dtype {config.model.dtype}  device {config.model.device}  "
          f"threads {torch.get_num_threads()}", file=sys.stderr)
    print(f"engine start-up {start_s:.2f} s (load, cache planning, first-engine imports)", file=sys.stderr)
    print(f"workload: {args.num_prompts} requests x {args.input_len} prompt tokens, {args.output_len} output tokens", file=sys.stderr)
    ours = run_oxserve(engine, prompts, args.output_len)
    result: dict = {"oxserve": ours.as_dict(), "workload": vars_subset(args), "engine_start_s": round(start_s, 3)}
    print(_row("oxserve", ours), file=sys.stderr)
    captured = engine.runner.captured
    if captured is not None:  # its recording steps are in the decode time above
        result["captured_steps"] = {"recorded": captured.captures, "replayed": captured.replays,
                                    "recording_ms": round(captured.capture_s * 1e3, 1), "eager": len(captured.refused)}
        print(f"captured decode steps: {captured.captures} shapes recorded in {captured.capture_s * 1e3:.0f} ms of "
              f"steps, {captured.replays} steps replayed, {len(captured.refused)} shapes eager", file=sys.stderr)
    if not args.skip_hf:
        hf = run_hf(engine, prompts, args.output_len, config.model.dtype, config.model.device)
        result["hf"] = hf.as_dict()
        result["ratio"] = round(ours.output_tok_s / hf.output_tok_s, 2)
        result["ratios"] = {k: round(getattr(ours, k) / getattr(hf, k), 2) for k in ("prefill_tok_s", "decode_tok_s", "output_tok_s")}
        print(_row("hf", hf), file=sys.stderr)
        print(f"oxserve / hf: output {result['ratio']}x  prefill {result['ratios']['prefill_tok_s']}x  "
              f"decode {result['ratios']['decode_tok_s']}x", file=sys.stderr)
    result["decode_floor"] = decode_floor(engine, args.num_prompts, args.input_len + args.output_len // 2, ours.decode_tok_s)
    print(_floor_line(result["decode_floor"]), file=sys.stderr)
    contexts = [int(c) for c in args.context_lens.split(",") if c.strip()]
    if contexts:
        result["decode_step_ms_by_context"] = decode_steps_by_context(config, contexts)
        for row in result["decode_step_ms_by_context"]:
            print(f"context {row['context']:>6}: decode step {row['step_ms']:.2f} ms, "
                  f"MLA attention+indexer {row['attention_ms']:.2f} ms; batch-1 floor "
                  f"{row.get('floor_step_ms', float('nan')):.2f} ms, {100 * row.get('fraction_of_floor', float('nan')):.1f}% of it",
                  file=sys.stderr)
    if args.json:
        print(json.dumps(result))
    return 0


def vars_subset(args: argparse.Namespace) -> dict:
    return {"num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len}


def _random_prompts(n: int, length: int, engine: LLMEngine, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    high = engine.tokenizer.vocab_size if engine.tokenizer else engine.model_config.vocab_size
    low = min(32, high - 1)  # past the special tokens
    return [torch.randint(low, high, (length,), generator=g).tolist() for _ in range(n)]


def run_oxserve(engine: LLMEngine, prompts: list[list[int]], output_len: int) -> PhaseRates:
    # Offline generation, as HF's generate and `LLM.generate` run it: no output until a request ends.
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    engine.add_request("warmup", prompts[0][:64], SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    for i, p in enumerate(prompts):
        engine.add_request(f"bench-{i}", p, params)
    prefill_s = decode_s = 0.0
    decode_tokens = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t
        if engine.last_step.prefill_tokens:
            prefill_s += dt
        else:
            decode_s += dt
            decode_tokens += engine.last_step.decode_tokens
    total = time.perf_counter() - start
    n = len(prompts)
    return PhaseRates(
        prefill_tok_s=n * len(prompts[0]) / prefill_s,
        decode_tok_s=decode_tokens / decode_s if decode_s else 0.0,
        output_tok_s=n * output_len / total,
        total_s=total,
    )


def run_hf(engine: LLMEngine, prompts: list[list[int]], output_len: int, dtype: str, device: str) -> PhaseRates:
    try:
        from transformers import Glm5NextForConditionalGeneration, LogitsProcessor, LogitsProcessorList
    except ImportError:
        raise SystemExit("HF transformers is not installed (pip install 'oxserve[test]'), or pass --skip-hf")

    class FirstTokenClock(LogitsProcessor):
        first: float | None = None

        def __call__(self, input_ids, scores):
            if self.first is None:
                self.first = time.perf_counter()
            return scores

    model = Glm5NextForConditionalGeneration.from_pretrained(engine.model_path, dtype=DTYPES[dtype]).to(device).eval()
    ids = torch.tensor(prompts, device=device)
    kwargs = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids[:1, :64], max_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up
        clock = FirstTokenClock()
        start = time.perf_counter()
        model.generate(ids, logits_processor=LogitsProcessorList([clock]), **kwargs)
        total = time.perf_counter() - start
    prefill = clock.first - start
    n = len(prompts)
    return PhaseRates(
        prefill_tok_s=n * len(prompts[0]) / prefill,
        decode_tok_s=n * (output_len - 1) / (total - prefill),
        output_tok_s=n * output_len / total,
        total_s=total,
    )


def decode_floor(engine: LLMEngine, batch: int, context: int, measured_decode_tok_s: float) -> dict:
    """Bytes one decode step must read (weights touched + cache) over measured bandwidth."""
    from oxserve.feedback.ceilings import load_or_measure_ceilings
    from oxserve.profiling.costs import decode_step_shape, forward_cost, model_storage

    ceilings = load_or_measure_ceilings(str(engine.device))
    elem = torch.empty((), dtype=engine.dtype).element_size()
    storage = model_storage(engine.runner.model, engine.dtype, engine.cache_plan, engine.kda_replay)
    cost = forward_cost(engine.model_config, decode_step_shape(batch, context), elem, storage)
    step_s = ceilings.min_time_s(cost.bytes, cost.flops, cost.precision)
    floor_tok_s = batch / step_s
    return {
        "batch": batch,
        "context": context,
        "bytes_per_step": round(cost.bytes),
        "flops_per_step": round(cost.flops),
        "memory_bandwidth_gb_s": round(ceilings.memory_bandwidth / 1e9, 1),
        "floor_step_ms": round(step_s * 1e3, 3),
        "floor_tok_s": round(floor_tok_s, 1),
        "fraction_of_floor": round(measured_decode_tok_s / floor_tok_s, 3),
    }


def decode_steps_by_context(config, contexts: list[int], steps: int = 16) -> list[dict]:
    """Single-request decode step time at each context (as served: captured steps unless
    `--enforce-eager`), then the MLA attention share of it from `steps` more steps traced op by
    op (replayed too: a traced replay times the recorded calls of each op span)."""
    rows = []
    for context in contexts:
        engine = LLMEngine(config)
        if context + steps + 1 > engine.max_model_len:
            rows.append({"context": context, "step_ms": float("nan"), "attention_ms": float("nan"), "note": "over max_model_len"})
            continue
        g = torch.Generator().manual_seed(context)
        engine.add_request("ctx", torch.randint(32, 1000, (context,), generator=g).tolist(),
                           SamplingParams(max_tokens=2 * steps + 1, ignore_eos=True))
        while not any(out.outputs[0].token_ids for out in engine.step()):  # until the prompt is in
            pass
        times, attention = [], []
        for _ in range(steps):
            t = time.perf_counter()
            engine.step()
            times.append((time.perf_counter() - t) * 1e3)
        while engine.has_unfinished_requests():
            tracer = Tracer(engine.device)
            engine.runner.tracer = tracer
            engine.step()
            attention.append(sum(s.dur_us for s in tracer.spans if s.name.endswith((".mla.attention", ".mla.indexer"))) / 1e3)
        step_ms = statistics.median(times)
        floor = decode_floor(engine, 1, context, 1e3 / step_ms)
        rows.append({"context": context, "step_ms": round(step_ms, 3), "attention_ms": round(statistics.median(attention), 3),
                     "floor_step_ms": floor["floor_step_ms"], "fraction_of_floor": floor["fraction_of_floor"]})
    return rows


def _row(name: str, r: PhaseRates) -> str:
    return (f"{name:8s} prefill {r.prefill_tok_s:9.1f} tok/s   decode {r.decode_tok_s:8.1f} tok/s   "
            f"end-to-end {r.output_tok_s:8.1f} output tok/s   ({r.total_s:.1f} s)")


def _floor_line(f: dict) -> str:
    return (f"decode floor at batch {f['batch']}, context {f['context']}: {f['bytes_per_step'] / 1e6:.1f} MB/step at "
            f"{f['memory_bandwidth_gb_s']} GB/s -> {f['floor_step_ms']:.2f} ms/step = {f['floor_tok_s']:.0f} tok/s; "
            f"oxserve decode is {100 * f['fraction_of_floor']:.1f}% of it")
