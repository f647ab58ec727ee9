"""The agent's dashboard (`oxserve agent ui`) served by uvicorn and driven in a real headless
Chromium over a real ledger: the run page's chart, experiments and profiles, approving a
queued change, a stale decision refused, and untrusted text shown, never executed.

Chromium is Debian's (`make install` installs it): Playwright's own browser download is not
reachable from these machines. A missing browser fails the test; it is never skipped.
"""

from __future__ import annotations

import re
import shutil
import socket
import threading
import time

import pytest
import uvicorn
from playwright.sync_api import Page, expect, sync_playwright

from oxserve.agent.journal import Journal
from oxserve.agent.ui import create_app
from oxserve.feedback.ledger import Ledger
from oxserve.feedback.stats import B_FASTER, NO_DIFFERENCE, compare
from oxserve.feedback.workload import load_workload

METRIC = "output_tokens_per_s"
SCRIPT = "<script>window.__pwned = true</script>"  # in reasoning, a rationale and the goal's name
START = {"max_num_seqs": 1, "dtype": "float32"}
HEADLINES = (["decode takes 91% of step time", "attention runs at 12% of its roofline at batch 1"],
             ["decode takes 64% of step time", "matmul runs at 35% of its roofline in float32"])


def _experiment(ledger: Ledger, a: dict, b: dict, a_vals: list[float], b_vals: list[float], quality: dict):
    eid = ledger.start_experiment(a, b, load_workload("smoke"), description="ui test",
                                  environment={"hostname": "test-host"})
    for i, (va, vb) in enumerate(zip(a_vals, b_vals)):
        ledger.add_sample(eid, 2 * i, "A", {METRIC: va}, 1.0)
        ledger.add_sample(eid, 2 * i + 1, "B", {METRIC: vb}, 1.0)
    c = compare(a_vals, b_vals)
    ledger.finish_experiment(eid, c.verdict, {**c.to_dict(), "metric": METRIC}, quality)
    return ledger.get(eid)


def _action(changes: dict, rationale: str, predicted: float) -> dict:
    return {"changes": changes, "rationale": rationale, "predicted_ratio": predicted, "origin": "rule", "evidence": {}}


def _outcome(action: dict, base: dict, rec, accepted: bool, reasons: list[str]) -> dict:
    return {"action": action, "base": base, "accepted": accepted, "reasons": reasons, "experiment_ids": [rec.id],
            "ratio": rec.stats["median_ratio"], "median_b": rec.stats["median_b"], "quality_failed": False}


