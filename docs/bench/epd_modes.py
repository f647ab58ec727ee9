"""Colocated vs split vs the router's own choice, on one prefill and one decode instance of
this machine (one thread each), under `oxserve bench serve`.

    python docs/bench/epd_modes.py --workload images|text [--reps 2] [--request-rate 1.0] [--out FILE.json]

The instances start once; for each repetition the three router modes run in a shuffled order,
each behind a fresh router (`oxserve serve --role router --disaggregate MODE`); within a
repetition the modes get the same prompts and arrival times (one --seed; the instances run
without prefix caching, so nothing is reused across runs). Prints, per run and as medians per
mode: the share of requests meeting the SLO (TTFT <= 3 s, TPOT <= 100 ms), P99 TTFT, P99 ITL
and median TPOT.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

from oxserve.bench.soak_server import wait_until_serving

WORKLOADS = {
    # Two 448x448 images (2 x 256 placeholder tokens) and ~100 words per chat, 64 tokens out.
    "images": ["--endpoint", "chat", "--random-images", "2", "--random-image-size", "448x448", "--random-input-len", "100",
               "--random-output-len", "64", "--num-prompts", "40"],
    # Text only: 1,024-token prompts, 64 tokens out.
    "text": ["--endpoint", "completions", "--random-input-len", "1024", "--random-output-len", "64", "--num-prompts", "40"],
}  # fmt: skip
SLO = ["ttft:3000", "tpot:100"]
MODES = ("never", "always", "auto")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], url: str, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        wait_until_serving(proc, url, timeout=300)
    except RuntimeError as e:
        raise SystemExit(f"{url}: {e}; see {log}") from None
    return proc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), required=True)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--request-rate", type=float, default=1.0, help="Poisson arrivals, requests/s (default 1)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="epd-bench-"))
    serve = [sys.executable, "-m", "oxserve.cli", "serve", "--dtype", args.dtype, "--threads", "1", "--no-enable-prefix-caching",
             "--max-model-len", "4096", "--host", "127.0.0.1"]  # fmt: skip
    p_port, d_port, kv_port = free_port(), free_port(), free_port()
    instances = [
        start([*serve, "--role", "prefill", "--port", str(p_port), "--batch-store", str(logs / "prefill.sqlite")],
              f"http://127.0.0.1:{p_port}", logs / "prefill.log"),
        start([*serve, "--role", "decode", "--port", str(d_port), "--kv-port", str(kv_port), "--batch-store",
               str(logs / "decode.sqlite")], f"http://127.0.0.1:{d_port}", logs / "decode.log"),
    ]  # fmt: skip
    runs = []
    try:
        for rep in range(args.reps):
            for mode in random.Random(rep).sample(MODES, len(MODES)):
                r_port = free_port()
                router = start([sys.executable, "-m", "oxserve.cli", "serve", "--role", "router", "--port", str(r_port),
                                "--host", "127.0.0.1", "--disaggregate", mode, "--prefill", f"http://127.0.0.1:{p_port}",
                                "--decode", f"http://127.0.0.1:{d_port},127.0.0.1:{kv_port}"],
                               f"http://127.0.0.1:{r_port}", logs / f"router-{mode}-{rep}.log")  # fmt: skip
                try:
                    seed = 1000 * rep
                    bench = subprocess.run(
                        [sys.executable, "-m", "oxserve.cli", "bench", "serve", "--base-url", f"http://127.0.0.1:{r_port}",
                         *WORKLOADS[args.workload], "--request-rate", str(args.request_rate), "--seed", str(seed), "--goodput", *SLO, "--json", "--disable-tqdm"],
                        capture_output=True, text=True, check=True)  # fmt: skip
                    result = json.loads(bench.stdout.strip().splitlines()[-1])
                    stats = httpx.get(f"http://127.0.0.1:{r_port}/router/stats").json()
                finally:
                    router.terminate()
                    router.wait()
                good = round(result["request_goodput"] * result["duration"]) / (result["completed"] + result["failed"])
                runs.append({"mode": mode, "rep": rep, "split": stats["split"], "colocated": stats["colocated"], "slo_met": good, **result})
                print(f"{mode:7s} rep {rep}: SLO met {good:.0%}, goodput {result['request_goodput']:.3f} req/s, p99 TTFT {result['p99_ttft_ms']:.0f} ms, "
                      f"p99 ITL {result['p99_itl_ms']:.0f} ms, median TPOT {result['median_tpot_ms']:.1f} ms, "
                      f"split {stats['split']}/{stats['split'] + stats['colocated']}", flush=True)  # fmt: skip
    finally:
        for proc in instances:
            proc.terminate()
            proc.wait()
    print("\n| mode | SLO met (TTFT <= 3 s, TPOT <= 100 ms) | P99 TTFT (ms) | P99 ITL (ms) | median TPOT (ms) | split |")
    print("| --- | --- | --- | --- | --- | --- |")
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode]
        med = {k: statistics.median(r[k] for r in mine) for k in ("slo_met", "p99_ttft_ms", "p99_itl_ms", "median_tpot_ms")}
        split = sum(r["split"] for r in mine) / max(1, sum(r["split"] + r["colocated"] for r in mine))
        print(f"| {mode} | {med['slo_met']:.0%} | {med['p99_ttft_ms']:.0f} | {med['p99_itl_ms']:.0f} | "
              f"{med['median_tpot_ms']:.1f} | {split:.0%} |")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps({"workload": args.workload, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
