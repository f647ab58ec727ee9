"""The two arms of an experiment: which engine options, run from which source tree.

An arm is given as one string:

    max_num_seqs=16,dtype=float32     inline options (names as in `--help`, `-` or `_`)
    b.yaml / b.json                   a file of options, flat or by section
                                      ({scheduler: {max_num_seqs: 16}})
    git:REV                           another revision of this repository
    git:REV,max_num_seqs=16           ... with options
    ""                                the defaults

A `git:` arm runs from a clean export of REV (`git archive`, which leaves the repository's
state untouched: no worktree to register or prune). The measuring harness --
`oxserve/feedback`, `oxserve/experiment` and `oxserve/options.py` -- is copied over from this tree, so both arms
are measured by the same code and only the engine differs.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import subprocess
import tarfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

from oxserve.options import engine_config, flat_options, sections

REPO_ROOT = Path(__file__).resolve().parents[2]
HARNESS = ("oxserve/feedback", "oxserve/experiment", "oxserve/options.py")


@dataclass(frozen=True)
class Arm:
    label: str  # "A" or "B"
    spec: str  # as given on the command line
    options: Mapping[str, Any] = field(default_factory=dict)  # engine option overrides
    revision: str | None = None  # git revision as given; None: this working tree

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))


def parse_arm(label: str, spec: str) -> Arm:
    text = spec.strip()
    revision = None
    if text.startswith("git:"):
        revision, _, text = text[len("git:"):].partition(",")
        if not revision.strip():
            raise ValueError(f"arm {label}: 'git:' needs a revision, e.g. git:HEAD~1")
        revision = revision.strip()
    try:
        return Arm(label, spec, _parse_options(text.strip()), revision)
    except ValueError as e:
        raise ValueError(f"arm {label} ({spec!r}): {e}") from e


def resolved_options(arm: Arm, base: Mapping[str, Any]) -> dict[str, Any]:
    """What the arm's worker gets: the shared base options, then the arm's own. For this
    tree they are checked here (so a typo fails before any run) and spelled out in full;
    a git arm's revision checks them in its worker, against its own defaults."""
    merged = {**base, **arm.options}
    if arm.revision is None:
        try:
            return flat_options(engine_config(merged))
        except ValueError as e:
            raise ValueError(f"arm {arm.label}: {e}") from e
    return merged


def resolve_revision(revision: str, repo: Path = REPO_ROOT) -> str:
    """The full commit id of `revision`; ValueError when git does not know it."""
    try:
        done = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", "--quiet", f"{revision}^{{commit}}"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        raise ValueError(f"cannot run git to resolve {revision!r}: {e}") from e
    if done.returncode != 0:
        raise ValueError(f"git revision {revision!r} not found in {repo}")
    return done.stdout.strip()


def export_revision(commit: str, dest: Path, repo: Path = REPO_ROOT) -> Path:
    """Write the tree of `commit` to `dest` and overlay this tree's harness packages."""
    try:
        archive = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", commit],
                                 capture_output=True, timeout=300, check=True).stdout
    except subprocess.CalledProcessError as e:
        raise ValueError(f"git archive {commit} failed: {e.stderr.decode(errors='replace').strip()}") from e
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
    for part in HARNESS:
        if (REPO_ROOT / part).is_dir():
            shutil.rmtree(dest / part, ignore_errors=True)
            shutil.copytree(REPO_ROOT / part, dest / part, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO_ROOT / part, dest / part)
    return dest


def tree_digest(root: Path) -> str:
    """Every file under `root` (a file or a directory) by path and content; bytecode caches
    and links are not followed."""
    digest = hashlib.blake2b(digest_size=16)
    files = [root] if root.is_file() else root.rglob("*")
    for path in sorted(p for p in files if p.is_file() and not p.is_symlink() and "__pycache__" not in p.parts):
        digest.update(str(path.relative_to(root.parent)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def harness_digest() -> str:
    """This tree's measuring harness, as every git arm gets it: an agent run refuses to go on
    if it changes under it (a patch's tests or runs writing to it)."""
    parts = "".join(tree_digest(REPO_ROOT / part) for part in HARNESS)
    return hashlib.blake2b(parts.encode(), digest_size=16).hexdigest()


def _parse_options(text: str) -> dict[str, Any]:
    if not text:
        return {}
    path = Path(text)
    if path.suffix in (".yaml", ".yml", ".json") or path.is_file():
        return options_from_file(path)
    options = {}
    for item in text.split(","):
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"expected key=value, got {item!r}")
        options[option_name(name)] = _scalar(value.strip())
    return options


def options_from_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from e
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise ValueError(f"{path} is not valid {path.suffix.lstrip('.') or 'YAML'}: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ValueError(f"{path} must hold a mapping of engine options, got {type(data).__name__}")
    options = {}
    for key, value in data.items():
        if key in sections() and isinstance(value, Mapping):  # {scheduler: {max_num_seqs: 16}}
            options.update({option_name(k): v for k, v in value.items()})
        else:
            options[option_name(key)] = value
    return options


def option_name(name: str) -> str:
    return str(name).strip().lstrip("-").replace("-", "_")


def _scalar(text: str) -> Any:
    """An inline value: int, float, bool, none/null, else the string itself."""
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text
