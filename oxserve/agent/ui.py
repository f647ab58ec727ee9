"""`oxserve agent ui`: a web dashboard over the ledger -- the agent's runs, each run's
experiments with their statistics and the profiles behind them, and the changes that wait
for a person, with Approve / Reject.

Server-rendered HTML with inline CSS and SVG: no JavaScript and nothing fetched from
elsewhere (the machines it runs on are offline). Everything read from the ledger is
escaped: step reasoning and language-model rationales are untrusted text. The ledger is
opened per request, since the agent's loop writes it from another process (SQLite WAL).
"""

from __future__ import annotations

import html
import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from urllib.parse import urlsplit

from fastapi import FastAPI, Form, Request
from fastapi.responses import HTMLResponse, RedirectResponse
from starlette.middleware.trustedhost import TrustedHostMiddleware

from oxserve.agent.approval import decide as decide_change
from oxserve.agent.journal import Change, Journal, Run, Step
from oxserve.agent.patches import digest
from oxserve.feedback.ledger import ExperimentRecord, Ledger, LedgerError
from oxserve.feedback.stats import SUSPECT

EXPERIMENT_KINDS = ("experiment", "confirm", "held_out", "interrupted")
OUTCOME_KINDS = ("accept", "reject", "queue")
DECISIONS = {"approve": "approved", "reject": "rejected"}

