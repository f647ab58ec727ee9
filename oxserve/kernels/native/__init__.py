"""Small C kernels for CPU hot spots that eager torch runs as many tiny ops.

Each kernel is one C file in this package, compiled on first use with the system C compiler
(`cc`, or `$CC`) into `$OXSERVE_CACHE_DIR/native` (default `~/.cache/oxserve/native`),
named by a hash of source, the package's headers, flags and (for `-march=native` builds) the CPU, so an edit
rebuilds it and parallel processes share one build. Plain C with no torch headers: it builds in well under a second, and is called
through ctypes on tensors' data pointers. Where no compiler is found, `load` returns None
and callers run their torch version (which is also what the kernels are tested against).

Inside `recording(record)`, every call of every loaded kernel also reaches `record(function,
args, result)` after it runs: how a decode step is captured for replay (`oxserve.engine.capture`).
Outside one, calls go straight to ctypes at no extra cost.

The kernels' OpenMP regions go to `team.c` (see `team`): inside a replay's run of native calls
they fork and join on spinning threads; elsewhere on libgomp, with torch's ops.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

log = logging.getLogger(__name__)

# -fno-trapping-math: no kernel reads floating-point exception flags, and with them gcc will not
# if-convert a loop whose arithmetic sits under a branch, which left every loop calling vexp
# (its clamps become branches) scalar. Values are unchanged: no reassociation, no contraction.
# -ffp-contract=off says the latter outright: gcc keeps a * b + c two roundings under -std=c11
# anyway, but clang ($CC) and gcc's GNU modes would fuse it, and kernels that must give the
# torch form's floats (the sampler's penalties) need the two roundings.
FLAGS = ("-O2", "-fPIC", "-shared", "-std=c11", "-fno-trapping-math", "-ffp-contract=off")
# Kernels that need vector instructions are built for the CPU they run on.
NATIVE_ISA = ("-march=native",)
# OpenMP: the kernels' regions run on `team.c`'s spinning threads (see `team`), their calls of
# these entry points bound to its __wrap_ versions; libgomp (torch's: its soname is loaded
# first) gives them omp_get_max_threads.
OPENMP = ("-fopenmp",)
TEAM_ENTRY_POINTS = ("GOMP_parallel", "GOMP_barrier", "GOMP_loop_end", "GOMP_loop_end_nowait",
                     "GOMP_loop_dynamic_start", "GOMP_loop_dynamic_next", "GOMP_loop_nonmonotonic_dynamic_start",
                     "GOMP_loop_nonmonotonic_dynamic_next", "GOMP_loop_runtime_start", "GOMP_loop_runtime_next",
                     "GOMP_loop_maybe_nonmonotonic_runtime_start", "GOMP_loop_maybe_nonmonotonic_runtime_next",
                     "omp_get_thread_num", "omp_get_num_threads", "omp_set_schedule")  # fmt: skip
TEAM_LINKS = ("-Wl," + ",".join(f"--wrap={name}" for name in TEAM_ENTRY_POINTS),)


def cache_dir() -> Path:
    root = os.environ.get("OXSERVE_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "oxserve") / "native"


def compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc"))


def cpu_identity() -> bytes:
    """What `-march=native` depends on: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return b""
    return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))})).encode()


