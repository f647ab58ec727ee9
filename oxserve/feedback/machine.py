"""Facts about this machine shared by the ledger and the ceilings cache."""

from __future__ import annotations

import os
import platform
import socket
from pathlib import Path

import torch


def data_dir() -> Path:
    """Where oxserve keeps its data: $OXSERVE_DATA_DIR, else $XDG_DATA_HOME/oxserve,
    else ~/.local/share/oxserve. Not created here."""
    explicit = os.environ.get("OXSERVE_DATA_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_DATA_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".local" / "share"
    return base / "oxserve"


def hostname() -> str:
    return socket.gethostname()


def cpu_model() -> str:
    """The CPU's marketing name; /proc/cpuinfo is the only reliable source on Linux."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def cpu_count() -> int:
    return os.cpu_count() or 1


def device_name(device: str) -> str:
    """Human-readable name of a torch device ("cpu" -> the CPU model)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    if dev.type == "cpu":
        return cpu_model()
    return dev.type


def gpu_model() -> str | None:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return None


def cache_bytes(device: str) -> int:
    """Size of the last-level cache in front of memory (CPU L3, GPU L2); data smaller than
    this can be served faster than memory bandwidth. 32 MiB when unknown."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return int(torch.cuda.get_device_properties(dev).L2_cache_size)
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=32 * 2**20)
