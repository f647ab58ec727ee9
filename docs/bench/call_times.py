"""What each native call of a replayed decode step takes inside the step, timed in C.

`oxserve profile` times a replay's op spans from Python, between runs of calls; this times
every call where the replay makes it (`kernels.call_list` runs them from C through libffi):
a copy of its loop with a clock read around each call, built here with the kernels' compiler.
BATCH greedy requests of --context prompt tokens (576 by default) decode (bf16, 2 threads, the
engine options in --options as JSON); after 30 steady steps the next --steps are timed. Per op span and kernel:
its calls a step and mean microseconds a call, and the step's total.

--hot instead repeats each distinct call 200 times in a row (one `CallRun`), its code, weights
and activations in cache: what the call costs when nothing else ran before it. The in-step
times against these say what the step's sweep of memory costs each call.

    python docs/bench/call_times.py BATCH [--hot] [--steps N] [--context N] [--options '{"quantization": "w8a8"}']

Single runs, not an A/B (the machines here drift +-20%): alternate the builds compared.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import json
import subprocess
import tempfile
import time
from pathlib import Path

from oxserve import LLM, SamplingParams
from oxserve.sampling_params import RequestOutputKind
from oxserve.kernels import native
from oxserve.kernels.call_list import CallRun

TIMED_RUN = r"""
#include <ffi.h>
#include <stdint.h>
#include <time.h>
static uint64_t now_ns(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return (uint64_t)t.tv_sec * 1000000000u + t.tv_nsec; }
int team_begin(void) __attribute__((weak));
void team_end(void) __attribute__((weak));
/* call_list.c's run_calls, each call's nanoseconds added to times[i] (results not checked) */
int64_t run_calls_timed(int64_t n, void **functions, void **cifs, void ***values, const int64_t *expected,
                        const uint8_t *checks, int64_t *got, uint64_t *times) {
    if (team_begin) team_begin();
    for (int64_t i = 0; i < n; i++) {
        ffi_sarg result = 0;
        const uint64_t start = now_ns();
        ffi_call((ffi_cif *)cifs[i], FFI_FN(functions[i]), &result, values[i]);
        times[i] += now_ns() - start;
    }
    if (team_end) team_end();
    return -1;
}
"""


def timed_runner(folder: Path) -> ctypes.CDLL:
    source, library = folder / "timed_run.c", folder / "timed_run.so"
    source.write_text(TIMED_RUN)
    subprocess.run([native.compiler(), "-O2", "-fPIC", "-shared", "-o", str(library), str(source), "-lffi"], check=True)
    return ctypes.CDLL(str(library))


def steady_engine(batch: int, options: dict, context: int = 576, final_only: bool = False) -> LLM:
    """An engine decoding `batch` greedy requests of `context` prompt tokens, 30 steps past
    their prefill; `final_only`: outputs at the end only (as `LLM.generate`), else every step's."""
    llm = LLM(dtype="bfloat16", threads=2, **options)
    engine = llm.engine
    kind = RequestOutputKind.FINAL_ONLY if final_only else RequestOutputKind.CUMULATIVE
    params = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True, output_kind=kind)
    for i in range(batch):
        engine.add_request(f"r{i}", [40 + (i + j) % 4000 for j in range(context)], params)
    while not (engine.last_step.prefill_tokens == 0 and engine.last_step.decode_tokens == batch):
        engine.step()
    for _ in range(30):
        engine.step()
    return llm


def call_names(recording) -> list[str]:
    """Each call's innermost op span (layers folded: 'kda.conv', not 'L3.kda.conv') and kernel."""
    spans = {}
    for s in recording.spans:  # inner spans are recorded before the spans around them
        for c in range(s.first_call, s.end_call):
            spans.setdefault(c, s.name.split(".", 1)[1] if s.name[:1] == "L" and "." in s.name else s.name)
    return [f"{spans.get(i, '-')}:{getattr(f, '__name__', '?')}" for i, (f, _, _) in enumerate(recording.calls)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("batch", type=int)
    parser.add_argument("--hot", action="store_true")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--context", type=int, default=576, help="prompt tokens a request (default: %(default)s)")
    parser.add_argument("--options", default="{}")
    args = parser.parse_args()
    llm = steady_engine(args.batch, json.loads(args.options), args.context)
    # the last replayed recording of plain decodes: this batch's steps (padded to a captured size or not)
    recording = [r for r in llm.engine.runner.captured.recordings.values() if r.decode_shape is not None][-1]
    names, total, count = call_names(recording), collections.Counter(), collections.Counter()
    for name in names:
        count[name] += 1
    if args.hot:
        first = {}
        for name, call in zip(names, recording.calls):
            first.setdefault(name, call)
        for name, call in first.items():
            run = CallRun.build([call] * 200)
            run()
            start = time.perf_counter()
            run()
            total[name] = (time.perf_counter() - start) / 200 * count[name]
        steps, what = 1, "hot, each call repeated 200 times"
    else:
        runs = [function for _, function, _, _ in recording._plan]
        if len(runs) != 1 or not isinstance(runs[0], CallRun):
            raise SystemExit(f"this step replays as {len(runs)} plan steps, not one run of native calls")
        with tempfile.TemporaryDirectory() as folder:
            timed = timed_runner(Path(folder))
            times = (ctypes.c_uint64 * len(recording.calls))()
            plain, replays = CallRun.__call__, [0]

            def timed_call(self) -> None:  # (a run returns None: the replay checks it)
                if self is runs[0]:
                    timed.run_calls_timed(*self._args, times)
                    replays[0] += 1
                else:
                    plain(self)

            CallRun.__call__ = timed_call
            for _ in range(args.steps):
                llm.engine.step()
            CallRun.__call__ = plain
        for name, ns in zip(names, times):
            total[name] += ns / 1e9
        steps = replays[0]  # (fewer than --steps where the context bound grew into another recording)
        what = f"in the step, {steps} steps"
    print(f"batch {args.batch} ({recording.decode_shape[0]} rows), {what}: "
          f"{sum(total.values()) / steps * 1e6:.0f} us of calls a step")
    for name, seconds in total.most_common():
        print(f"  {name:44s} x{count[name]:3d}  {seconds / steps / count[name] * 1e6:8.2f} us a call")
    llm.close()


if __name__ == "__main__":
    main()