_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em auto;max-width:1200px;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em}th,td{border:1px solid #ccc;padding:3px 7px;text-align:left;
vertical-align:top}th{background:#f3f3f3}pre{background:#f7f7f7;padding:6px;white-space:pre-wrap;margin:0}
.ok{color:#17702a}.bad{color:#b3261e}.muted{color:#777}.reason{white-space:pre-wrap}
form{display:inline-block;margin-right:1.5em}svg{background:#fcfcfc;border:1px solid #ddd}
section.hyp{border-left:3px solid #ccd;padding-left:.8em;margin-bottom:1.2em}
"""


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def create_app(ledger_path: Path, hosts: tuple[str, ...] = LOOPBACK) -> FastAPI:
    """The dashboard; it answers only requests whose Host header names one of `hosts`, so a
    page on another site cannot reach it through a DNS name rebound to this machine."""
    app = FastAPI(title="oxserve agent", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(hosts))
    ledger_path = Path(ledger_path)

    @contextmanager
    def journal() -> Iterator[Journal]:
        ledger = Ledger(ledger_path)
        try:
            yield Journal(ledger)
        finally:
            ledger.close()

    # Plain `def` routes: FastAPI runs them in its thread pool, so SQLite never blocks the
    # event loop, and each connection is opened and closed in one thread.
    @app.get("/", response_class=HTMLResponse)
    def index() -> HTMLResponse:
        with journal() as j:
            return _page("Agent runs", _index_body(j, ledger_path))

    @app.get("/runs/{run_id}", response_class=HTMLResponse)
    def run_page(run_id: int) -> HTMLResponse:
        with journal() as j:
            try:
                run = j.run(run_id)
            except LedgerError as e:
                return _page("Not found", f"<p>{_e(e)}</p>", 404)
            return _page(f"Agent run {run.id}", _run_body(j, run))

    @app.get("/changes/{change_id}", response_class=HTMLResponse)
    def change_page(change_id: int) -> HTMLResponse:
        with journal() as j:
            try:
                change = j.change(change_id)
            except LedgerError as e:
                return _page("Not found", f"<p>{_e(e)}</p>", 404)
            return _page(f"Change {change.id}", _change_body(change))

    def decide(request: Request, change_id: int, decision: str, note: str) -> HTMLResponse | RedirectResponse:
        status = DECISIONS[decision]
        origin = request.headers.get("origin")
        if origin and urlsplit(origin).netloc != request.headers.get("host"):
            # Another site's page posting to this local server (CSRF): approving is a person's decision.
            return _page("Forbidden", f"<p class=bad>decisions come from this dashboard, not {_e(origin)}</p>", 403)
        with journal() as j:
            try:
                current = j.change(change_id)
            except LedgerError as e:
                return _page("Not found", f"<p>{_e(e)}</p>", 404)
            if current.status != "pending":
                return _conflict(change_id, f"change {change_id} is {current.status}: only a pending change "
                                            f"can be {status}")
            try:
                decide_change(j, change_id, status, note.strip())  # an approved patch lands first
            except (LedgerError, ValueError) as e:  # decided by someone else in between; a patch that cannot land
                return _conflict(change_id, str(e))
        return RedirectResponse(f"/changes/{change_id}", status_code=303)

    @app.post("/changes/{change_id}/approve", response_model=None)
    def approve(request: Request, change_id: int, note: str = Form("")) -> HTMLResponse | RedirectResponse:
        return decide(request, change_id, "approve", note)

    @app.post("/changes/{change_id}/reject", response_model=None)
    def reject(request: Request, change_id: int, note: str = Form("")) -> HTMLResponse | RedirectResponse:
        return decide(request, change_id, "reject", note)

    @app.exception_handler(LedgerError)
    def ledger_error(_request, exc: LedgerError) -> HTMLResponse:  # e.g. the file is not a ledger
        return _page("Ledger error", f"<p class=bad>{_e(exc)}</p>", 500)

    return app


def run_ui(ledger_path: Path, host: str, port: int) -> None:
    import uvicorn

    Ledger(ledger_path).close()  # a bad ledger path fails now, not on the first page view
    print(f"oxserve agent ui: http://{host}:{port}/ (ledger {ledger_path})", flush=True)
    uvicorn.run(create_app(ledger_path, (*LOOPBACK, host)), host=host, port=port, log_level="warning")


# --- pages ---------------------------------------------------------------------------------


def _index_body(j: Journal, ledger_path: Path) -> str:
    rows = []
    for run in reversed(j.runs()):
        steps = j.steps(run.id)
        _, experiments = j.spent(run.id)
        rows.append([f'<a href="/runs/{run.id}">{run.id}</a>', _e(run.policy), _status(run.status),
                     _e(run.goal.get("name", "")), _e(run.created_at), str(experiments),
                     _num(_incumbent_rate(j, steps))])
    runs = _table(["run", "policy", "status", "goal", "created", "experiments", "incumbent rate"], rows) \
        if rows else "<p class=muted>no agent runs yet</p>"
    pending = j.changes(status="pending")
    queue = _table(["change", "run", "option changes", "measured B/A", "queued"],
                   [[f'<a href="/changes/{c.id}">{c.id}</a>', f'<a href="/runs/{c.run_id}">{c.run_id}</a>',
                     _change_cell(c), _num(c.evidence.get("ratio"), ".3f"),
                     _e(c.created_at)] for c in pending]) if pending else "<p class=muted>nothing waits</p>"
    return (f"<p class=muted>ledger {_e(ledger_path)}</p><h2>Runs</h2>{runs}"
            f"<h2>Changes waiting for a person</h2>{queue}")


def _run_body(j: Journal, run: Run) -> str:
    steps = j.steps(run.id)
    records = {s.experiment_id: _record(j, s.experiment_id) for s in steps if s.experiment_id is not None}
    spent_s, experiments = j.spent(run.id)
    metric = run.goal.get("objective", {}).get("metric", "metric")
    head = _table(["", ""], [
        ["policy", _e(run.policy)], ["status", _status(run.status) + (f" <span class=bad>{_e(run.error)}</span>"
                                                                        if run.error else "")],
        ["goal", _e(run.goal.get("name", ""))], ["created / finished", f"{_e(run.created_at)} / "
                                                                       f"{_e(run.finished_at or '-')}"],
        ["budget used", f"{spent_s / 60:.1f} min, {experiments} experiments (of {_e(run.goal.get('budget', {}))})"],
        ["start", _e(_options(run.start))], ["incumbent", _e(_options(run.incumbent))]])
    changes = j.changes(run_id=run.id)
    queue = _table(["change", "status", "option changes", "note"],
                   [[f'<a href="/changes/{c.id}">{c.id}</a>', _status(c.status),
                     _change_cell(c), _e(c.note)] for c in changes]) if changes else ""
    return (f'<p><a href="/">all runs</a></p>{head}'
            f"<h2>Incumbent {_e(metric)} over the run</h2>{_chart(steps, records, metric)}"
            f"<h2>Experiments</h2>{_experiments_table(steps, records)}"
            f"<h2>Hypotheses</h2>{_hypotheses(run, steps)}"
            + (f"<h2>Queued changes</h2>{queue}" if queue else "")
            + f"<h2>Step log</h2>{_step_log(steps)}")


def _change_body(c: Change) -> str:
    action, ev = c.action, c.evidence
    rows = [["run", f'<a href="/runs/{c.run_id}">{c.run_id}</a>'], ["status", _status(c.status)],
            ["queued / decided", f"{_e(c.created_at)} / {_e(c.decided_at or '-')}"],
            ["option changes", _diff_html(c.base, action.get("changes", {}))],
            *([["code patch", f"<pre class=diff>{_e(action['patch'])}</pre>"]] if action.get("patch") else []),
            ["measured against", _e(_options(c.base))],
            ["rationale", f"<span class=reason>{_e(action.get('rationale', ''))}</span> "
                          f"<span class=muted>({_e(action.get('origin', '?'))})</span>"],
            ["predicted B/A", _num(action.get("predicted_ratio"), ".3f")],
            ["measured B/A", _num(ev.get("ratio"), ".3f")], ["B median", _num(ev.get("median_b"))],
            ["experiments", ", ".join(f'<a href="/runs/{c.run_id}#exp-{_e(i)}">{_e(i)}</a>'
                                      for i in ev.get("experiment_ids", [])) or "-"]]
    if c.note:
        rows.append(["note", _e(c.note)])
    body = f'<p><a href="/">all runs</a></p>{_table(["", ""], rows)}'
    if c.status == "pending":
        body += "".join(
            f'<form method="post" action="/changes/{c.id}/{d}"><input name="note" placeholder="note (optional)">'
            f' <button type="submit">{d.capitalize()}</button></form>' for d in DECISIONS)
    else:
        body += f"<p>This change is <b>{_e(c.status)}</b>.</p>"
    return body + f"<h3>Evidence</h3><pre>{_e(json.dumps(ev, indent=1, sort_keys=True))}</pre>"


def _conflict(change_id: int, message: str) -> HTMLResponse:
    return _page("Conflict", f'<p class=bad>{_e(message)}</p><p><a href="/changes/{change_id}">back</a></p>', 409)


# --- run page parts ------------------------------------------------------------------------


def _chart(steps: list[Step], records: dict[int, ExperimentRecord | None], metric: str) -> str:
    """A step line of the incumbent's rate (the start's A median, then each adoption) and a
    dot per experiment's B median, in step order. Held-out experiments run another workload:
    not comparable, left out."""
    points: list[tuple[int, float, str, str]] = []  # (step position, value, class, tooltip)
    for i, s in enumerate(steps):
        rec = records.get(s.experiment_id)
        if s.kind in ("experiment", "confirm") and rec is not None:
            if not points and _stat(rec, "median_a") is not None:
                points.append((i, _stat(rec, "median_a"), "start", f"start: A median of experiment {rec.id}"))
            if _stat(rec, "median_b") is not None:
                points.append((i, _stat(rec, "median_b"), "experiment",
                               f"experiment {rec.id} ({s.kind}): B median {_stat(rec, 'median_b'):.4g}"))
        elif s.kind == "accept" and isinstance(s.evidence.get("incumbent_rate"), (int, float)):
            points.append((i, s.evidence["incumbent_rate"], "incumbent",
                           f"step {s.id}: incumbent {s.evidence['incumbent_rate']:.4g}"))
    if not points:
        return "<p class=muted>no measurements yet</p>"
    w, h, left, right, top, bottom = 720, 260, 70, 20, 15, 35
    lo, hi = min(p[1] for p in points), max(p[1] for p in points)
    pad = (hi - lo) * 0.08 or abs(hi) * 0.05 or 1.0
    lo, hi = lo - pad, hi + pad
    last = max(len(steps) - 1, 1)

    def xy(pos: int, value: float) -> tuple[float, float]:
        return (left + (w - left - right) * pos / last, top + (h - top - bottom) * (hi - value) / (hi - lo))

    line = [xy(p[0], p[1]) for p in points if p[2] in ("start", "incumbent")]
    path = ""
    if line:  # a step line: flat until the next adoption, then up (or down), to the end
        d = [f"M{line[0][0]:.1f},{line[0][1]:.1f}"]
        for x, y in line[1:]:
            d.append(f"H{x:.1f}V{y:.1f}")
        d.append(f"H{w - right}")
        path = f'<path class="incumbent-line" d="{" ".join(d)}" fill="none" stroke="#17702a" stroke-width="2"/>'
    style = {"start": 'r="5" fill="#17702a"', "incumbent": 'r="5" fill="#17702a"',
             "experiment": 'r="4" fill="none" stroke="#1f5fbf" stroke-width="1.5"'}
    dots = "".join(f'<circle class="{cls}" cx="{xy(pos, v)[0]:.1f}" cy="{xy(pos, v)[1]:.1f}" {style[cls]}>'
                   f"<title>{_e(tip)}</title></circle>" for pos, v, cls, tip in points)
    axes = (f'<line x1="{left}" y1="{h - bottom}" x2="{w - right}" y2="{h - bottom}" stroke="#999"/>'
            f'<line x1="{left}" y1="{top}" x2="{left}" y2="{h - bottom}" stroke="#999"/>'
            f'<text x="{left - 5}" y="{top + 10}" text-anchor="end" font-size="11">{hi:.4g}</text>'
            f'<text x="{left - 5}" y="{h - bottom}" text-anchor="end" font-size="11">{lo:.4g}</text>'
            f'<text x="{(w + left) / 2}" y="{h - 8}" text-anchor="middle" font-size="11">steps of the run, '
            f"in order; green: incumbent {_e(metric)}, blue rings: each experiment's B median</text>")
    return (f'<svg class="progress" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
            f'xmlns="http://www.w3.org/2000/svg" role="img">{axes}{path}{dots}</svg>')


def _experiments_table(steps: list[Step], records: dict[int, ExperimentRecord | None]) -> str:
    outcomes: dict[int, Step] = {}  # experiment id -> the accept / reject / queue step that judged it
    for s in steps:
        if s.kind in OUTCOME_KINDS:
            for eid in s.evidence.get("experiment_ids", []):
                if eid not in outcomes or s.kind == "accept":  # a queued change applied later: accepted
                    outcomes[eid] = s
    rows = []
    for s in steps:
        if s.kind not in EXPERIMENT_KINDS or s.experiment_id is None:
            continue
        rec, action = records.get(s.experiment_id), s.action or {}
        predicted = s.evidence.get("predicted_ratio", action.get("predicted_ratio"))
        cells = [f'<span id="exp-{s.experiment_id}">{s.experiment_id}</span>', _e(s.kind),
                 _e(_action_text(action)), _num(predicted, ".3f")]
        if rec is None:
            rows.append(cells + ['<span class=bad>not in the ledger</span>'] + [""] * 4)
            continue
        if rec.status != "finished":
            rows.append(cells + [f"<span class=bad>{_e(rec.status)}</span> {_e(rec.error or '')}"] + [""] * 4)
            continue
        st, q = rec.stats or {}, rec.quality or {}
        measured = (f'<span class="ratio">{_num(st.get("median_ratio"), ".3f")}</span> '
                    f'<span class="ci">[{_num(st.get("ci_low"), ".3f")}, {_num(st.get("ci_high"), ".3f")}]</span>')
        quality = (f'{_num(q.get("max_divergence"), ".3g")} / {_num(q.get("bound"), ".3g")} '
                   + ('<span class=ok>pass</span>' if q.get("passed") else '<span class=bad>FAIL</span>'))
        roofline = (f"<span class=bad>suspect: {_e(st.get('reason', ''))}</span>" if rec.verdict == SUSPECT
                    else "<span class=ok>ok</span>")
        rows.append(cells + [measured, f'<span class="p">{_num(st.get("p_value"), ".3g")}</span>', quality,
                             roofline, _verdict(s, rec, outcomes.get(s.experiment_id))])
    if not rows:
        return "<p class=muted>no experiments yet</p>"
    return _table(["exp", "kind", "option changes", "predicted B/A", "measured B/A [95% CI]", "p-value",
                   "quality: max divergence / bound", "roofline", "accepted?"], rows, "experiments")


def _verdict(step: Step, rec: ExperimentRecord, outcome: Step | None) -> str:
    """Whether the change the experiment tested was adopted, and if not why -- from the
    step that judged it, else from the experiment step's or the ledger's own verdict."""
    ev = outcome.evidence if outcome is not None else step.evidence
    accepted = ev.get("accepted", rec.accepted)
    if accepted:
        label = "proven; queued for a person" if outcome is not None and outcome.kind == "queue" else "accepted"
        return f"<span class=ok>{label}</span>"
    reasons = ev.get("reasons") or [f"{rec.verdict}: {(rec.stats or {}).get('reason', '')}"]
    return f'<span class="bad reason">{_e("; ".join(map(str, reasons)))}</span>'


def _hypotheses(run: Run, steps: list[Step]) -> str:
    """Each proposal with the incumbent it was made against and the profile that motivated
    it (the latest one before it). An experiment with no proposal before it (older runs)
    stands for its own hypothesis."""
    incumbent, profile, open_changes, parts = dict(run.start), None, None, []
    for s in steps:
        changes = (s.action or {}).get("changes")
        if s.kind == "profile":
            profile = s
        elif s.kind == "propose" or (s.kind == "experiment" and changes != open_changes):
            parts.append(_hypothesis(s, incumbent, profile))
            open_changes = changes if s.kind == "propose" else None
        elif s.kind == "experiment":
            open_changes = None  # the proposal is being tested: a later identical one is new
        if s.kind == "accept" and isinstance(s.evidence.get("incumbent"), Mapping):
            incumbent = dict(s.evidence["incumbent"])
    return "".join(parts) or "<p class=muted>no proposals yet</p>"


def _hypothesis(s: Step, incumbent: dict, profile: Step | None) -> str:
    action = s.action or {}
    out = [f'<section class="hyp"><h3>Step {s.id}: {_e(_options(action.get("changes", {})))} '
           f'<span class=muted>({_e(action.get("origin", s.kind))}, predicted '
           f'x{_num(action.get("predicted_ratio"), ".3f")})</span></h3>',
           f'<p class=reason>{_e(action.get("rationale") or s.reasoning)}</p>',
           f"<p>Option diff:</p>{_diff_html(incumbent, action.get('changes', {}))}"]
    diff = s.evidence.get("diff") or action.get("evidence", {}).get("diff")
    if isinstance(diff, str):
        out.append(f'<p>Code diff:</p><pre class="diff">{_e(diff)}</pre>')
    out.append(_profile_html(profile))
    return "".join(out) + "</section>"


def _profile_html(profile: Step | None) -> str:
    if profile is None:
        return "<p class=muted>no profile before this proposal</p>"
    ev = profile.evidence
    headline = "".join(f"<li>{_e(line)}</li>" for line in ev.get("headline", []))
    gaps = _table(["phase", "batch", "op", "roofline fraction", "share of step time"],
                  [[_e(g.get("phase", "")), _e(g.get("batch", "")), _e(g.get("op", "")),
                    _num(g.get("roofline_fraction"), ".1%"), _num(g.get("share_of_steps"), ".1%")]
                   for g in ev.get("gaps", [])[:3] if isinstance(g, Mapping)]) if ev.get("gaps") else ""
    where = f" <span class=muted>({_e(ev['report_dir'])})</span>" if ev.get("report_dir") else ""
    return (f'<div class="profile"><p>Motivating profile (step {profile.id}){where}:</p>'
            f"<ul class=headline>{headline}</ul>{gaps}</div>")


def _step_log(steps: list[Step]) -> str:
    rows = [[str(s.id), _e(s.created_at), _e(s.kind), f"{s.seconds:.1f}",
             _e(_options((s.action or {}).get("changes", {}))) if s.action else "",
             f'<span class=reason>{_e(s.reasoning)}</span>',
             f'<a href="#exp-{s.experiment_id}">{s.experiment_id}</a>' if s.experiment_id is not None else "",
             f"<details><summary>evidence</summary><pre>{_e(json.dumps(s.evidence, indent=1, sort_keys=True))}"
             f"</pre></details>" if s.evidence else ""] for s in steps]
    return _table(["step", "at", "kind", "s", "changes", "reasoning", "exp", ""], rows, "steps") if rows \
        else "<p class=muted>no steps yet</p>"


# --- small helpers -------------------------------------------------------------------------


def _record(j: Journal, experiment_id: int) -> ExperimentRecord | None:
    try:
        return j.ledger.get(experiment_id)
    except LedgerError:
        return None


def _incumbent_rate(j: Journal, steps: list[Step]) -> float | None:
    """The latest measurement of the incumbent: an adoption's rate, or the A median of the
    latest experiment (A is the incumbent)."""
    for s in reversed(steps):
        if s.kind == "accept" and s.evidence.get("incumbent_rate") is not None:
            return s.evidence["incumbent_rate"]
        if s.kind in ("experiment", "confirm") and s.experiment_id is not None:
            rec = _record(j, s.experiment_id)
            if rec is not None and _stat(rec, "median_a") is not None:
                return _stat(rec, "median_a")
    return None


def _stat(rec: ExperimentRecord, key: str) -> Any:
    return (rec.stats or {}).get(key)


def _diff_html(before: Mapping, changes: Mapping) -> str:
    lines = [f"{_e(name)}: {_value(before.get(name))} -&gt; {_value(new)}"
             for name, new in sorted(changes.items(), key=lambda kv: str(kv[0]))]
    if not lines:
        return "<span class=muted>no changes</span>"
    text = "\n".join(lines)
    return f'<pre class="optdiff">{text}</pre>'


def _value(v: Any) -> str:
    if v is None:
        return "(default)"
    return _e(v if isinstance(v, str) else json.dumps(v, sort_keys=True, default=str))


def _options(options: Mapping) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(options.items(), key=lambda kv: str(kv[0]))) or "defaults"


def _num(x: Any, spec: str = ".4g") -> str:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return "-"
    return format(x, spec)


def _status(status: str) -> str:
    cls = {"approved": "ok", "applied": "ok", "finished": "ok", "rejected": "bad", "lapsed": "bad", "failed": "bad"}.get(status, "")
    return f'<span class="status {cls}">{_e(status)}</span>'


def _table(header: list[str], rows: list[list[str]], cls: str = "") -> str:
    """Cells are HTML already (escaped by the caller)."""
    head = "".join(f"<th>{h}</th>" for h in header) if any(header) else ""
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f'<table class="{cls}">' + (f"<tr>{head}</tr>" if head else "") + body + "</table>"


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _page(title: str, body: str, status: int = 200) -> HTMLResponse:
    return HTMLResponse(
        f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{_e(title)} - oxserve agent</title>'
        f"<style>{_CSS}</style></head><body><h1>{_e(title)}</h1>{body}</body></html>", status_code=status)


def _action_text(action: Mapping[str, Any]) -> str:
    """Its option changes, and its patch by digest (the diff is on the change's page)."""
    text = _options(action.get("changes", {}))
    return f"{text}, patch {digest(action['patch'])}" if action.get("patch") else text


def _change_cell(c: Change) -> str:
    cell = _diff_html(c.base, c.action.get("changes", {})) if c.action.get("changes") or not c.action.get("patch") else ""
    return cell + (f" patch {_e(digest(c.action['patch']))}" if c.action.get("patch") else "")
