"""`oxserve bench soak`: hours of mixed traffic, client faults and server kills; at the end,
every request must have had exactly one outcome and none may be lost or corrupted.

It starts `oxserve serve` itself (so that it can kill it), answers a pool of greedy requests
once alone for reference, then for `--duration` seconds sends Poisson arrivals of plain
requests, streams, streams it leaves after a few tokens and requests it gives up on, plus a
batch job now and then; at random times it SIGKILLs or SIGTERMs the server and starts it
again on the same port and batch store. At the end it waits for every batch job, and checks:

- no request lost (hung, or cut short while the server was up), none corrupted (an answer
  that parts from its reference where the reference was not a near tie), no error without
  OpenAI's error body, no 500 or stream error event; requests a restart cut off (a dropped
  connection, an abort at the drain's timeout) are counted apart;
- every batch job completed with each line answered exactly once, each answer judged as above;
- the engine idle with its cache free (`/metrics`), and the resident memory of the last
  server's life grown by at most `--max-rss-growth-mib`.

Exit status 1 if any check fails. `--json` prints the summary as one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import random
import shlex
import signal
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from oxserve.bench.serve import percentile
from oxserve.bench.soak_server import SoakServer
from oxserve.bench.soak_traffic import (
    ABORTED,
    CUT,
    FAILURES,
    KINDS,
    LOST,
    OK,
    SERVER_ERROR,
    Outcome,
    judge,
    make_pool,
    plain,
    reference_of,
    stream,
)

KIND_WEIGHTS = (0.4, 0.4, 0.1, 0.1)  # plain, stream, leave, give_up


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    parser.add_argument("--duration", type=float, default=3600.0, help="seconds of traffic (default: %(default)s)")
    parser.add_argument("--request-rate", type=float, default=1.0, help="mean arrivals per second, Poisson (default: %(default)s)")
    parser.add_argument("--kills", type=int, default=2, help="SIGKILL-and-restarts, at random times (default: %(default)s)")
    parser.add_argument("--terms", type=int, default=2, help="SIGTERM (drain)-and-restarts, at random times (default: %(default)s)")
    parser.add_argument("--batch-every", type=float, default=60.0, help="mean seconds between batch jobs (default: %(default)s)")
    parser.add_argument("--pool-size", type=int, default=12, help="distinct greedy requests (default: %(default)s)")
    parser.add_argument("--max-prompt-len", type=int, default=48, help="(default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=24, help="largest max_tokens in the pool (default: %(default)s)")
    parser.add_argument("--max-token-id", type=int, default=1000, help="prompts draw token ids below it (default: %(default)s)")
    parser.add_argument("--tie-margin", type=float, default=0.02,
                        help="a reference's top-2 logprob gap below which a different pick is no corruption (default: %(default)s)")  # fmt: skip
    parser.add_argument("--max-rss-growth-mib", type=float, default=512.0,
                        help="largest growth of the server's RSS over a life (default: %(default)s)")  # fmt: skip
    parser.add_argument("--server-args", default="", help="arguments for `oxserve serve`, one string (e.g. \"--model M --dtype float32\")")
    parser.add_argument("--workdir", type=Path, default=None, help="where the batch store and server logs go (default: a temp dir)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")


def run(args: argparse.Namespace) -> int:
    if args.duration <= 0 or args.request_rate <= 0 or min(args.kills, args.terms) < 0:
        raise SystemExit("--duration and --request-rate must be > 0, --kills and --terms >= 0")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="oxserve-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    server = SoakServer(shlex.split(args.server_args), workdir)
    server.start()
    try:
        summary = asyncio.run(soak(args, server, random.Random(args.seed)))
    finally:
        server.stop()
    summary["workdir"] = str(workdir)
    print(json.dumps(summary) if args.json else format_summary(summary))
    return 0 if summary["passed"] else 1


async def soak(args: argparse.Namespace, server: SoakServer, rng: random.Random) -> dict:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits) as client:
        model = (await client.get(f"{server.base_url}/v1/models")).json()["data"][0]["id"]
        pool = make_pool(rng, args.pool_size, args.max_token_id, args.max_prompt_len, args.max_tokens)
        refs = []
        for req in pool:  # alone, one at a time: the reference
            r = await client.post(f"{server.base_url}/v1/completions", json=req.body(model), timeout=600)
            r.raise_for_status()
            refs.append(reference_of(r.json()["choices"][0]))
        restarts: list[float] = []  # when each restart began
        start = time.monotonic()
        end = start + args.duration
        faults = sorted([(rng.uniform(0.15, 0.85) * args.duration, signal.SIGKILL) for _ in range(args.kills)]
                        + [(rng.uniform(0.15, 0.85) * args.duration, signal.SIGTERM) for _ in range(args.terms)])  # fmt: skip
        killer = asyncio.ensure_future(_kill_at(server, faults, start, restarts, args))
        sampler = asyncio.ensure_future(_sample_memory(client, server))
        batches: list[tuple[str, list[int]]] = []
        tasks: list[asyncio.Task] = []
        next_batch = start + rng.expovariate(1 / args.batch_every)
        while (now := time.monotonic()) < end:
            if now >= next_batch:
                tasks.append(asyncio.ensure_future(_submit_batch(server, model, pool, rng, batches, restarts)))
                next_batch = now + rng.expovariate(1 / args.batch_every)
            i = rng.randrange(len(pool))
            kind = rng.choices(KINDS, KIND_WEIGHTS)[0]
            tasks.append(asyncio.ensure_future(_one(client, server, model, pool[i], refs[i], kind, args.tie_margin, rng, restarts)))
            await asyncio.sleep(min(rng.expovariate(args.request_rate), max(0.0, end - time.monotonic())))
        await killer
        results = await asyncio.gather(*tasks)
        sampler.cancel()
        outcomes = [o for o in results if isinstance(o, Outcome)]
        batch_report = await _check_batches(server, batches, pool, refs, args.tie_margin)
        idle = await _wait_idle(client, server.base_url)
        heap_end = _heap_mib(_scalars((await client.get(f"{server.base_url}/metrics")).text))  # idle: no step's activations
    server.lives[-1].rss_end_mib = server.rss_mib()
    return summarize(args, outcomes, batch_report, idle, server, time.monotonic() - start, heap_end)


async def _one(client, server: SoakServer, model, req, ref, kind, tie, rng, restarts) -> Outcome:
    sent = time.monotonic()
    try:
        if kind == "plain":
            outcome = await plain(client, server.base_url, model, req, ref, tie)
        elif kind == "give_up":
            outcome = await plain(client, server.base_url, model, req, ref, tie, give_up_after=rng.uniform(0.05, 1.0))
        else:
            outcome = await stream(client, server.base_url, model, req, ref, tie, rng.randrange(1, 4) if kind == "leave" else None)
    except httpx.TransportError as e:
        outcome = Outcome(kind, LOST, None, f"{type(e).__name__}: {e}"[:120])
    # A dropped connection, an abort or a server error is expected only around a restart.
    if outcome.result in (LOST, ABORTED, SERVER_ERROR) and (server.down_since is not None or any(t >= sent for t in restarts)):
        outcome.result = CUT
    return outcome


async def _sample_memory(client: httpx.AsyncClient, server: SoakServer, every_s: float = 5.0) -> None:
    """RSS from /proc and the heap split from /metrics, every `every_s` seconds."""
    while True:
        await asyncio.sleep(every_s)
        try:
            server.sample()
        except (OSError, StopIteration):  # the process is going away between the check and the read
            pass
        try:
            server.record_heap(_scalars((await client.get(f"{server.base_url}/metrics", timeout=5)).text))
        except (httpx.HTTPError, ValueError):  # restarting, or too slow to answer: a gap in the trend
            pass


def _scalars(text: str) -> dict[str, float]:
    """A /metrics page's samples that carry no labels, by name."""
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


