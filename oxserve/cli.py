"""The `oxserve` command. Each subcommand lives in its own module exposing
`add_arguments(parser, command)` and `run(args) -> int` (`command` is the last word of the
subcommand; `args.command_path` holds all of it). Engine options come from the config
dataclasses, so `--help` and the code cannot drift apart."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
import typing

from oxserve.config import EngineConfig
from oxserve.options import engine_config, option_names, sections

# command path -> (module, one-line help)
COMMANDS: dict[tuple[str, ...], tuple[str, str]] = {
    ("generate",): ("oxserve.commands.generate", "generate text offline for one or more prompts"),
    ("serve",): ("oxserve.server.cli", "run the OpenAI-compatible HTTP server"),
    ("run-batch",): ("oxserve.commands.run_batch", "answer a Batch API JSONL file offline, in input order"),
    ("bench", "throughput"): ("oxserve.bench.throughput", "offline throughput: oxserve vs HF transformers generate"),
    ("bench", "serve"): ("oxserve.bench.serve", "load-test any OpenAI-compatible endpoint"),
    ("bench", "soak"): ("oxserve.bench.soak", "hours of mixed traffic, client faults and server kills: nothing lost or corrupted"),
    ("bench", "ceilings"): ("oxserve.commands.ceilings", "measure this machine's memory bandwidth and matmul rates"),
    ("bench", "kernels"): ("oxserve.bench.kernels", "check and time every model op at model shapes"),
    ("bench", "parallel"): ("oxserve.bench.parallel", "the parallel layouts' cost model: collectives, predicted vs measured steps"),
    ("profile",): ("oxserve.profiling.cli", "run a workload with telemetry; write trace.json and a report"),
    ("experiment", "run"): ("oxserve.experiment.cli", "controlled A/B experiment between two engine configurations"),
    ("experiment", "list"): ("oxserve.experiment.cli", "list experiments in the ledger"),
    ("experiment", "show"): ("oxserve.experiment.cli", "show one experiment"),
    ("experiment", "plot"): ("oxserve.experiment.cli", "plot a metric across experiments as PNG"),
    ("agent", "run"): ("oxserve.agent.cli", "the Infra Agent: profile, propose, experiment, adopt proven wins, within a goal"),
    ("agent", "queue"): ("oxserve.agent.cli", "changes the agent proved that wait for a person"),
    ("agent", "show"): ("oxserve.agent.cli", "one queued change with its evidence"),
    ("agent", "approve"): ("oxserve.agent.cli", "approve a queued change (the run adopts it when it continues)"),
    ("agent", "reject"): ("oxserve.agent.cli", "reject a queued change"),
    ("agent", "report"): ("oxserve.agent.cli", "an agent run's findings with their evidence, and its progress plot"),
    ("agent", "ui"): ("oxserve.agent.cli", "the agent's web dashboard (local)"),
    ("quantize", "sensitivity"): ("oxserve.commands.quantize", "per-layer quantization sensitivity and a plan within a KL budget"),
    ("build-default-model",): ("oxserve.commands.build_default_model", "write a random-weight model of the default family, or train the default model (--train)"),
}


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    for section, cls in sections().items():
        group = parser.add_argument_group(f"{section} options")
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            meta = dict(f.metadata)
            kind = _base_type(typing.get_type_hints(cls)[f.name])
            if kind is bool:
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=meta.get("help"))
            else:
                group.add_argument(
                    flag, type=kind, default=f.default, choices=meta.get("choices"), help=f"{meta.get('help')} (default: %(default)s)"
                )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return engine_config({name: getattr(args, name) for name in option_names()})


def _base_type(hint) -> type:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The full command tree; only the subcommand named in `argv` imports its module for its options."""
    parser = argparse.ArgumentParser(prog="oxserve", description=__doc__.split("\n")[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    groups: dict[str, argparse._SubParsersAction] = {}
    for path, (module, help_text) in COMMANDS.items():
        if len(path) == 1:
            sub = subparsers.add_parser(path[0], help=help_text, description=help_text)
        else:
            if path[0] not in groups:
                group = subparsers.add_parser(path[0], help=f"{path[0]} commands")
                groups[path[0]] = group.add_subparsers(dest="subcommand", required=True)
            sub = groups[path[0]].add_parser(path[1], help=help_text, description=help_text)
        sub.set_defaults(_module=module, command_path=path)
        if tuple(argv[: len(path)]) == path:  # keeps `--help` and other commands fast
            importlib.import_module(module).add_arguments(sub, path[-1])
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    module = importlib.import_module(args._module)
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
