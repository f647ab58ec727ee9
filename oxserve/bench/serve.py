"""`oxserve bench serve`: load-test any OpenAI-compatible endpoint, reporting what
`vllm bench serve` reports.

Every request streams with `ignore_eos`, so output lengths are exactly the ones asked for,
and asks for a usage chunk, so token counts are the server's own. Per request it records
TTFT (send -> first chunk with choices), ITL (gaps between later such chunks: one per engine
step that produced tokens, when the server sends one per step as oxserve and vLLM do),
TPOT ((latency - TTFT) / (output tokens - 1)) and end-to-end latency. Where the server's
/metrics has speculative-decoding counters (oxserve's or vLLM's names), the run's acceptance
rate and mean acceptance length come from their change over the run; likewise the cost of
structured-output masks per step, when `--structured-output-ratio` sends a share of the
requests under a JSON schema, and the prefix cache's token hit rate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import base64
import io
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean, median

import httpx
import numpy as np
import PIL.Image
from prometheus_client.parser import text_string_to_metric_families

from oxserve.engine.speculative import acceptance

SLO_KEYS = ("ttft", "tpot", "e2el")
# Random chat text is drawn from syllables: cheap to make, and words tokenize to 1-3 tokens.
SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "ta", "vo", "xi", "be", "do", "fu", "ga", "hi", "jo", "pe", "si")


# Structured-output requests' default schema: every field bounded, so any model closes it.
BENCH_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "count": {"type": "integer", "minimum": 0, "maximum": 1000},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
    },
    "required": ["name", "count", "tags"],
    "additionalProperties": False,
}


@dataclass
class BenchRequest:
    prompt: str | list[int]
    output_len: int
    schema: dict | None = None  # asked for with response_format json_schema
    images: list[str] = field(default_factory=list)  # chat: data: URLs sent before the prompt's text


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0

    @property
    def tpot(self) -> float | None:
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (default: %(default)s)")
    parser.add_argument("--endpoint", choices=("completions", "chat"), default="completions", help="(default: %(default)s)")
    parser.add_argument("--model", default=None, help="model name sent in requests (default: the first of /v1/models)")
    parser.add_argument("--dataset", choices=("random", "jsonl"), default="random", help="(default: %(default)s)")
    parser.add_argument("--dataset-path", default=None, help="jsonl file: one {\"prompt\": ..., \"output_len\": N} per line")
    parser.add_argument("--random-input-len", type=int, default=1024, help="(default: %(default)s)")
    parser.add_argument("--random-output-len", type=int, default=128, help="(default: %(default)s)")
    parser.add_argument("--random-range-ratio", type=float, default=0.0,
                        help="lengths are uniform in [len * (1 - r), len * (1 + r)] (default: %(default)s)")  # fmt: skip
    parser.add_argument("--random-vocab-size", type=int, default=8000,
                        help="random prompt token ids are drawn from [100, this) (default: %(default)s)")  # fmt: skip
    parser.add_argument("--random-images", type=int, default=0,
                        help="chat: random PNG images sent with each prompt, as data: URLs before its text (default: %(default)s)")  # fmt: skip
    parser.add_argument("--random-image-size", default="448x448", metavar="HxW", help="(default: %(default)s)")
    parser.add_argument("--num-prompts", type=int, default=100, help="(default: %(default)s)")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="requests per second, Poisson arrivals; inf sends all at once (default: %(default)s)")  # fmt: skip
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: no limit)")
    parser.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    parser.add_argument("--goodput", nargs="+", default=[], metavar="KEY:MS",
                        help="SLOs a request must meet to count as good: ttft:MS tpot:MS e2el:MS")  # fmt: skip
    parser.add_argument("--structured-output-ratio", type=float, default=0.0,
                        help="share of requests sent under a JSON schema (response_format json_schema) (default: %(default)s)")  # fmt: skip
    parser.add_argument("--structured-output-schema", default=None, metavar="PATH",
                        help="the JSON schema those requests use (default: a small built-in one with bounded fields)")  # fmt: skip
    parser.add_argument("--api-key", default=None,
                        help="sent as 'Authorization: Bearer KEY' (default: $OXSERVE_API_KEY, else $OPENAI_API_KEY, else none)")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per request (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="also print the results as one JSON object on the last line")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    slos = parse_goodput(args.goodput)
    requests = build_requests(args)
    summary = asyncio.run(benchmark(args, requests, slos))
    print(format_table(summary))
    if args.json:
        print(json.dumps(summary))
    return 0 if summary["completed"] else 1


# ---- workload ------------------------------------------------------------------------------
def parse_goodput(items: list[str]) -> dict[str, float]:
    slos = {}
    for item in items:
        key, _, value = item.partition(":")
        if key not in SLO_KEYS or not value:
            raise SystemExit(f"--goodput takes KEY:MS with KEY in {SLO_KEYS}, got {item!r}")
        slos[key] = float(value)
    return slos


def build_requests(args: argparse.Namespace) -> list[BenchRequest]:
    requests = _prompts(args)
    if not 0.0 <= args.structured_output_ratio <= 1.0:
        raise SystemExit(f"--structured-output-ratio must be in [0, 1], got {args.structured_output_ratio}")
    schema = json.loads(Path(args.structured_output_schema).read_text()) if args.structured_output_schema else BENCH_SCHEMA
    # Every k-th request, evenly spread, so constrained and free requests overlap in time.
    constrained = round(args.structured_output_ratio * len(requests))
    for i in range(constrained):
        requests[i * len(requests) // constrained].schema = schema
    if args.random_images:
        if args.endpoint != "chat":
            raise SystemExit("--random-images needs --endpoint chat")
        height, _, width = args.random_image_size.partition("x")
        rng = np.random.default_rng(args.seed)
        for req in requests:
            req.images = [_png_url(rng, int(height), int(width)) for _ in range(args.random_images)]
    return requests


def _png_url(rng, height: int, width: int) -> str:
    """A random picture (smooth, so it compresses as real ones do) as a data: URL."""
    small = rng.integers(0, 256, (max(1, height // 16), max(1, width // 16), 3), dtype=np.uint8)
    image = PIL.Image.fromarray(small).resize((width, height), PIL.Image.Resampling.BILINEAR)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def _prompts(args: argparse.Namespace) -> list[BenchRequest]:
    rng = random.Random(args.seed)
    if args.dataset == "jsonl":
        if not args.dataset_path:
            raise SystemExit("--dataset jsonl needs --dataset-path")
        lines = [json.loads(line) for line in Path(args.dataset_path).read_text().splitlines() if line.strip()]
        if not lines:
            raise SystemExit(f"{args.dataset_path} holds no requests")
        return [BenchRequest(lines[i % len(lines)]["prompt"], int(lines[i % len(lines)]["output_len"])) for i in range(args.num_prompts)]

    def length(base: int) -> int:
        low, high = int(base * (1 - args.random_range_ratio)), int(base * (1 + args.random_range_ratio))
        return max(1, rng.randint(low, high))

    requests = []
    for _ in range(args.num_prompts):
        n = length(args.random_input_len)
        if args.endpoint == "chat":
            prompt: str | list[int] = " ".join(rng.choice(SYLLABLES) + rng.choice(SYLLABLES) for _ in range(n))
        else:
            prompt = [rng.randrange(100, args.random_vocab_size) for _ in range(n)]
        requests.append(BenchRequest(prompt, length(args.random_output_len)))
    return requests


# ---- load generation -----------------------------------------------------------------------
async def benchmark(args: argparse.Namespace, requests: list[BenchRequest], slos: dict[str, float]) -> dict:
    base = args.base_url.rstrip("/")
    limits = httpx.Limits(max_connections=args.max_concurrency or len(requests), max_keepalive_connections=None)
    key = args.api_key or os.environ.get("OXSERVE_API_KEY") or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else None
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits, headers=headers) as client:
        model = args.model or await first_model(client, base)
        url = f"{base}/v1/chat/completions" if args.endpoint == "chat" else f"{base}/v1/completions"
        gate = asyncio.Semaphore(args.max_concurrency or len(requests))
        progress = Progress(len(requests), disabled=args.disable_tqdm)
        rng = random.Random(args.seed + 1)

        async def one(req: BenchRequest) -> RequestResult:
            async with gate:
                result = await send(client, url, args.endpoint, model, req)
            progress.update()
            return result

        spec_before = await metric_counters(client, base, SPEC_COUNTERS)
        masks_before = await metric_counters(client, base, MASK_COUNTERS)
        prefix_before = await metric_counters(client, base, PREFIX_COUNTERS)
        start = time.perf_counter()
        tasks = []
        for req in requests:
            tasks.append(asyncio.create_task(one(req)))
            if math.isfinite(args.request_rate):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        progress.close()
        spec_after = await metric_counters(client, base, SPEC_COUNTERS)
        masks_after = await metric_counters(client, base, MASK_COUNTERS)
        prefix_after = await metric_counters(client, base, PREFIX_COUNTERS)
    summary = summarize(results, duration, slos, args.max_concurrency, model)
    summary["structured_requests"] = sum(r.schema is not None for r in requests)
    if spec_before is not None and spec_after is not None:
        summary["spec_decode"] = spec_decode_summary(spec_before, spec_after)
    if masks_before is not None and masks_after is not None:
        summary["grammar_mask"] = mask_summary(masks_before, masks_after)
    if prefix_before is not None and prefix_after is not None:
        queries, hits = (int(prefix_after[k] - prefix_before[k]) for k in ("queries", "hits"))
        summary["prefix_cache"] = {"queries": queries, "hits": hits, "hit_rate": hits / queries if queries else 0.0}
    return summary


# Counter -> its names in /metrics (oxserve's, and vLLM's where it has one).
SPEC_COUNTERS = {key: (f"oxserve:spec_decode_{key}_total", f"vllm:spec_decode_{key}_total")
                 for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}  # fmt: skip
MASK_COUNTERS = {"seconds": ("oxserve:grammar_mask_seconds_total",), "steps": ("oxserve:grammar_mask_steps_total",)}
PREFIX_COUNTERS = {key: (f"oxserve:prefix_cache_{key}_total", f"vllm:prefix_cache_{key}_total") for key in ("queries", "hits")}


async def metric_counters(client: httpx.AsyncClient, base: str, counters: dict[str, tuple[str, ...]]) -> dict[str, float] | None:
    """The server's values of `counters`, or None where /metrics lacks any of them."""
    try:
        response = await client.get(f"{base}/metrics")
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    names = {name: key for key, aliases in counters.items() for name in aliases}
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name in names:
                values[names[sample.name]] = values.get(names[sample.name], 0.0) + sample.value
    return values if len(values) == len(counters) else None


