"""llguidance (what oxserve runs) against xgrammar on the default model's tokenizer: the
tokenizer set-up, compiling `bench serve`'s JSON schema for 8 matchers, the mask of those 8
per step while each walks a random valid output (24 steps, median), and accepting a token.

xgrammar is not a dependency (its wheel asks for triton and transformers at run time), so it
is put beside the venv for this comparison only:

    .venv/bin/pip install --target /tmp/xgpkgs --no-deps xgrammar==0.2.9 'apache-tvm-ffi>=0.1.11'
    PYTHONPATH=/tmp/xgpkgs .venv/bin/python benchmarks/grammar_engines.py
"""

from __future__ import annotations

import json
import random
import statistics
import time

import torch
import xgrammar as xgr
from transformers import AutoTokenizer

from oxserve.bench.serve import BENCH_SCHEMA
from oxserve.default_model import default_model
from oxserve.structured import StructuredOutputs
from oxserve.structured.grammar import GrammarCompiler
from oxserve.structured.masks import BatchMasks

ROWS, STEPS = 8, 24


def walk(fill, accept, vocab: int) -> float:
    """Median seconds of `fill(bitmask)` per step, each row then taking a random allowed token."""
    rng, times = random.Random(0), []
    bitmask = torch.zeros(ROWS, (vocab + 31) // 32, dtype=torch.int32)
    for _ in range(STEPS):
        started = time.perf_counter()
        fill(bitmask)
        times.append(time.perf_counter() - started)
        allowed = ((bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten(1)[:, :vocab].bool()
        for row in range(ROWS):
            if choices := allowed[row].nonzero().flatten().tolist():
                assert accept(row, rng.choice(choices)), "a token the mask allowed was rejected"
    return statistics.median(times)


def timed(accept, times):
    def run(row, token):
        started = time.perf_counter()
        ok = accept(row, token)
        times.append(time.perf_counter() - started)
        return ok
    return run


def main() -> None:
    model = default_model()
    text = json.loads((model / "config.json").read_text())["text_config"]
    vocab, eos = text["vocab_size"], text["eos_token_id"]  # the model's vocabulary: the mask spans it
    eos = eos[0] if isinstance(eos, list) else eos
    schema = json.dumps(BENCH_SCHEMA)

    started = time.perf_counter()
    compiler = GrammarCompiler((model / "tokenizer.json").read_text(), vocab, eos)
    assert compiler.tokenizer is not None  # built lazily: time it here
    setup = time.perf_counter() - started
    started = time.perf_counter()
    constraint = StructuredOutputs(json=schema)
    matchers = [compiler.matcher(constraint) for _ in range(ROWS)]
    compile_s = time.perf_counter() - started
    executor, accepts = BatchMasks(vocab).executor, []

    def fill(bitmask):
        executor.unsafe_compute_mask_ptr([(m, k) for k, m in enumerate(matchers)], bitmask.data_ptr(), bitmask.shape[1] * 4, ROWS)

    mask = walk(fill, timed(lambda r, t: matchers[r].is_stopped() or matchers[r].consume_token(t), accepts), vocab)
    print(f"llguidance: tokenizer {setup * 1e3:.0f} ms, schema + {ROWS} matchers {compile_s * 1e3:.1f} ms, "
          f"mask per step {mask * 1e3:.3f} ms, accept {statistics.median(accepts) * 1e6:.1f} µs")  # fmt: skip

    started = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(str(model)), vocab_size=vocab)
    xcompiler = xgr.GrammarCompiler(info)
    setup = time.perf_counter() - started
    started = time.perf_counter()
    compiled = xcompiler.compile_json_schema(schema, any_whitespace=False)
    xmatchers = [xgr.GrammarMatcher(compiled) for _ in range(ROWS)]
    compile_s = time.perf_counter() - started
    accepts = []

    def xfill(bitmask):
        for k, m in enumerate(xmatchers):
            if not m.is_terminated():
                m.fill_next_token_bitmask(bitmask, k)

    mask = walk(xfill, timed(lambda r, t: xmatchers[r].is_terminated() or xmatchers[r].accept_token(t), accepts), vocab)
    print(f"xgrammar:   tokenizer {setup * 1e3:.0f} ms, schema + {ROWS} matchers {compile_s * 1e3:.1f} ms, "
          f"mask per step {mask * 1e3:.3f} ms, accept {statistics.median(accepts) * 1e6:.1f} µs")  # fmt: skip


if __name__ == "__main__":
    main()
