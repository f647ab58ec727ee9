"""This machine's measured ceilings: memory bandwidth and matrix-multiply rates.

They bound what any change can achieve (the roofline): a measured rate above them means
the benchmark missed work (BRIEF §3). Each number is the best of several repetitions of a
large operation after a warm-up run, timed with device events on CUDA.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import warnings
from dataclasses import asdict, dataclass, fields
from datetime import datetime, timezone
from pathlib import Path

import torch

from oxserve.feedback import machine


@dataclass(frozen=True)
class Plan:
    """Sizes and repetitions of one measurement."""

    copy_mib: int  # size of each of the two tensors in the copy (and of the summed one)
    matmul_sizes: tuple[int, ...]  # square sizes tried; the best rate counts
    reps: int


# CPU sizes: well past a 32 MiB L3, and about 2-3 s (full) / 0.3 s (quick) on 2 cores.
_PLANS = {
    ("cpu", False): Plan(copy_mib=256, matmul_sizes=(1024, 2048), reps=5),
    ("cpu", True): Plan(copy_mib=128, matmul_sizes=(1024,), reps=2),
    ("cuda", False): Plan(copy_mib=2048, matmul_sizes=(4096, 8192), reps=10),
    ("cuda", True): Plan(copy_mib=512, matmul_sizes=(4096,), reps=3),
}


@dataclass(frozen=True)
class Ceilings:
    device: str  # "cpu" or "cuda:N"
    device_name: str
    threads: int  # torch intra-op threads used on CPU (1 on CUDA)
    copy_bandwidth: float  # bytes/s, bytes read + written by a large copy
    read_bandwidth: float  # bytes/s, bytes read by a large sum
    matmul_fp32: float  # FLOP/s, torch.matmul
    matmul_bf16: float  # FLOP/s, torch.matmul
    matmul_int8: float | None  # OP/s, torch._int_mm (int8 x int8 -> int32); None: unsupported
    quick: bool
    fingerprint: str
    measured_at: str

    @property
    def memory_bandwidth(self) -> float:
        return max(self.copy_bandwidth, self.read_bandwidth)

    def matmul_rate(self, dtype: str) -> float:
        """Peak rate for "fp32", "bf16" or "int8" products. Narrow operands can always be
        widened and multiplied at a wider type's rate, as oxserve's kernels do for bf16 on CPUs
        without bf16 products (AVX2: there torch's bf16 matmul runs at ~2% of its fp32), so a
        narrower type's peak is at least the wider one's."""
        bf16 = max(self.matmul_bf16, self.matmul_fp32)
        rates = {"fp32": self.matmul_fp32, "bf16": bf16, "int8": max(self.matmul_int8 or 0.0, bf16)}
        if dtype not in rates:
            raise ValueError(f"dtype must be one of {sorted(rates)}, got {dtype!r}")
        return rates[dtype]

    def min_time_s(self, bytes_moved: float, flops: float = 0.0, dtype: str = "bf16") -> float:
        """Roofline lower bound on the time of work that moves `bytes_moved` bytes and
        does `flops` operations at `dtype`: no implementation can be faster."""
        return max(bytes_moved / self.memory_bandwidth, flops / self.matmul_rate(dtype))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Ceilings:
        names = {f.name for f in fields(cls)}
        missing = names - set(data)
        if missing:
            raise ValueError(f"ceilings data lacks {sorted(missing)}")
        return cls(**{k: data[k] for k in names})


def fingerprint(device: str = "cpu") -> str:
    """Identifies the machine and software the ceilings hold for. CPU results also
    depend on the thread count, so it is part of the key."""
    device = _normalise(device)
    key = {
        "hostname": machine.hostname(),
        "cpu_model": machine.cpu_model(),
        "cpu_count": machine.cpu_count(),
        "torch": torch.__version__,
        "device": device,
        "device_name": machine.device_name(device),
        "threads": _threads(device),
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def measure_ceilings(device: str = "cpu", quick: bool = False) -> Ceilings:
    """Measure now (on 2 CPU cores: full ~2-3 s; quick ~0.3 s, rougher)."""
    device = _normalise(device)
    plan = _PLANS[(torch.device(device).type, quick)]
    copy_bw, read_bw = _memory_bandwidth(device, plan)
    return Ceilings(
        device=device,
        device_name=machine.device_name(device),
        threads=_threads(device),
        copy_bandwidth=copy_bw,
        read_bandwidth=read_bw,
        matmul_fp32=_matmul_rate(device, torch.float32, plan),
        matmul_bf16=_matmul_rate(device, torch.bfloat16, plan),
        matmul_int8=_int8_matmul_rate(device, plan),
        quick=quick,
        fingerprint=fingerprint(device),
        measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )


def load_or_measure_ceilings(
    device: str = "cpu",
    cache_dir: str | os.PathLike | None = None,
    refresh: bool = False,
    quick: bool = False,
) -> Ceilings:
    """Cached ceilings for this machine, measuring (and caching) when there are none,
    when `refresh`, or when only a quick measurement is cached and a full one is asked
    for. Cache: <cache_dir or data dir/ceilings>/ceilings-<fingerprint>.json."""
    device = _normalise(device)
    directory = Path(cache_dir) if cache_dir is not None else machine.data_dir() / "ceilings"
    path = directory / f"ceilings-{fingerprint(device)}.json"
    if not refresh:
        cached = _read_cache(path)
        if cached is not None and (quick or not cached.quick):
            return cached
    result = measure_ceilings(device, quick=quick)
    _write_cache(path, result)
    return result


def format_ceilings_table(c: Ceilings) -> str:
    threads = f" ({c.threads} threads)" if c.device == "cpu" else ""
    rows = [
        ("device", f"{c.device}: {c.device_name}{threads}"),
        ("memory copy", _si(c.copy_bandwidth, "B/s") + "  (bytes read + written)"),
        ("memory read", _si(c.read_bandwidth, "B/s")),
        ("matmul fp32", _si(c.matmul_fp32, "FLOP/s")),
        ("matmul bf16", _si(c.matmul_bf16, "FLOP/s")),
        ("matmul int8", _si(c.matmul_int8, "OP/s") if c.matmul_int8 else "unsupported"),
        ("measured", c.measured_at + (" (quick)" if c.quick else "")),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


# --- measurements -------------------------------------------------------------------


def _memory_bandwidth(device: str, plan: Plan) -> tuple[float, float]:
    n = plan.copy_mib * 2**20 // 4
    src = torch.ones(n, dtype=torch.float32, device=device)  # ones: pages touched now
    dst = torch.empty_like(src)
    copy_s = _best_seconds(lambda: dst.copy_(src), device, plan.reps)
    read_s = _best_seconds(lambda: src.sum(), device, plan.reps)
    nbytes = src.numel() * src.element_size()
    return 2 * nbytes / copy_s, nbytes / read_s


# A size whose single call takes longer than this is rate enough: larger sizes are skipped
# and repetitions stop early (a CPU without native bf16 runs a 2048^3 bf16 matmul for ~15 s).
SLOW_CALL_S = 0.5


def _matmul_rate(device: str, dtype: torch.dtype, plan: Plan) -> float:
    best = 0.0
    for n in plan.matmul_sizes:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        seconds = _best_seconds(lambda: torch.matmul(a, b), device, plan.reps)
        best = max(best, 2 * n**3 / seconds)
        if seconds > SLOW_CALL_S:
            break
    return best


def _int8_matmul_rate(device: str, plan: Plan) -> float | None:
    best = 0.0
    for n in plan.matmul_sizes:
        a = torch.randint(-128, 128, (n, n), dtype=torch.int8, device=device)
        b = torch.randint(-128, 128, (n, n), dtype=torch.int8, device=device)
        try:
            seconds = _best_seconds(lambda: torch._int_mm(a, b), device, plan.reps)
        except (RuntimeError, NotImplementedError):  # no int8 kernel on this device/build
            return None
        best = max(best, 2 * n**3 / seconds)
        if seconds > SLOW_CALL_S:
            break
    return best


def _best_seconds(fn, device: str, reps: int) -> float:
    """Shortest of `reps` timed calls after one warm-up (lazy init, page faults); fewer
    repetitions when calls are slow enough that one is already a steady measurement."""
    cuda = torch.device(device).type == "cuda"
    fn()
    if cuda:
        torch.cuda.synchronize(device)
    times = []
    for _ in range(reps):
        if times and min(times) > SLOW_CALL_S:
            break
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return min(times)


# --- helpers ------------------------------------------------------------------------


def _normalise(device: str) -> str:
    dev = torch.device(device)
    if dev.type == "cuda":
        return f"cuda:{dev.index if dev.index is not None else torch.cuda.current_device()}"
    if dev.type != "cpu":
        raise ValueError(f"ceilings are measured on cpu or cuda, got {device!r}")
    return "cpu"


def _threads(device: str) -> int:
    return torch.get_num_threads() if device == "cpu" else 1


def _read_cache(path: Path) -> Ceilings | None:
    """The cached ceilings, or None when absent or unreadable (then re-measured)."""
    try:
        return Ceilings.from_dict(json.loads(path.read_text(encoding="utf-8")))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as e:
        warnings.warn(f"ignoring unreadable ceilings cache {path}: {e}", stacklevel=3)
        return None


def _write_cache(path: Path, c: Ceilings) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(c.to_dict(), indent=1), encoding="utf-8")
        os.replace(tmp, path)  # atomic: readers never see half a file
    except OSError as e:
        # The measurement is still good; only the next run pays for it again.
        warnings.warn(f"could not cache ceilings in {path}: {e}", stacklevel=3)


def _si(value: float, unit: str) -> str:
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= factor:
            return f"{value / factor:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"