def spec_decode_summary(before: dict[str, float], after: dict[str, float]) -> dict:
    """Acceptance over the run, from the counters' change (`oxserve.engine.speculative.acceptance`)."""
    return acceptance(*(int(after[key] - before[key]) for key in SPEC_COUNTERS))


def mask_summary(before: dict[str, float], after: dict[str, float]) -> dict:
    """Structured-output mask cost over the run: total, and per step that applied a mask."""
    seconds, steps = after["seconds"] - before["seconds"], int(after["steps"] - before["steps"])
    return {"seconds": seconds, "steps": steps, "ms_per_step": 1000 * seconds / steps if steps else 0.0}


async def first_model(client: httpx.AsyncClient, base: str) -> str:
    response = await client.get(f"{base}/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def send(client: httpx.AsyncClient, url: str, endpoint: str, model: str, req: BenchRequest) -> RequestResult:
    payload: dict = {
        "model": model, "max_tokens": req.output_len, "temperature": 0.0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    if endpoint == "chat" and req.images:
        parts = [{"type": "image_url", "image_url": {"url": url}} for url in req.images]
        payload["messages"] = [{"role": "user", "content": [*parts, {"type": "text", "text": req.prompt}]}]
    elif endpoint == "chat":
        payload["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        payload["prompt"] = req.prompt
    if req.schema is not None:
        payload["response_format"] = {"type": "json_schema", "json_schema": {"name": "bench", "schema": req.schema}}
    result = RequestResult()
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:") or (data := line[5:].strip()) == "[DONE]":
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = chunk["error"].get("message", str(chunk))
                    return result
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices"):  # a chunk per token step, text or not (as vLLM's bench)
                    now = time.perf_counter()
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
        result.latency = time.perf_counter() - start
        result.success = result.output_tokens > 0
        if not result.success:
            result.error = "the stream ended without a usage chunk"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


class Progress:
    """tqdm when it is installed, else a one-line counter on stderr."""

    def __init__(self, total: int, disabled: bool):
        self.total, self.done, self.bar = total, 0, None
        self.disabled = disabled
        if not disabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="req", file=sys.stderr)
            except ImportError:
                pass

    def update(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
        elif not self.disabled:
            print(f"\r{self.done}/{self.total} requests", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif not self.disabled:
            print(file=sys.stderr)


# ---- results -------------------------------------------------------------------------------
def summarize(results: list[RequestResult], duration: float, slos: dict[str, float], concurrency: int | None, model: str) -> dict:
    ok = [r for r in results if r.success]
    output_tokens = sum(r.output_tokens for r in ok)
    input_tokens = sum(r.prompt_tokens for r in ok)
    summary: dict = {
        "model": model,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.success})[:5],
        "max_concurrency": concurrency,
        "duration": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
    }
    if slos:
        summary["request_goodput"] = sum(_meets(r, slos) for r in ok) / duration
    series = {
        "ttft": [r.ttft for r in ok],
        "tpot": [t for r in ok if (t := r.tpot) is not None],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }
    for name, values in series.items():
        ms = [v * 1000 for v in values]
        summary[f"mean_{name}_ms"] = mean(ms) if ms else 0.0
        summary[f"median_{name}_ms"] = median(ms) if ms else 0.0
        summary[f"p99_{name}_ms"] = percentile(ms, 99)
    return summary


def _meets(r: RequestResult, slos: dict[str, float]) -> bool:
    measured = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.latency}
    return all(measured[key] * 1000 <= limit for key, limit in slos.items())


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def format_table(s: dict) -> str:
    rows = [
        ("Successful requests:", s["completed"]),
        ("Failed requests:", s["failed"]),
        ("Maximum request concurrency:", s["max_concurrency"]),
        ("Benchmark duration (s):", f"{s['duration']:.2f}"),
        ("Total input tokens:", s["total_input_tokens"]),
        ("Total generated tokens:", s["total_output_tokens"]),
        ("Request throughput (req/s):", f"{s['request_throughput']:.2f}"),
    ]
    if "request_goodput" in s:
        rows.append(("Request goodput (req/s):", f"{s['request_goodput']:.2f}"))
    rows += [
        ("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}"),
        ("Total token throughput (tok/s):", f"{s['total_token_throughput']:.2f}"),
    ]
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]
    lines += [f"{label:<40}{value!s:<10}" for label, value in rows]
    titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
              "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}  # fmt: skip
    for key, title in titles.items():
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        for stat in ("mean", "median", "p99"):
            lines.append(f"{f'{stat.capitalize()} {key.upper()} (ms):':<40}{s[f'{stat}_{key}_ms']:<10.2f}")
    if spec := s.get("spec_decode"):
        lines.append("{s:{c}^{n}}".format(s="Speculative Decoding", n=50, c="-"))
        lines.append(f"{'Drafts / draft tokens / accepted:':<40}{spec['num_drafts']} / {spec['num_draft_tokens']} / "
                     f"{spec['num_accepted_tokens']}")
        lines.append(f"{'Acceptance rate:':<40}{spec['acceptance_rate']:<10.3f}")
        lines.append(f"{'Mean acceptance length:':<40}{spec['mean_acceptance_length']:<10.2f}")
    if s.get("structured_requests"):
        lines.append("{s:{c}^{n}}".format(s="Structured Outputs", n=50, c="-"))
        lines.append(f"{'Requests under a JSON schema:':<40}{s['structured_requests']}")
        if masks := s.get("grammar_mask"):
            lines.append(f"{'Steps that applied a mask:':<40}{masks['steps']}")
            lines.append(f"{'Mask cost per such step (ms):':<40}{masks['ms_per_step']:<10.3f}")
    if (prefix := s.get("prefix_cache")) and prefix["queries"]:
        lines.append("{s:{c}^{n}}".format(s="Prefix Cache", n=50, c="-"))
        lines.append(f"{'Prompt tokens looked up / hit:':<40}{prefix['queries']} / {prefix['hits']}")
        lines.append(f"{'Token hit rate:':<40}{prefix['hit_rate']:<10.3f}")
    lines.extend(f"error: {e}" for e in s["errors"])
    lines.append("=" * 50)
    return "\n".join(lines)
