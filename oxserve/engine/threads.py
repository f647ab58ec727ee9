"""How many intra-op threads the engine runs, and why.

torch's own default is every core of the host, even when this process may use fewer (a
CPU affinity mask from taskset or a container's cpuset, or a cgroup CPU quota): more
threads than usable CPUs makes each OpenMP region wait for descheduled workers. The
engine takes the usable CPUs instead, sets torch to that count once at start (so it does
not drift with other libraries' settings), and logs the choice.
"""

from __future__ import annotations

import math
import os
from pathlib import Path


def usable_cpus() -> tuple[int, str]:
    """(CPUs this process can use, what limits it)."""
    count, reason = os.cpu_count() or 1, "cores"
    if hasattr(os, "sched_getaffinity"):
        affinity = len(os.sched_getaffinity(0))
        if affinity < count:
            count, reason = affinity, "CPU affinity mask"
    quota = _cgroup_quota()
    if quota is not None and quota < count:
        count, reason = quota, "cgroup CPU quota"
    return max(1, count), reason


def _cgroup_quota() -> int | None:
    """cgroup v2 `cpu.max` ("quota period", or "max ...") as whole CPUs, rounded up."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    return max(1, math.ceil(int(quota) / int(period)))


def choose_threads(requested: int | None) -> tuple[int, str]:
    """(intra-op threads, the reason, for the start-up log)."""
    if requested is not None:
        return requested, "--threads"
    count, reason = usable_cpus()
    return count, f"one per usable CPU ({reason})"