def _measured(rec, action: dict) -> dict:
    s = rec.stats
    return {"ratio": s["median_ratio"], "ci": [s["ci_low"], s["ci_high"]], "p_value": s["p_value"],
            "median_b": s["median_b"], "predicted_ratio": action["predicted_ratio"], "verdict": rec.verdict,
            "quality_passed": rec.quality["passed"]}


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    """A run as the loop writes it: profile, propose, experiment, accept; profile again,
    propose, experiment, reject. Plus one pending and one rejected change."""
    path = tmp_path_factory.mktemp("ui") / "ledger.sqlite"
    with Ledger(path) as ledger:
        j = Journal(ledger)
        goal = {"name": f"from-naive {SCRIPT}", "objective": {"metric": METRIC}, "budget": {"experiments": 10}}
        run = j.start_run("rules", goal, START)
        for i, (headlines, batched) in enumerate(zip(HEADLINES, (1, 8))):
            gaps = [{"phase": "decode", "batch": batched, "op": "attention" if i == 0 else "matmul",
                     "roofline_fraction": 0.12, "share_of_steps": 0.4}]
            j.add_step(run, "profile", headlines[0], {"headline": headlines, "gaps": gaps, "phase_share": {},
                                                        "op_share": {}, "report_dir": f"/tmp/profile{i}"})
            if i == 0:
                base, action = dict(START), _action({"max_num_seqs": 8}, f"batch more requests {SCRIPT}", 1.8)
                rec = _experiment(ledger, base, {**base, "max_num_seqs": 8}, [100.0, 102.0, 98.0, 101.0],
                                  [180.0, 185.0, 178.0, 183.0], {"passed": True, "max_divergence": 0.01, "bound": 0.05})
                assert rec.verdict == B_FASTER
            else:
                base, action = {**START, "max_num_seqs": 8}, _action({"dtype": "bfloat16"}, "halve the bytes", 1.3)
                rec = _experiment(ledger, base, {**base, "dtype": "bfloat16"}, [181.0, 184.0, 179.0, 182.0],
                                  [182.0, 183.0, 181.0, 180.0],
                                  {"passed": False, "max_divergence": 0.31, "bound": 0.05})
                assert rec.verdict == NO_DIFFERENCE
            j.add_step(run, "propose", action["rationale"], {"predicted_ratio": action["predicted_ratio"]},
                       action=action)
            j.add_step(run, "experiment", f"reasoning {SCRIPT}", _measured(rec, action), action=action,
                       experiment_id=rec.id, seconds=30.0)
            if i == 0:
                incumbent = {**base, **action["changes"]}
                j.add_step(run, "accept", "accepted", {**_outcome(action, base, rec, True, []), "incumbent": incumbent,
                                                       "incumbent_rate": rec.stats["median_b"]}, action=action)
                j.set_incumbent(run, incumbent)
                accepted = rec
            else:
                reasons = ["no difference: CI includes 1", "quality gate failed: max divergence 0.31 nats (bound 0.05)"]
                j.add_step(run, "reject", "; ".join(reasons), _outcome(action, base, rec, False, reasons),
                           action=action)
                rejected = rec
        fp8 = _action({"kv_cache_dtype": "fp8"}, f"quantize the cache {SCRIPT}", 1.2)
        pending = j.queue_change(run, {**START, "max_num_seqs": 8}, fp8, _outcome(fp8, {}, accepted, True, []))
        stale = j.queue_change(run, dict(START), fp8, _outcome(fp8, {}, accepted, True, []))
        other = j.queue_change(run, dict(START), fp8, _outcome(fp8, {}, accepted, True, []))
        j.decide(other, "rejected", "not now")
    return {"path": path, "run": run, "accepted": accepted, "rejected": rejected, "pending": pending,
            "stale": stale, "rejected_change": other}


