"""`oxserve agent run | queue | show | approve | reject | report | ui`: the Infra Agent."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from oxserve.agent.approval import decide
from oxserve.agent.goal import POLICIES, load_goal
from oxserve.agent.journal import Journal
from oxserve.agent.loop import AgentLoop, resumable_run, start_run
from oxserve.agent.report import build_report, plot_runs, render_markdown
from oxserve.feedback.ledger import Ledger, LedgerError, default_ledger_path
from oxserve.feedback.machine import data_dir


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    parser.add_argument("--ledger", type=Path, default=None, help=f"ledger file (default: {default_ledger_path()})")
    if command == "run":
        parser.add_argument("--goal", type=Path, required=True, help="goal file (YAML): objective, limits, space, budget")
        parser.add_argument("--policy", choices=POLICIES, default=None, help="override the goal's policy")
        parser.add_argument("--resume", type=int, default=None, metavar="RUN", help="continue a stopped run")
        parser.add_argument("--seed", type=int, default=0, help="seed of the search policy's sampler")
        parser.add_argument("--workdir", type=Path, default=None, help="where profiles are written (default: data dir)")
        parser.add_argument("--llm-base-url", default=None, help="llm policy: an OpenAI-compatible endpoint, e.g. "
                            "http://127.0.0.1:8000/v1 (`oxserve serve --model GLM-5.3 ...`)")
        parser.add_argument("--llm-model", default=None, help="llm policy: the model name the endpoint serves")
        parser.add_argument("--llm-max-tokens", type=int, default=1024, help="llm policy: tokens per answer")
    elif command in ("show", "approve", "reject"):
        parser.add_argument("id", type=int, help="queued change id (`oxserve agent queue`)")
        if command != "show":
            parser.add_argument("--note", default="", help="why, for the record")
    elif command == "report":
        parser.add_argument("--run", type=int, default=None, help="agent run id (default: the latest)")
        parser.add_argument("--json", action="store_true", help="print JSON")
        parser.add_argument("--plot", type=Path, default=None, help="also write the progress plot (PNG)")
        parser.add_argument("--compare", default=None, help="plot these runs together, e.g. 3,4 (rules vs search)")
    elif command == "ui":
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8700)


def run(args: argparse.Namespace) -> int:
    command = args.command_path[-1]
    try:
        if command == "run":
            return _run(args)
        if command == "ui":
            from oxserve.agent.ui import run_ui

            run_ui(args.ledger or default_ledger_path(), args.host, args.port)
            return 0
        with Ledger(args.ledger) as ledger:
            journal = Journal(ledger)
            if command == "queue":
                print(_queue(journal))
            elif command == "show":
                print(json.dumps(journal.change(args.id).__dict__, indent=1, default=str))
            elif command in ("approve", "reject"):
                change, commit = decide(journal, args.id, "approved" if command == "approve" else "rejected", args.note)
                if commit:
                    print(f"change {change.id}: its patch landed as commit {commit}")
                print(f"change {change.id}: {change.status}"
                      + ("; the run adopts it when it continues (`oxserve agent run --resume "
                         f"{change.run_id} ...`)" if change.status == "approved" else ""))
            else:
                _report(args, journal)
        return 0
    except (LedgerError, ValueError) as e:
        print(f"oxserve agent {command}: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    goal = load_goal(args.goal)
    policy_name = args.policy or goal.policy
    policy = _policy(policy_name, args)
    workdir = args.workdir or data_dir() / "agent"
    with Ledger(args.ledger) as ledger:
        journal = Journal(ledger)
        run_id = (resumable_run(journal, args.resume, goal, policy_name) if args.resume is not None
                  else start_run(journal, goal, policy_name))
        print(f"agent run {run_id}: goal {goal.name}, policy {policy_name}, budget {goal.budget.wall_time_s / 60:.0f} min / "
              f"{goal.budget.experiments} experiments; ledger {ledger.path}", file=sys.stderr)
        loop = AgentLoop(goal, policy, ledger, run_id, workdir, threads=goal.base_options.get("threads"))
        try:
            loop.run()
        except KeyboardInterrupt:
            return 130
        print(render_markdown(build_report(journal, run_id)))
    return 0


def _policy(name: str, args: argparse.Namespace):
    if name == "rules":
        from oxserve.agent.policies.rules import RulesPolicy

        return RulesPolicy()
    if name == "search":
        from oxserve.agent.policies.search import SearchPolicy

        return SearchPolicy(seed=args.seed)
    if not args.llm_base_url or not args.llm_model:
        raise ValueError("the llm policy needs --llm-base-url and --llm-model")
    from oxserve.agent.policies.llm import LLMPolicy

    key = os.environ.get("OXSERVE_AGENT_LLM_API_KEY") or os.environ.get("OPENAI_API_KEY") or "none"
    return LLMPolicy(base_url=args.llm_base_url, model=args.llm_model, api_key=key, max_tokens=args.llm_max_tokens)


def _queue(journal: Journal) -> str:
    lines = [f"{'id':>4}  {'run':>4}  {'status':<9} changes (evidence: experiments, measured ratio)"]
    for c in journal.changes():
        if c.status in ("pending", "approved"):
            changes = ", ".join([f"{k}={v}" for k, v in sorted(c.action["changes"].items())]
                                + ([f"patch ({c.action['rationale'].splitlines()[0][:60]})"] if c.action.get("patch") else []))
            lines.append(f"{c.id:>4}  {c.run_id:>4}  {c.status:<9} {changes} (experiments "
                         f"{c.evidence.get('experiment_ids')}, x{c.evidence.get('ratio') or 0:.3f})")
    return "\n".join(lines)


def _report(args: argparse.Namespace, journal: Journal) -> None:
    runs = journal.runs()
    if not runs:
        raise LedgerError("no agent runs in this ledger")
    run_id = args.run if args.run is not None else runs[-1].id
    report = build_report(journal, run_id)
    print(json.dumps(report, indent=1, default=str) if args.json else render_markdown(report))
    if args.plot:
        ids = [int(x) for x in args.compare.split(",")] if args.compare else [run_id]
        print(f"wrote {plot_runs(journal, ids, args.plot)}", file=sys.stderr)
