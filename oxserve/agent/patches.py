"""Code patches as the agent's actions: what a patch may touch, how it is tried, how it lands.

A patch is a unified diff. Before it costs an experiment it passes, cheapest first:

1. **path rules**: every file it touches matches the goal's `code.allowed` globs and none of
   `PROTECTED` -- the measuring harness, the agent, the tests, the workloads, the ledger, the
   build. Binary patches, symlinks and mode changes are refused outright.
2. **harness reach**: no added line rebinds a clock, reaches into `sys.modules` or
   `builtins`, or names the harness's packages or the launcher's run token. This is a
   tripwire for the plain ways; the launcher's own clock (`oxserve/experiment/launch.py`)
   catches a disguised one.
3. **applies and passes the tests**: applied with `git apply` in an isolated worktree at the
   incumbent's commit, the goal's `code.tests` run there, and the result committed (kept
   alive by a ref under `refs/oxserve/agent/`), so the experiment measures it as a `git:`
   arm with this tree's harness.

A proven patch lands only when a person approves it: `land` commits it onto the checked-out
branch with the evidence in its message.
"""

from __future__ import annotations

import fnmatch
import hashlib
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from oxserve.experiment.launch import source_env

# Never touched by a patch, whatever the goal allows: what measures, what judges, what tests.
PROTECTED = (
    "oxserve/feedback/*", "oxserve/experiment/*", "oxserve/options.py", "oxserve/agent/*", "tests/*",
    "conftest.py", "workloads/*", "agent/*", "docs/ledger/*", ".ci/*", ".git*", "Makefile", "pyproject.toml",
    "setup.py", "setup.cfg", "*.sqlite", "*.sqlite-*",
)
# Added lines that reach for the measurement (a tripwire: see the module docstring).
HARNESS_REACH = (
    (re.compile(r"(?<!self)\.(perf_counter|monotonic|process_time|thread_time|time|sleep)(_ns)?\s*=(?!=)"),
     "rebinds a clock"),
    (re.compile(r"\bsetattr\s*\(\s*(time|_?clock)\b"), "rebinds a clock"),
    (re.compile(r"\bsys\.modules\b"), "reaches into sys.modules"),
    (re.compile(r"\bbuiltins\b"), "reaches into builtins"),
    (re.compile(r"oxserve[./](feedback|experiment|agent)\b|from\s+oxserve\s+import\s+.*\b(feedback|experiment|agent)\b"),
     "names the measuring harness"),
    (re.compile(r"OXSERVE_WORKER_RUN|marker_fd"), "names the launcher's run token or markers"),
)
AGENT_REF = "refs/oxserve/agent"
AUTHOR = ("-c", "user.name=oxserve agent", "-c", "user.email=agent@oxserve.invalid")


class PatchError(ValueError):
    """A patch that may not run, or could not be tried: the message says which check."""


@dataclass(frozen=True)
class CodeRules:
    allowed: tuple[str, ...]  # globs (fnmatch: `*` crosses `/`) of the files a patch may touch
    tests: tuple[str, ...] = ()  # pytest arguments run in the patched tree before any experiment
    test_timeout_s: float = 900.0
    candidates: tuple["Candidate", ...] = ()


@dataclass(frozen=True)
class Candidate:
    """A patch an engineer queued for the agent to settle (goal `code.patches`)."""

    diff: str
    rationale: str
    predicted_ratio: float
    name: str  # the file it came from


@dataclass(frozen=True)
class Prepared:
    commit: str  # the patched tree, committed on the incumbent's commit
    tests: str  # the last lines of the tests' report


def digest(diff: str) -> str:
    return hashlib.sha256(diff.encode()).hexdigest()[:12]


def touched_files(diff: str, repo: Path) -> list[str]:
    """The paths `diff` creates, changes, renames or deletes, as git reads it; PatchError for
    what no patch may do (binary content, symlinks, mode changes) or git cannot read."""
    if not diff.strip():
        raise PatchError("the patch is empty")
    numstat = _git(repo, "apply", "--numstat", "-z", "-", input=diff, what="read the patch")
    summary = _git(repo, "apply", "--summary", "-", input=diff, what="read the patch")
    fields = numstat.split("\0")
    paths, i = [], 0
    while i < len(fields) and fields[i]:
        added, deleted, path = fields[i].split("\t", 2)
        if added == "-" or deleted == "-":
            raise PatchError("binary patches are refused (path rules)")
        if path:
            paths.append(path)
            i += 1
        else:  # a rename or copy: the two paths follow
            paths += fields[i + 1 : i + 3]
            i += 3
    for line in summary.splitlines():
        if "mode 120000" in line or "mode change" in line:
            raise PatchError(f"symlinks and mode changes are refused (path rules): {line.strip()}")
    # git's count names a rename by its new path only: the old one (deleted) comes from the headers.
    for path in read_diff(diff).paths:
        if path.startswith('"'):
            raise PatchError(f"quoted (unusual) paths are refused (path rules): {path}")
        if path not in paths:
            paths.append(path)
    if not paths:
        raise PatchError("the patch touches no file")
    return paths


@dataclass(frozen=True)
class DiffText:
    paths: list[str]  # from the file headers (old and new names)
    added: list[tuple[int, str]]  # (line number in the diff, text) of every added line