async def _kill_at(server: SoakServer, faults, start: float, restarts: list[float], args) -> None:
    for at, sig in faults:
        await asyncio.sleep(max(0.0, start + at - time.monotonic()))
        restarts.append(time.monotonic())
        code = await asyncio.to_thread(server.restart, sig, 30.0)
        if sig == signal.SIGTERM and code != 0:
            raise RuntimeError(f"the server exited with {code} after SIGTERM (a drain ends with 0)")


async def _submit_batch(server: SoakServer, model, pool, rng, batches, restarts) -> None:
    lines = [rng.randrange(len(pool)) for _ in range(rng.randrange(3, 9))]
    content = "".join(json.dumps({"custom_id": f"line-{k}", "method": "POST", "url": "/v1/completions",
                                  "body": pool[i].body(model)}) + "\n" for k, i in enumerate(lines))  # fmt: skip
    for _ in range(60):  # the server may be restarting: the job is created once it is back
        try:
            client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
            file = await client.files.create(file=("soak.jsonl", io.BytesIO(content.encode())), purpose="batch")
            batch = await client.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h")
            batches.append((batch.id, lines))
            return
        except (openai.APIConnectionError, openai.InternalServerError):
            await asyncio.sleep(1.0)
    batches.append((None, lines))  # never created: a failure of the soak


async def _check_batches(server: SoakServer, batches, pool, refs, tie) -> dict:
    client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=3)
    report = Counter(jobs=len(batches))
    for batch_id, lines in batches:
        if batch_id is None:
            report["uncreated_jobs"] += 1
            continue
        deadline = time.monotonic() + 600
        while (batch := await client.batches.retrieve(batch_id)).status not in ("completed", "failed", "cancelled"):
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        if batch.status != "completed":
            report["unfinished_jobs"] += 1
            continue
        output = [] if batch.output_file_id is None else \
            [json.loads(x) for x in (await client.files.content(batch.output_file_id)).text.splitlines()]  # fmt: skip
        report["failed_lines"] += batch.request_counts.failed
        ids = Counter(x["custom_id"] for x in output)
        report["lines"] += len(lines)
        report["missing_lines"] += sum(1 for k in range(len(lines)) if ids[f"line-{k}"] == 0)
        report["duplicated_lines"] += sum(n - 1 for n in ids.values() if n > 1)
        for x in output:
            i = lines[int(x["custom_id"].split("-")[1])]
            result, _ = judge(x["response"]["body"]["choices"][0]["logprobs"]["tokens"], refs[i], tie)
            report["corrupted_lines"] += result != OK
    return dict(report)


async def _wait_idle(client: httpx.AsyncClient, url: str, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = _scalars((await client.get(f"{url}/metrics")).text)
        idle = {k: m[f"oxserve:{k}"] for k in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")}
        if not any(idle.values()) or time.monotonic() > deadline:
            return idle
        await asyncio.sleep(0.5)


def summarize(args, outcomes: list[Outcome], batches: dict, idle: dict, server: SoakServer, seconds: float,
              heap_end: dict | None = None) -> dict:  # fmt: skip
    results = Counter(o.result for o in outcomes)
    by_kind = {k: dict(Counter(o.result for o in outcomes if o.kind == k)) for k in KINDS}
    plain_latency = [o.latency_s for o in outcomes if o.kind == "plain" and o.result == OK]
    ttft = [o.latency_s for o in outcomes if o.kind == "stream" and o.result == OK and o.latency_s is not None]
    growth = max(life.growth_mib for life in server.lives)
    failures = {r: results[r] for r in FAILURES if results[r]}
    bad = ("uncreated_jobs", "unfinished_jobs", "missing_lines", "duplicated_lines", "corrupted_lines", "failed_lines")
    batch_failures = {k: v for k, v in batches.items() if k in bad and v}
    checks = {
        "no request lost or corrupted": not failures,
        "every batch line answered once, none failed or corrupted": not batch_failures,
        "engine idle, cache free": not any(idle.values()),
        f"RSS growth <= {args.max_rss_growth_mib:g} MiB": growth <= args.max_rss_growth_mib,
    }
    examples = [f"{o.kind}: {o.result}: {o.detail}" for o in outcomes if o.result in FAILURES][:5]
    return {
        "seconds": round(seconds, 1), "requests": len(outcomes), "results": dict(results), "by_kind": by_kind,
        "restarts": {"SIGKILL": sum(1 for life in server.lives if life.ended_by == "SIGKILL"),
                     "SIGTERM": sum(1 for life in server.lives if life.ended_by == "SIGTERM")},
        "batches": batches, "idle": idle,
        "latency_p50_s": round(percentile(plain_latency, 50), 3) if plain_latency else None,
        "latency_p99_s": round(percentile(plain_latency, 99), 3) if plain_latency else None,
        "ttft_p99_s": round(percentile(ttft, 99), 3) if ttft else None,
        "rss_mib": [(round(life.rss_start_mib), round(life.rss_end_mib)) for life in server.lives],
        # A leak climbs to the end; an allocator's high-water mark levels off.
        "rss_trend_mib": [_quartiles([rss for _, rss in life.samples]) for life in server.lives],
        # The heap at the same points: a leak climbs in use; allocator retention climbs in free-held.
        "heap_in_use_trend_mib": [_quartiles([x[1] for x in life.heap]) for life in server.lives],
        "heap_free_held_trend_mib": [_quartiles([x[2] for x in life.heap]) for life in server.lives],
        "heap_arenas_trend": [_quartiles([x[3] for x in life.heap]) for life in server.lives],
        "heap_end_mib": heap_end,
        "rss_growth_mib": round(growth, 1), "checks": checks, "failures": examples, "passed": all(checks.values()),
    }  # fmt: skip


def _heap_mib(metrics: dict[str, float]) -> dict | None:
    """The heap split of a /metrics scrape, MiB (None: the server does not export it)."""
    if "oxserve:heap_in_use_bytes" not in metrics:
        return None
    return {"in_use": round(metrics["oxserve:heap_in_use_bytes"] / 2**20),
            "free_held": round(metrics["oxserve:heap_free_held_bytes"] / 2**20), "arenas": int(metrics["oxserve:heap_arenas"])}  # fmt: skip


def _quartiles(values: list[float]) -> list[int]:
    """Values at 0, 25, 50, 75 and 100% of the way through (empty: none)."""
    if not values:
        return []
    return [round(values[min(len(values) - 1, int(q * (len(values) - 1)))]) for q in (0, 0.25, 0.5, 0.75, 1)]


def format_summary(s: dict) -> str:
    lines = [f"soak: {s['seconds']} s, {s['requests']} requests, restarts {s['restarts']}",
             f"outcomes: {s['results']}", *(f"  {k}: {v}" for k, v in s["by_kind"].items()),
             f"batches: {s['batches']}",
             f"plain latency p50 {s['latency_p50_s']} s, p99 {s['latency_p99_s']} s; stream TTFT p99 {s['ttft_p99_s']} s", f"RSS (start, end) MiB per life: {s['rss_mib']}; largest growth once warm {s['rss_growth_mib']} MiB",
             f"RSS through each life (0/25/50/75/100%): {s['rss_trend_mib']}",
             f"  heap in use: {s['heap_in_use_trend_mib']}; free bytes malloc holds: {s['heap_free_held_trend_mib']}; "
             f"arenas: {s['heap_arenas_trend']}; heap at the end, idle: {s['heap_end_mib']}",
             f"idle at the end: {s['idle']}", *(f"[{'pass' if ok else 'FAIL'}] {name}" for name, ok in s["checks"].items()),
             *(f"  e.g. {x}" for x in s["failures"]), f"workdir: {s.get('workdir')}"]  # fmt: skip
    return "\n".join(lines)