@pytest.fixture(scope="module")
def base_url(world) -> str:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # a free port, held from now on: no race with other tests
    server = uvicorn.Server(uvicorn.Config(create_app(world["path"]), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the dashboard's server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(10)
    sock.close()


@pytest.fixture(scope="module")
def browser():
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.fail("chromium is not installed: `make install` installs it (apt-get install -y chromium); "
                    "this test needs a real browser and is never skipped")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium, headless=True)
        yield b
        b.close()


@pytest.fixture
def page(browser, base_url) -> Page:
    context = browser.new_context(base_url=base_url)
    page = context.new_page()
    page.set_default_timeout(5000)
    yield page
    context.close()


def _assert_not_executed(page: Page) -> None:
    assert page.evaluate("window.__pwned") is None, "a <script> from the ledger ran in the page"


def test_index_lists_runs_and_the_pending_queue(page, world):
    page.goto("/")
    row = page.locator("table").first.locator("tr").nth(1)
    expect(row).to_contain_text("rules")
    expect(row).to_contain_text(f"from-naive {SCRIPT}")  # the goal's name, as text
    expect(row).to_contain_text(f"{world['accepted'].stats['median_b']:.4g}")  # the incumbent's rate
    queue = page.locator("table").nth(1)
    expect(queue.locator(f'a[href="/changes/{world["pending"]}"]')).to_have_count(1)
    expect(queue.locator(f'a[href="/changes/{world["rejected_change"]}"]')).to_have_count(0)
    _assert_not_executed(page)


def test_run_page_chart_experiments_and_profiles(page, world):
    page.goto(f"/runs/{world['run']}")
    chart = page.locator("svg.progress")
    expect(chart).to_have_count(1)
    expect(chart.locator("circle.start")).to_have_count(1)  # the first experiment's A median
    expect(chart.locator("circle.incumbent")).to_have_count(1)  # one accept step
    expect(chart.locator("circle.experiment")).to_have_count(2)  # each experiment's B median
    start_y = float(chart.locator("circle.start").get_attribute("cy"))
    assert float(chart.locator("circle.incumbent").get_attribute("cy")) < start_y  # faster is higher

    rows = page.locator("table.experiments tr")
    expect(rows).to_have_count(3)
    for row, rec in ((rows.nth(1), world["accepted"]), (rows.nth(2), world["rejected"])):
        s = rec.stats
        expect(row).to_contain_text(f"{s['median_ratio']:.3f} [{s['ci_low']:.3f}, {s['ci_high']:.3f}]")
        expect(row.locator(".p")).to_have_text(f"{s['p_value']:.3g}")
    expect(rows.nth(1)).to_contain_text("1.800")  # predicted
    expect(rows.nth(1)).to_contain_text("pass")
    expect(rows.nth(1)).to_contain_text("accepted")
    expect(rows.nth(2)).to_contain_text("0.31 / 0.05 FAIL")
    expect(rows.nth(2)).to_contain_text("quality gate failed: max divergence 0.31 nats")

    hyps = page.locator("section.hyp")
    expect(hyps).to_have_count(2)
    expect(hyps.nth(0)).to_contain_text(HEADLINES[0][1])  # each proposal with the profile before it
    expect(hyps.nth(1)).to_contain_text(HEADLINES[1][1])
    expect(hyps.nth(1)).not_to_contain_text(HEADLINES[0][1])
    expect(hyps.nth(0).locator("pre.optdiff")).to_have_text("max_num_seqs: 1 -> 8")
    expect(hyps.nth(1).locator("pre.optdiff")).to_have_text("dtype: float32 -> bfloat16")  # over the new incumbent
    expect(hyps.nth(0)).to_contain_text(f"batch more requests {SCRIPT}")
    expect(page.locator("table.steps")).to_contain_text(f"reasoning {SCRIPT}")
    _assert_not_executed(page)


def test_approve_a_pending_change(page, world):
    page.goto(f"/changes/{world['pending']}")
    expect(page.locator("body")).to_contain_text(f"quantize the cache {SCRIPT}")
    expect(page.locator("pre.optdiff")).to_have_text("kv_cache_dtype: (default) -> fp8")
    page.locator('form[action$="/approve"] input[name="note"]').fill("measured, fine")
    page.get_by_role("button", name="Approve").click()
    expect(page).to_have_url(re.compile(rf"/changes/{world['pending']}$"))  # redirected back (303)
    expect(page.locator(".status")).to_have_text("approved")
    expect(page.locator("button")).to_have_count(0)
    with Ledger(world["path"]) as ledger:
        change = Journal(ledger).change(world["pending"])
    assert change.status == "approved" and change.note == "measured, fine"
    _assert_not_executed(page)


def test_a_decided_change_has_no_buttons_and_a_stale_decision_is_refused(page, world):
    page.goto(f"/changes/{world['rejected_change']}")
    expect(page.locator(".status")).to_have_text("rejected")
    expect(page.locator("button")).to_have_count(0)

    page.goto(f"/changes/{world['stale']}")  # someone else decides while this page is open
    with Ledger(world["path"]) as ledger:
        Journal(ledger).decide(world["stale"], "rejected", "by the CLI")
    with page.expect_response(lambda r: r.request.method == "POST") as response:
        page.get_by_role("button", name="Approve").click()
    assert response.value.status == 409
    expect(page.locator("body")).to_contain_text(f"change {world['stale']} is rejected")
    with Ledger(world["path"]) as ledger:
        assert Journal(ledger).change(world["stale"]).status == "rejected"


def test_a_decision_posted_from_another_site_is_refused(page, world):
    page.goto("/")
    answer = page.request.post(f"/changes/{world['stale']}/reject", form={"note": ""},
                               headers={"Origin": "http://evil.example"})
    assert answer.status == 403


def test_a_request_for_another_host_name_is_refused_against_dns_rebinding(page, base_url):
    port = base_url.rsplit(":", 1)[1]
    assert page.request.get("/", headers={"Host": f"rebound.example:{port}"}).status == 400
    assert page.request.get("/", headers={"Host": f"localhost:{port}"}).status == 200


def test_missing_run_is_404(page):
    assert page.goto("/runs/999").status == 404
