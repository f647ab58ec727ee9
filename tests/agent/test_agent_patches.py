"""Code patches as actions: the path rules, the harness-reach tripwire, trying a patch in a
worktree with its tests, and landing an approved one -- on a scratch git repository."""

from __future__ import annotations

import difflib
import subprocess
import textwrap
from pathlib import Path

import pytest

from oxserve.agent.patches import AGENT_REF, CodeRules, PatchError, check_patch, land, prepare, touched_files

RULES = CodeRules(allowed=("pkg/engine/*",), tests=("tests",), test_timeout_s=120)


def git(repo: Path, *args: str, input: str | None = None) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], input=input, capture_output=True, text=True, check=True).stdout


@pytest.fixture
def repo(tmp_path) -> Path:
    repo = tmp_path / "repo"
    (repo / "pkg" / "engine").mkdir(parents=True)
    (repo / "tests").mkdir()
    (repo / "pkg" / "__init__.py").write_text("")
    (repo / "pkg" / "engine" / "__init__.py").write_text("")
    (repo / "pkg" / "engine" / "step.py").write_text("def step(x):\n    return x + 1\n")
    (repo / "tests" / "test_step.py").write_text("from pkg.engine.step import step\n\n\ndef test_step():\n    assert step(1) == 2\n")
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", ".")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "base")
    return repo


def diff(path: str, before: str, after: str) -> str:
    return "".join(difflib.unified_diff(before.splitlines(True), after.splitlines(True), f"a/{path}", f"b/{path}"))


STEP = "def step(x):\n    return x + 1\n"


def test_path_rules_refuse_the_harness_tests_and_what_the_goal_does_not_allow(repo):
    assert check_patch(diff("pkg/engine/step.py", STEP, STEP.replace("x + 1", "1 + x")), RULES, repo) == []
    for path, why in [("oxserve/feedback/drive.py", "is protected"), ("oxserve/experiment/worker.py", "is protected"),
                      ("tests/test_step.py", "is protected"), ("workloads/smoke.yaml", "is protected"),
                      ("oxserve/agent/judge.py", "is protected"), ("Makefile", "is protected"),
                      ("pkg/other.py", "outside the goal's code.allowed")]:
        (problem,) = check_patch(diff(path, "a\n", "b\n"), RULES, repo)
        assert why in problem and problem.endswith("(path rules)"), problem
    renamed = "diff --git a/pkg/engine/step.py b/tests/step.py\nsimilarity index 100%\nrename from pkg/engine/step.py\nrename to tests/step.py\n"
    assert sorted(touched_files(renamed, repo)) == ["pkg/engine/step.py", "tests/step.py"]
    assert any("tests/step.py is protected" in p for p in check_patch(renamed, RULES, repo))
    assert check_patch(diff("pkg/engine/step.py", STEP, STEP), None, repo) == ["the goal allows no code changes (no `code` section)"]


def test_binary_symlink_mode_and_empty_patches_are_refused(repo):
    symlink = ("diff --git a/pkg/engine/link b/pkg/engine/link\nnew file mode 120000\nindex 0000000..1111111\n"
               "--- /dev/null\n+++ b/pkg/engine/link\n@@ -0,0 +1 @@\n+../../oxserve/feedback\n\\ No newline at end of file\n")
    mode = "diff --git a/pkg/engine/step.py b/pkg/engine/step.py\nold mode 100644\nnew mode 100755\n"
    binary = ("diff --git a/pkg/engine/k.so b/pkg/engine/k.so\nnew file mode 100644\nindex 0000000..2222222\n"
              "Binary files /dev/null and b/pkg/engine/k.so differ\n")
    for patch, why in [(symlink, "symlinks and mode changes"), (mode, "symlinks and mode changes"),
                       (binary, "binary patches"), ("", "empty"), ("not a diff\n", "No valid patches")]:
        problems = check_patch(patch, RULES, repo)
        assert len(problems) == 1 and why in problems[0], (why, problems)


@pytest.mark.parametrize("line, why", [
    ("time.perf_counter = lambda: 0.0", "rebinds a clock"),
    ("_time.monotonic_ns = fake", "rebinds a clock"),
    ("setattr(time, 'perf_counter', fake)", "rebinds a clock"),
    ("sys.modules['oxserve.x'].wall = 0", "reaches into sys.modules"),
    ("import builtins", "reaches into builtins"),
    ("from oxserve.feedback import drive", "names the measuring harness"),
    ("import oxserve.experiment.worker as w", "names the measuring harness"),
    ("os.environ.pop('OXSERVE_WORKER_RUN')", "names the launcher's run token"),
])
def test_added_lines_that_reach_for_the_measurement_are_refused(repo, line, why):
    (problem,) = check_patch(diff("pkg/engine/step.py", STEP, STEP + line + "\n"), RULES, repo)
    assert why in problem and problem.endswith("(harness reach)")


def test_ordinary_code_passes_the_tripwire(repo):
    ordinary = textwrap.dedent("""\
        import time
        start = time.perf_counter()
        elapsed_time = time.monotonic() - start
        if elapsed_time == 0.0:
            pass
    """)
    assert check_patch(diff("pkg/engine/step.py", STEP, STEP + ordinary), RULES, repo) == []


def test_a_patch_is_tried_in_a_worktree_with_its_tests_and_committed_under_the_agent_ref(repo):
    base = git(repo, "rev-parse", "HEAD").strip()
    good = diff("pkg/engine/step.py", STEP, STEP.replace("x + 1", "1 + x"))
    prepared = prepare(good, base, RULES, repo, "agent: commute")
    assert git(repo, "rev-parse", f"{AGENT_REF}/{prepared.commit}").strip() == prepared.commit
    assert "1 + x" in git(repo, "show", f"{prepared.commit}:pkg/engine/step.py") and "1 passed" in prepared.tests
    assert git(repo, "rev-parse", "HEAD").strip() == base and "x + 1" in (repo / "pkg/engine/step.py").read_text()
    assert git(repo, "worktree", "list").count("\n") == 1  # the worktree is gone
    with pytest.raises(PatchError, match=r"the tests fail on the patched tree \(tests\)"):
        prepare(diff("pkg/engine/step.py", STEP, STEP.replace("x + 1", "x + 2")), base, RULES, repo, "agent: wrong")
    with pytest.raises(PatchError, match="apply the patch"):
        prepare(diff("pkg/engine/step.py", "something else\n", "x\n"), base, RULES, repo, "agent: stale")
    assert git(repo, "worktree", "list").count("\n") == 1


def test_an_approved_patch_lands_on_the_branch_with_its_message_and_never_over_local_changes(repo):
    good = diff("pkg/engine/step.py", STEP, STEP.replace("x + 1", "1 + x"))
    base = git(repo, "rev-parse", "HEAD").strip()
    (repo / "pkg/engine/step.py").write_text(STEP + "# local edit\n")
    with pytest.raises(PatchError, match="local changes"):
        land(good, repo, "agent: commute", base)
    git(repo, "checkout", "--", "pkg/engine/step.py")
    commit = land(good, repo, "agent: commute\n\nEvidence: experiment 7", base)
    assert git(repo, "log", "-1", "--format=%B", commit).startswith("agent: commute\n\nEvidence: experiment 7")
    assert git(repo, "rev-parse", "main").strip() == commit and git(repo, "status", "--porcelain") == ""
    # A second patch measured on the same base would land on code nobody measured it with.
    other = diff("tests/test_step.py", "x\n", "y\n").replace("tests/test_step.py", "pkg/engine/__init__.py")
    with pytest.raises(PatchError, match="not what the patch was measured on"):
        land(other, repo, "agent: other", base)
