"""`oxserve quantize sensitivity`: measure each layer's sensitivity to W8A8 weights and to
int8/fp8/bf16 caches, choose the cheapest per-layer plan within a KL budget, verify it end
to end, and write it (`--quantization-plan` reads it) with a table and a bar chart."""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import torch

from oxserve.cache.precision import CachePlan, LayerCachePrecision
from oxserve.cache.spec import bytes_per_request, bytes_per_token
from oxserve.default_model import default_model
from oxserve.engine.engine import DTYPES
from oxserve.model.loader import load_model
from oxserve.quantization import sensitivity
from oxserve.quantization.quality import calibration_sequences, shipped_calibration_text
from oxserve.quantization.smooth import DEFAULT_ALPHA, calibrate_and_quantize
from oxserve.quantization.w8a8 import quantize_w8a8_on_load
from oxserve.tokenizer import Tokenizer


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="the unquantized model's dtype (default: %(default)s)")
    parser.add_argument("--calibration-file", type=Path, default=None, help="text to calibrate on (default: the shipped corpus)")
    parser.add_argument("--sequences", type=int, default=4, help="calibration sequences (default: %(default)s)")
    parser.add_argument("--held-out", type=int, default=4, help="other sequences the final plan is verified on (default: %(default)s)")
    parser.add_argument("--length", type=int, default=128, help="tokens per sequence (default: %(default)s)")
    parser.add_argument("--kl-budget", type=float, default=0.01, help="mean KL per token the plan may cost, nats (default: %(default)s)")
    parser.add_argument("--smoothquant-alpha", type=float, default=DEFAULT_ALPHA, help="as the engine option (default: %(default)s)")
    parser.add_argument("--context", type=int, default=4096, help="tokens per request for the memory figures (default: %(default)s)")
    parser.add_argument("--cache-memory-gib", type=float, default=2.0, help="cache memory for the largest-batch figure (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--out", type=Path, default=Path("quantization-plan"), help="directory for plan.yaml, sensitivity.md/png")


def run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    path = Path(args.model) if args.model else default_model()
    dtype = DTYPES[args.dtype]
    tokenizer = Tokenizer.from_dir(path)
    text = args.calibration_file.read_text() if args.calibration_file else shipped_calibration_text()
    # Evenly spaced over the text: the held-out sequences come from its last part.
    seqs = calibration_sequences(tokenizer, text, args.sequences + args.held_out, args.length)
    calibration, held_out = seqs[: args.sequences], seqs[args.sequences :]
    started = time.monotonic()
    dense = load_model(path, dtype=dtype).model
    quantized = load_model(path, dtype=dtype, transform=lambda m: quantize_w8a8_on_load(m, deferred=True)).model
    print(f"calibration: {calibrate_and_quantize(quantized, calibration, args.smoothquant_alpha)}")
    choices = sensitivity.measure(dense, quantized, calibration, progress=lambda line: print(line, flush=True))
    taken = sensitivity.choose_plan(choices, args.kl_budget)
    reference = sensitivity.reference_logits(dense, held_out)
    while True:
        verified = _verify(dense, quantized, taken, held_out, reference)
        if verified.mean_kl <= args.kl_budget or not taken:
            break
        dropped = max(taken, key=lambda c: c.result.mean_kl)
        print(f"combined plan measured {verified}; dropping layer {dropped.layer} {dropped.component}")
        taken.remove(dropped)
    plan = sensitivity.as_plan(taken, len(dense.layers))
    args.out.mkdir(parents=True, exist_ok=True)
    memory = _memory_lines(dense, plan, dtype, taken, args)
    header = (f"oxserve quantize sensitivity: {path}, {args.dtype}, KL budget {args.kl_budget} nats/token\n"
              f"verified on {len(held_out)} held-out sequences of {args.length} tokens: {verified}")
    plan.dump(args.out / "plan.yaml", header)
    table = _table(choices, taken)
    (args.out / "sensitivity.md").write_text(f"{header}\n\n{table}\n\n" + "\n".join(memory) + "\n")
    _chart(choices, args.out / "sensitivity.png")
    print(table)
    print(f"plan ({len(taken)} of {len({(c.layer, c.component) for c in choices})} components): {args.out / 'plan.yaml'}")
    print(f"verified: {verified}")
    print("\n".join(memory))
    print(f"took {time.monotonic() - started:.0f} s")
    return 0


def _verify(dense, quantized, taken, sequences, reference):
    layers = {c.layer for c in taken if c.component == "weights"}
    cache = {}
    for c in taken:
        if c.component != "weights":
            cache[c.layer] = LayerCachePrecision(**{**_fields(cache.get(c.layer)), c.component: c.value})
    saved = list(dense.layers)
    for i in layers:
        dense.layers[i] = quantized.layers[i]
    try:
        return sensitivity.score(dense, sequences, reference, CachePlan(LayerCachePrecision(), cache))
    finally:
        for i, layer in enumerate(saved):
            dense.layers[i] = layer


def _fields(p: LayerCachePrecision | None) -> dict:
    return {} if p is None else dataclasses.asdict(p)


def _memory_lines(model, plan, dtype, taken, args) -> list[str]:
    before = model.cache_specs(dtype)
    after = model.cache_specs(dtype, plan.cache_plan(LayerCachePrecision()))

    def per_request(specs) -> float:
        return bytes_per_token(specs) * args.context + bytes_per_request(specs)

    budget = args.cache_memory_gib * 2**30
    weights = sum(c.bytes_saved for c in taken if c.component == "weights")
    return [
        f"weights: {weights / 2**20:.1f} MiB saved",
        f"cache per request at {args.context} tokens: {per_request(before) / 2**20:.2f} -> {per_request(after) / 2**20:.2f} MiB",
        f"largest batch in {args.cache_memory_gib:g} GiB of cache at {args.context} tokens: "
        f"{int(budget // per_request(before))} -> {int(budget // per_request(after))}",
    ]


def _table(choices, taken) -> str:
    chosen = {(c.layer, c.component, c.value) for c in taken}
    rows = ["| layer | component | storage | mean KL (nats/token) | max KL | top-1 agreement | in plan |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for c in choices:
        mark = "yes" if (c.layer, c.component, c.value) in chosen else ""
        rows.append(f"| {c.layer} | {c.component} | {c.value} | {c.result.mean_kl:.2e} | {c.result.max_kl:.2e} | {c.result.top1:.1%} | {mark} |")
    return "\n".join(rows)


def _chart(choices, out: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(6, len(choices) * 0.35), 4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    labels = [f"L{c.layer} {c.component} {c.value}" for c in choices]
    ax.bar(range(len(choices)), [max(c.result.mean_kl, 1e-12) for c in choices],
           color=["tab:blue" if c.component == "weights" else "tab:orange" for c in choices])
    ax.set_yscale("log")
    ax.set_xticks(range(len(choices)), labels, rotation=75, ha="right", fontsize=7)
    ax.set_ylabel("mean KL vs unquantized (nats/token)")
    ax.set_title("sensitivity per layer and component (blue: W8A8 weights, orange: caches)")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
