"""`oxserve run-batch -i in.jsonl -o out.jsonl`: a Batch API file answered offline (as vLLM's
run_batch): the same lines, the same serving code, no HTTP. The output holds one line per
input line, in input order, successes and errors alike."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from oxserve.cli import add_engine_arguments, engine_config_from_args
from oxserve.server.async_engine import AsyncEngine
from oxserve.server.batch.lines import answer, parse_lines
from oxserve.server.chat_turn import ChatParsing
from oxserve.server.serving import OpenAIServing


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    parser.add_argument("-i", "--input-file", type=Path, required=True, help="JSONL of requests (OpenAI's batch input format)")
    parser.add_argument("-o", "--output-file", type=Path, required=True, help="where the JSONL of answers goes")
    parser.add_argument("--served-model-name", default=None, help="the model name lines name (default: --model, or 'oxserve-default')")
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    lines, errors = parse_lines(args.input_file.read_bytes(), None)
    if errors:
        for e in errors:
            print(f"{args.input_file}:{e['line'] or '-'}: {e['message']}", file=sys.stderr)
        return 2
    return asyncio.run(_answer_all(args, lines))


async def _answer_all(args: argparse.Namespace, lines) -> int:
    # Every line is queued at once (the engine batches them): room for each one's choices.
    choices = sum(n if isinstance(n := line.body.get("n", 1), int) and n > 0 else 1 for line in lines)
    engine = AsyncEngine(engine_config_from_args(args), max_waiting=max(choices, 1))
    engine.start()
    serving = OpenAIServing(engine, args.served_model_name or args.model or "oxserve-default", ChatParsing())
    start = time.perf_counter()
    try:
        results = await asyncio.gather(*(answer(serving, line) for line in lines))  # the engine batches them
    finally:
        await engine.stop()
    args.output_file.write_text("".join(json.dumps(output) + "\n" for _, output in results))
    failed = sum(1 for status, _ in results if status != 200)
    print(f"{len(lines)} requests in {time.perf_counter() - start:.1f} s, {failed} failed -> {args.output_file}")
    return 0
