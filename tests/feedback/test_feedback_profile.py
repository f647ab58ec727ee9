"""`oxserve profile`: a valid, properly nested trace that accounts for the forward time, and a
report that names the biggest gap and states what telemetry costs."""

from __future__ import annotations

import json
import sys
from collections import defaultdict

import pytest

from oxserve.cli import main

EPS_US = 0.01  # timestamps are rounded to ns


WORKLOAD = """
name: profile_test
num_requests: 8
input_len: {uniform: [24, 40]}
output_len: {uniform: [4, 12]}
arrival: {concurrency: 3}
shared_prefix: {length: 20}
sampling: {temperature: 0.0, ignore_eos: true}
"""


@pytest.fixture(scope="module")
def profile_dir(one_thread, tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("profile")
    data = tmp_path_factory.mktemp("data")
    workload = data / "workload.yaml"
    workload.write_text(WORKLOAD)  # closed loop, 3 in flight: decode, prefill and mixed steps
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OXSERVE_DATA_DIR", str(data))  # ceilings cache stays out of the user's data dir
        mp.setattr(sys, "argv", list(sys.argv))  # main() rewrites sys.argv
        code = main(["profile", "--model", str(tiny_model_dir), "--dtype", "float32", "--cache-memory-gib", "0.05",
                     "--workload", str(workload), "--out", str(out), "--ceilings", "quick", "--overhead-repeats", "1",
                     "--threads", "1", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    assert code == 0
    return out


@pytest.fixture(scope="module")
def events(profile_dir):
    return json.loads((profile_dir / "trace.json").read_text())["traceEvents"]


@pytest.fixture(scope="module")
def report(profile_dir):
    return json.loads((profile_dir / "report.json").read_text())


def test_every_event_is_valid_trace_event_format(events):
    assert events
    for e in events:
        for key in ("name", "ph", "ts", "pid", "tid"):
            assert key in e, (key, e)
        assert isinstance(e["ts"], (int, float))
        if e["ph"] == "X":
            assert isinstance(e.get("dur"), (int, float)) and e["dur"] >= 0, e
    assert {e["ph"] for e in events} >= {"X", "M", "C"}


def test_spans_nest_properly(events):
    tracks = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            tracks[(e["pid"], e["tid"])].append(e)
    for spans in tracks.values():
        stack = []
        for e in sorted(spans, key=lambda e: (e["ts"], -e["dur"])):
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"] + EPS_US:
                stack.pop()
            if stack:  # overlaps its predecessor: must lie inside it
                parent = stack[-1]
                assert e["ts"] + e["dur"] <= parent["ts"] + parent["dur"] + EPS_US, (parent["name"], e["name"])
            stack.append(e)


def test_step_forward_layer_op_hierarchy(events):
    x = [e for e in events if e["ph"] == "X"]

    def inside(outer, inner):
        return outer["ts"] - EPS_US <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + EPS_US

    steps = [e for e in x if e["name"] == "step"]
    forwards = [e for e in x if e["name"] == "forward"]
    assert steps and forwards
    assert all(any(inside(s, f) for s in steps) for f in forwards)
    for f in forwards:
        conditions = {"num_requests", "num_decodes", "num_prefills", "num_tokens", "max_context", "mean_context", "phase"}
        assert conditions <= set(f["args"])
    ops = [e for e in x if e.get("cat") == "op"]
    names = {e["name"] for e in ops}
    # The tiny model: KDA layers 0-2, MLA/DSA layer 3; layer 0 dense, the rest MoE.
    for name in ("embed", "L0.kda.recurrent", "L0.mlp.dense", "L1.moe.experts", "L3.mla.attention",
                 "L3.mla.indexer", "L2.hc.collapse", "L2.hc.expand", "final_norm", "lm_head"):
        assert name in names
    layers = [e for e in x if e.get("cat") == "layer"]
    for op in ops:
        if op["name"].startswith("L"):
            layer = op["name"].split(".")[0]
            assert any(e["name"] == layer and inside(e, op) for e in layers), op["name"]


def test_named_ops_cover_at_least_90_percent_of_forward_time(events):
    x = [e for e in events if e["ph"] == "X"]
    ops = [e for e in x if e.get("cat") == "op"]
    forwards = [e for e in x if e["name"] == "forward"]
    covered = sum(o["dur"] for f in forwards for o in ops
                  if f["ts"] <= o["ts"] and o["ts"] + o["dur"] <= f["ts"] + f["dur"] + EPS_US)
    assert covered >= 0.9 * sum(f["dur"] for f in forwards)


def test_report_headline_tables_and_overhead(profile_dir, report):
    md = (profile_dir / "report.md").read_text()
    first = md.splitlines()[2]  # after the title and a blank line
    assert "roofline" in first and "% of step time" in first
    assert report["headline"][0] in first
    assert {p["phase"] for p in report["by_phase"]} == {"decode", "prefill", "mixed"}
    shares = sum(o["share"] for o in report["by_op"])
    assert 0.5 < shares <= 1.0
    recurrent = [c for c in report["by_condition"] if c["op"] == "kda.recurrent"]
    assert recurrent and all(c["us_per_call"] > 0 and c["batch"] and c["context"] for c in recurrent)
    top = report["gaps"][0]
    assert 0 < top["roofline_fraction"] and top["bound"] in ("memory-bandwidth", "compute")
    assert report["totals"]["attributed_fraction"] >= 0.9
    for heading in ("Time by phase", "Time by op type", "Time by layer", "roofline", "Telemetry overhead"):
        assert heading in md


def test_telemetry_off_costs_nothing_measurable_and_on_states_its_cost(report):
    spans = report["overhead"]["spans"]
    # Off: the no-op span path, times the spans a step opens, against a real step.
    assert spans["off_fraction"] < 0.005
    assert spans["span_on_ns"] > spans["span_off_ns"] and spans["on_fraction"] > 0
    e2e = report["overhead"]["end_to_end"]
    assert e2e["off_median_s"] > 0 and e2e["on_median_s"] > 0


def test_report_states_speculative_acceptance(report, profile_dir):
    spec = report["run"]["spec_decode"]
    assert spec["num_accepted_tokens"] <= spec["num_draft_tokens"] and spec["mean_acceptance_length"] >= 1.0
    assert "Speculative decoding:" in (profile_dir / "report.md").read_text()


def test_report_states_prefix_cache_hits(report, profile_dir):
    """Prompts share their first 20 tokens: once one has been computed, others resume there."""
    prefix = report["run"]["prefix_cache"]
    assert 0 < prefix["hits"] <= prefix["queries"] and prefix["hit_requests"] >= 1
    assert prefix["hit_rate"] == prefix["hits"] / prefix["queries"]
    assert "Prefix cache:" in (profile_dir / "report.md").read_text()


def test_replayed_decode_steps_are_profiled_as_served(one_thread, tiny_model_dir, tmp_path):
    """Without speculation decode steps are captured and replayed; their op spans come from the
    replay (each over the recorded calls made inside it), and the report counts the passes."""
    workload = tmp_path / "workload.yaml"
    workload.write_text(WORKLOAD.replace("shared_prefix: {length: 20}\n", "").replace("[4, 12]", "[24, 32]"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OXSERVE_DATA_DIR", str(tmp_path))
        mp.setattr(sys, "argv", list(sys.argv))
        assert main(["profile", "--model", str(tiny_model_dir), "--dtype", "bfloat16", "--cache-memory-gib", "0.05",
                     "--workload", str(workload), "--out", str(tmp_path), "--ceilings", "none", "--overhead-repeats", "1",
                     "--threads", "1"]) == 0  # fmt: skip
    report = json.loads((tmp_path / "report.json").read_text())
    captured = report["run"]["captured_decode"]
    decode_passes = sum(p["steps"] for p in report["by_phase"] if p["phase"] == "decode")
    assert captured["replays"] > captured["captures"] > 0 and captured["eager"] >= 0
    assert captured["replays"] + captured["captures"] + captured["eager"] == decode_passes
    assert "Captured decode steps:" in (tmp_path / "report.md").read_text()
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    decode_ops = [e for e in events if e.get("cat") == "op" and e["name"].endswith(".kda.recurrent")]
    assert len(decode_ops) >= decode_passes  # every pass has its op spans, replayed ones too
