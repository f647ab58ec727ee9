"""`oxserve generate`: offline generation for prompts given on the command line."""

from __future__ import annotations

import argparse
import json
import time

from oxserve.cli import add_engine_arguments, engine_config_from_args
from oxserve.engine.engine import LLMEngine
from oxserve.llm import run_to_completion
from oxserve.sampling_params import SamplingParams


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for several)")
    parser.add_argument("--prompt-token-ids", action="append", default=[], help="a prompt as comma-separated token ids")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt (default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: %(default)s)")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens, 0 = off (default: %(default)s)")
    parser.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability")
    parser.add_argument("--request-seed", type=int, default=None, help="sampling seed for every prompt")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeat for several)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    parser.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    engine = LLMEngine(engine_config_from_args(args))
    prompts: list = list(args.prompt)
    prompts += [[int(t) for t in ids.split(",") if t.strip()] for ids in args.prompt_token_ids]
    if not prompts:
        prompts = ["Hello"]
    if args.chat:
        if engine.tokenizer is None:
            raise SystemExit("--chat needs a checkpoint with a tokenizer")
        prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) if isinstance(p, str) else p for p in prompts]
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        seed=args.request_seed, stop=args.stop, ignore_eos=args.ignore_eos,
    )
    ids = [engine.add_request(f"cli-{i}", p, params) for i, p in enumerate(prompts)]
    start = time.perf_counter()
    done = run_to_completion(engine, set(ids))
    elapsed = time.perf_counter() - start
    for rid, prompt in zip(ids, prompts):
        out = done[rid].outputs[0]
        if args.json:
            print(json.dumps({"prompt": prompt, "text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason}))
        else:
            print(f"--- prompt: {prompt!r}\n{out.text!r}\n    ({len(out.token_ids)} tokens, finish_reason={out.finish_reason})")
    total = sum(len(d.outputs[0].token_ids) for d in done.values())
    print(f"[oxserve] model {engine.model_path}: {total} tokens in {elapsed:.2f}s ({total / elapsed:.1f} tok/s)")
    return 0
