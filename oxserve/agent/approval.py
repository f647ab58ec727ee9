"""A person's decision on a queued change, wherever it is made (`oxserve agent approve`, the
dashboard): approving a code patch first lands it -- a commit on the checked-out branch whose
message carries the evidence -- and a patch that cannot land is not approved.
"""

from __future__ import annotations

from pathlib import Path

from oxserve.agent.journal import Change, Journal
from oxserve.agent.patches import PatchError, digest, land
from oxserve.experiment.arms import REPO_ROOT
from oxserve.feedback.ledger import LedgerError


def decide(journal: Journal, change_id: int, status: str, note: str = "",
           repo: Path | None = None) -> tuple[Change, str | None]:
    """Approve or reject; (the change as decided, the landed commit or None)."""
    change, commit = journal.change(change_id), None
    if status == "approved" and change.action.get("patch"):
        commit = land_change(journal, change, note, repo)
        note = f"{note} (landed as {commit})".strip()
    return journal.decide(change_id, status, note), commit


def land_change(journal: Journal, change: Change, note: str, repo: Path | None = None) -> str:
    """Commit an approved change's patch onto the checked-out branch of `repo` (default: this
    repository), its evidence in the message."""
    repo = repo or REPO_ROOT
    if change.status != "pending":
        raise LedgerError(f"change {change.id} is {change.status}: it cannot be approved")
    diff, rationale = change.action["patch"], change.action["rationale"]
    lines = [f"agent: {rationale.splitlines()[0][:72] if rationale else 'patch ' + digest(diff)}", "", rationale, "",
             f"Evidence (oxserve agent run {change.run_id}, change {change.id}, patch {digest(diff)}, measured on "
             f"{(change.evidence.get('base_revision') or 'the working tree')[:12]}):"]
    for eid in change.evidence.get("experiment_ids", []):
        record = journal.ledger.get(eid)
        st, q = record.stats or {}, record.quality or {}
        lines.append(f"- experiment {eid} ({record.workload.get('name')}): B/A x{st.get('median_ratio', float('nan')):.3f} "
                     f"[{st.get('ci_low', float('nan')):.3f}, {st.get('ci_high', float('nan')):.3f}], p = "
                     f"{st.get('p_value', float('nan')):.3g}, verdict {record.verdict}, quality gate and output "
                     f"checks {'passed' if q.get('passed') else 'FAILED'}")
    lines.append(f"Approved by a person{': ' + note if note else ''}.")
    try:
        return land(diff, repo, "\n".join(lines), change.evidence.get("base_revision") or "")
    except PatchError as e:
        raise ValueError(f"change {change.id} cannot land: {e}") from e