@functools.cache
def load(name: str, extra_flags: tuple[str, ...] = (), libraries: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The compiled kernel library `name` (from `name.c`) built with FLAGS + extra_flags and
    linked with `libraries` ("ffi": -lffi; linker options as they are), or None without a C
    compiler."""
    cc = compiler()
    if cc is None:
        log.warning("no C compiler (cc / $CC): native kernel %s unavailable, using the torch version", name)
        return None
    if "-fopenmp" in extra_flags and name != "team" and team() is not None:
        libraries = (*libraries, *TEAM_LINKS)
    source = Path(__file__).with_name(f"{name}.c")
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))  # what sources may include
    flags = (*FLAGS, *extra_flags)
    links = tuple(library if library.startswith("-") else f"-l{library}" for library in (*libraries, "m"))
    machine = cpu_identity() if "-march=native" in flags else b""
    digest = hashlib.sha256(source.read_bytes() + headers + " ".join(flags + links).encode() + machine).hexdigest()[:16]
    target = cache_dir() / f"{name}-{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            result = subprocess.run([cc, *flags, "-o", str(built), str(source), *links], capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"compiling native kernel {name} failed:\n{result.stderr}")
            if TEAM_LINKS[0] in links and (stray := unwrapped_openmp_calls(built)):
                raise RuntimeError(f"native kernel {name} calls OpenMP entry points team.c does not wrap: {stray}")
            os.replace(built, target)  # atomic: a concurrent build just replaces an identical file
    library = NativeLibrary(str(target))
    _LIBRARIES.append(library)
    return library


def unwrapped_openmp_calls(library: Path) -> list[str]:
    """The libgomp entry points a kernel built with TEAM_LINKS still calls by their own name
    (GCC lowers some pragmas to others, e.g. GOMP_parallel_loop_* for a combined loop with
    constant bounds): those would run outside the team's bookkeeping. Needs binutils' nm."""
    nm = shutil.which("nm")
    if nm is None:
        return []
    listed = subprocess.run([nm, "-D", "--undefined-only", str(library)], capture_output=True, text=True).stdout
    names = {line.split()[-1].split("@")[0] for line in listed.splitlines() if line.strip()}
    return sorted(n for n in names if n.startswith(("GOMP_", "omp_")) and n != "omp_get_max_threads")


@functools.cache
def team() -> ctypes.CDLL | None:
    """`team.c`, loaded with RTLD_GLOBAL before any OpenMP kernel and `call_list` (whose runs
    put the kernels' regions on its spinning threads, without libgomp's syscalls; its header
    says what it keeps of OpenMP); None with OXSERVE_OMP_TEAM=0 (the kernels stay on libgomp)
    or without a C compiler."""
    if os.environ.get("OXSERVE_OMP_TEAM", "1") == "0":
        return None
    try:
        built = load("team", ("-pthread", "-fopenmp"))
    except RuntimeError as e:  # the kernels still build, on libgomp
        log.warning("oxserve: the kernels' thread team is unavailable (%s); their regions stay on libgomp", e)
        return None
    if built is None:
        return None
    library = ctypes.CDLL(built._name, mode=ctypes.RTLD_GLOBAL)
    library.team_regions.restype = ctypes.c_uint
    library.team_set_libgomp_spin.argtypes = [ctypes.c_uint64]
    library.team_set_libgomp_spin(libgomp_spin_ns())
    return library


PAUSE_NS = 100  # a bound on one spin of libgomp's (a `pause`: ~30 ns on Zen 4, 140 cycles on Intel since Skylake)
SPIN_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def libgomp_spin_ns() -> int:
    """How long torch's libgomp threads may spin after a parallel region, from the settings
    libgomp read (oxserve/__init__.py sets GOMP_SPINCOUNT where torch is not loaded yet): a
    GOMP_SPINCOUNT (libgomp's suffixes k, M, G, T) over OMP_WAIT_POLICY, else 300,000 spins."""
    count = os.environ.get("GOMP_SPINCOUNT", "").strip().lower()
    policy = os.environ.get("OMP_WAIT_POLICY", "").strip().lower()
    if not count:
        count = {"passive": "0", "active": "infinity"}.get(policy, "300000")
    if count.startswith("infinit"):
        return 2**63  # (they never sleep: runs stay on libgomp after an eager region)
    try:
        spins = int(count[:-1]) * SPIN_SUFFIXES[count[-1]] if count[-1:] in SPIN_SUFFIXES else int(count)
    except ValueError:
        spins = 300_000
    return spins * PAUSE_NS + 500_000 if spins else 0


Record = Callable[[Any, tuple, Any], None]  # (ctypes function, its arguments, what it returned)
_LIBRARIES: list["NativeLibrary"] = []  # every library `load` returned
_recording: list[Record] = []  # the active recording's callback, if any


class RecordedCall:
    """A kernel function standing in for itself while a recording is on: runs, then reports."""

    __slots__ = ("function", "record")

    def __init__(self, function, record: Record):
        object.__setattr__(self, "function", function)
        object.__setattr__(self, "record", record)

    def __call__(self, *args):
        result = self.function(*args)
        self.record(self.function, args, result)
        return result

    def __getattr__(self, name: str):
        return getattr(self.function, name)

    def __setattr__(self, name: str, value) -> None:  # argtypes / restype set while recording
        setattr(self.function, name, value)


class NativeLibrary(ctypes.CDLL):
    """A kernel library: ctypes caches each function on the instance at first use, and while
    a recording is on, a function first used then is cached as its recording stand-in."""

    def __getattr__(self, name: str):
        function = super().__getattr__(name)
        if _recording:
            stand_in = RecordedCall(function, _recording[-1])
            setattr(self, name, stand_in)
            return stand_in
        return function


@contextmanager
def recording(record: Record) -> Iterator[None]:
    """Report every kernel call made inside to `record` (one recording at a time)."""
    if _recording:
        raise RuntimeError("a native recording is already on")
    _recording.append(record)
    for library in _LIBRARIES:
        for name, value in list(vars(library).items()):
            if isinstance(value, ctypes._CFuncPtr):
                setattr(library, name, RecordedCall(value, record))
    try:
        yield
    finally:
        _recording.clear()
        for library in _LIBRARIES:
            for name, value in list(vars(library).items()):
                if isinstance(value, RecordedCall):
                    setattr(library, name, value.function)


def pointer(tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(tensor.data_ptr())