def read_diff(diff: str) -> DiffText:
    """The headers' paths and the added lines of a unified diff, read hunk by hunk (an added
    line whose text starts with "++ b/" is content, not a header)."""
    paths, added = [], []
    old_left = new_left = 0
    for number, line in enumerate(diff.splitlines(), 1):
        if old_left > 0 or new_left > 0:  # inside a hunk: count its lines off
            if line.startswith("+"):
                added.append((number, line[1:]))
                new_left -= 1
            elif line.startswith("-"):
                old_left -= 1
            elif line.startswith(" ") or line == "":
                old_left, new_left = old_left - 1, new_left - 1
            continue  # "\ No newline at end of file" counts nothing
        if hunk := re.match(r"@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@", line):
            old_left = int(hunk.group(1)) if hunk.group(1) is not None else 1
            new_left = int(hunk.group(2)) if hunk.group(2) is not None else 1
            continue
        for prefix in ("rename from ", "rename to ", "copy from ", "copy to ", "--- a/", "+++ b/"):
            if line.startswith(prefix):
                paths.append(line[len(prefix):].rstrip("\t"))
    return DiffText(paths, added)


def check_patch(diff: str, rules: CodeRules | None, repo: Path) -> list[str]:
    """Why `diff` may not be tried (empty: it may): the path rules, then the harness reach."""
    if rules is None:
        return ["the goal allows no code changes (no `code` section)"]
    try:
        paths = touched_files(diff, repo)
    except PatchError as e:
        return [str(e)]
    problems = []
    for path in paths:
        if any(fnmatch.fnmatchcase(path, p) for p in PROTECTED) or ".." in Path(path).parts:
            problems.append(f"{path} is protected: the harness, the agent, tests, workloads, the ledger and the "
                            "build are never patched (path rules)")
        elif not any(fnmatch.fnmatchcase(path, p) for p in rules.allowed):
            problems.append(f"{path} is outside the goal's code.allowed ({', '.join(rules.allowed)}) (path rules)")
    for number, text in read_diff(diff).added:
        code = re.sub(r"(^|\s)#[^'\"]*$", "", text)  # a comment may name the harness (one with quotes is read)
        for pattern, why in HARNESS_REACH:
            if pattern.search(code):
                problems.append(f"line {number} {why}: {text.strip()[:80]!r} (harness reach)")
    return problems


def prepare(diff: str, base: str, rules: CodeRules, repo: Path, message: str) -> Prepared:
    """Apply `diff` on commit `base` in a worktree of its own, run the goal's tests there and
    commit; PatchError when it does not apply or a test fails."""
    with tempfile.TemporaryDirectory(prefix="oxserve-patch-") as tmp:
        tree = Path(tmp) / "tree"
        _git(repo, "worktree", "add", "--detach", "--quiet", str(tree), base, what="make a worktree")
        try:
            _git(tree, "apply", "--index", "-", input=diff, what=f"apply the patch on {base[:12]}")
            report = run_tests(tree, rules)
            _git(tree, *AUTHOR, "commit", "--quiet", "--no-verify", "-m", message, what="commit the patch")
            commit = _git(tree, "rev-parse", "HEAD", what="read the commit").strip()
            _git(repo, "update-ref", f"{AGENT_REF}/{commit}", commit, what="keep the commit")
            return Prepared(commit, report)
        finally:
            _git(repo, "worktree", "remove", "--force", str(tree), what="remove the worktree", check=False)


def run_tests(tree: Path, rules: CodeRules) -> str:
    """The goal's tests, run on the patched tree's code; the tail of their report."""
    if not rules.tests:
        return "no tests named in code.tests"
    env = source_env(tree)
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *rules.tests]
    try:
        done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=rules.test_timeout_s)
    except subprocess.TimeoutExpired as e:
        raise PatchError(f"the tests took over {rules.test_timeout_s:.0f} s (tests)") from e
    tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
    if done.returncode != 0:
        raise PatchError(f"the tests fail on the patched tree (tests):\n{tail}")
    return tail


def land(diff: str, repo: Path, message: str, base: str) -> str:
    """Commit an approved patch onto the checked-out branch of `repo`; the new commit id.
    Refused unless the branch holds exactly the code the patch was measured on (`base`'s
    tree: another landing since makes an unmeasured combination), or when those files have
    local changes."""
    if shutil.which("git") is None:
        raise PatchError("git is not installed")
    paths = touched_files(diff, repo)
    head_tree = _git(repo, "rev-parse", "HEAD^{tree}", what="read the branch").strip()
    base_tree = _git(repo, "rev-parse", f"{base}^{{tree}}", what=f"find the measured commit {base[:12]}").strip()
    if head_tree != base_tree:
        raise PatchError(f"the branch's code is not what the patch was measured on ({base[:12]}): "
                         "another change landed since; the agent must test it again on the branch")
    dirty = _git(repo, "status", "--porcelain", "--", *paths, what="read the working tree").strip()
    if dirty:
        raise PatchError(f"the files the patch touches have local changes; commit or stash them first:\n{dirty}")
    _git(repo, "apply", "--index", "-", input=diff, what="apply the patch on the checked-out branch (rebase it?)")
    _git(repo, *AUTHOR, "commit", "--quiet", "--no-verify", "-m", message, "--", *paths, what="commit the patch")
    return _git(repo, "rev-parse", "HEAD", what="read the commit").strip()


def _git(cwd: Path, *args: str, what: str, input: str | None = None, check: bool = True) -> str:
    try:
        done = subprocess.run(["git", "-C", str(cwd), *args], input=input, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as e:
        raise PatchError(f"cannot {what}: {e}") from e
    if check and done.returncode != 0:
        raise PatchError(f"cannot {what}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout
