"""`native/team.c`: the kernels' OpenMP regions inside a run of native calls go to its spinning
team, elsewhere to libgomp, with OpenMP's semantics either way (a C test library built as the
kernels are: their flags, their --wrap links)."""

from __future__ import annotations

import ctypes
import subprocess
import time

import numpy as np
import pytest

from oxserve import LLM, SamplingParams
from oxserve.kernels import native

SOURCE = r"""
#include <omp.h>
#include <stdint.h>

/* owner[i], size[i]: the thread that ran iteration i and its team's size */
void dynamic_loop(int64_t n, int threads, int chunk, int32_t *owner, int32_t *size) {
    #pragma omp parallel for num_threads(threads) schedule(dynamic, chunk)
    for (int64_t i = 0; i < n; i++) { owner[i] = omp_get_thread_num(); size[i] = omp_get_num_threads(); }
}

void descending_loop(int64_t n, int threads, int32_t *count) {
    #pragma omp parallel for num_threads(threads) schedule(dynamic, 2)
    for (int64_t i = n - 1; i >= 0; i--) count[i] += 1;
}

void static_loop(int64_t n, int threads, int32_t *owner) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; i++) owner[i] = omp_get_thread_num();
}

/* Two runtime-scheduled loops in one region: the second reads what other threads wrote in
 * the first (the loop's barrier), then a barrier and a third loop reads the second's. */
void runtime_loops(int64_t n, int threads, int kind, int chunk, int32_t *owner, int32_t *a, int32_t *b, int32_t *c) {
    omp_set_schedule((omp_sched_t)kind, chunk);
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(runtime)
        for (int64_t i = 0; i < n; i++) { a[i] = (int32_t)(3 * i + 1); owner[i] = omp_get_thread_num(); }
        #pragma omp for schedule(runtime) nowait
        for (int64_t i = 0; i < n; i++) b[i] = a[n - 1 - i] * 2;
        #pragma omp barrier
        #pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n; i++) c[i] = b[n - 1 - i] + 1;
    }
}

/* A region inside a region: the inner one runs on its calling thread alone. */
void nested(int threads, int32_t *inner_sizes) {
    #pragma omp parallel num_threads(threads)
    {
        const int outer = omp_get_thread_num();
        #pragma omp parallel num_threads(threads)
        { inner_sizes[outer] = omp_get_num_threads(); }
    }
}
"""


def build(folder, name: str, source: str):
    (folder / f"{name}.c").write_text(source)
    library = folder / f"{name}.so"
    subprocess.run([native.compiler(), *native.FLAGS, *native.OPENMP, "-o", str(library), str(folder / f"{name}.c"),
                    *native.TEAM_LINKS], check=True)  # fmt: skip
    return library


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    """The team (runs fork on it whenever they come: libgomp's spin window set to 0, restored
    after) and the test loops."""
    team = native.team()
    assert team is not None, "the team library must load where a C compiler is (CI has one)"
    lib = ctypes.CDLL(str(build(tmp_path_factory.mktemp("team"), "loops", SOURCE)))
    team.team_set_libgomp_spin(0)
    yield team, lib
    team.team_set_libgomp_spin(native.libgomp_spin_ns())


def begin_on_team(team) -> None:
    assert team.team_begin() == 1


def ints(n: int) -> np.ndarray:
    return np.full(n, -1, dtype=np.int32)


def ptr(a: np.ndarray):
    return a.ctypes.data_as(ctypes.c_void_p)


@pytest.fixture(params=["team", "libgomp"])
def place(request, kernels):
    """Calls inside a run (team_begin .. team_end: the team) or outside (libgomp)."""
    team, _ = kernels

    def call(threads: int, function, *args):
        """Runs function(*args), whose regions have `threads` threads: with 2+ on the team,
        its regions counted there."""
        before = team.team_regions()
        if request.param == "team":
            begin_on_team(team)
            try:
                function(*args)
            finally:
                team.team_end()
        else:
            function(*args)
        assert (team.team_regions() > before) == (request.param == "team" and threads > 1)

    return call


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("n,chunk", [(0, 1), (1, 1), (7, 1), (1000, 3), (1001, 64)])
def test_dynamic_loops_cover_each_iteration_once(kernels, place, threads, n, chunk):
    _, lib = kernels
    owner, size = ints(n), ints(n)
    lib.dynamic_loop.argtypes = [ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    place(threads, lib.dynamic_loop, n, threads, chunk, ptr(owner), ptr(size))
    assert (owner >= 0).all() and (owner < threads).all()
    assert (size == threads).all()
    count = np.zeros(n, dtype=np.int32)
    lib.descending_loop.argtypes = [ctypes.c_int64, ctypes.c_int, ctypes.c_void_p]
    place(threads, lib.descending_loop, n, threads, ptr(count))
    assert (count == 1).all()


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("n", [1, 5, 10, 1001])
def test_static_loops_deal_as_libgomp(kernels, threads, n):
    """A static loop's and a runtime-static loop's iterations go to the same threads on the
    team as on libgomp (kernels that prefetch a thread's next task rely on the deal)."""
    team, lib = kernels
    lib.static_loop.argtypes = [ctypes.c_int64, ctypes.c_int, ctypes.c_void_p]
    lib.runtime_loops.argtypes = [ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int] + [ctypes.c_void_p] * 4
    deals = []
    for on_team in (True, False):
        static, owner, a, b, c = (ints(n) for _ in range(5))
        if on_team:
            begin_on_team(team)
        lib.static_loop(n, threads, ptr(static))
        lib.runtime_loops(n, threads, 1, 1, ptr(owner), ptr(a), ptr(b), ptr(c))  # static, chunk 1: round robin
        block = ints(n)
        lib.runtime_loops(n, threads, 1, 0, ptr(block), ptr(a), ptr(b), ptr(c))  # static, no chunk: blocks
        if on_team:
            team.team_end()
        deals.append((static, owner, block))
    for on_team, on_libgomp in zip(*deals):
        np.testing.assert_array_equal(on_team, on_libgomp)
    np.testing.assert_array_equal(deals[0][1], np.arange(n) % threads)


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("kind,chunk", [(1, 1), (1, 0), (1, 7), (2, 1), (2, 5), (3, 2)])
def test_runtime_loops_and_barriers(kernels, place, threads, kind, chunk):
    """Each loop sees all of the one before it: the loop's barrier, and an explicit one after a
    nowait loop."""
    _, lib = kernels
    n = 257
    owner, a, b, c = (ints(n) for _ in range(4))
    lib.runtime_loops.argtypes = [ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int] + [ctypes.c_void_p] * 4
    for _ in range(20):  # (a lost barrier shows only now and then)
        for values in (owner, a, b, c):
            values[:] = -1
        place(threads, lib.runtime_loops, n, threads, kind, chunk, ptr(owner), ptr(a), ptr(b), ptr(c))
        expected_a = 3 * np.arange(n) + 1
        np.testing.assert_array_equal(a, expected_a)
        np.testing.assert_array_equal(b, expected_a[::-1] * 2)
        np.testing.assert_array_equal(c, expected_a * 2 + 1)
    assert set(owner) == set(range(threads)) if kind == 1 else (owner >= 0).all()


def test_nested_regions_run_alone(kernels, place):
    _, lib = kernels
    sizes = ints(2)
    lib.nested.argtypes = [ctypes.c_int, ctypes.c_void_p]
    place(2, lib.nested, 2, ptr(sizes))
    np.testing.assert_array_equal(sizes, [1, 1])


def test_runs_near_a_libgomp_region_stay_on_libgomp(kernels):
    """Its workers still spin: two spinning teams would take turns on the cores. The regions
    of runs that stayed there do not keep later runs off the team."""
    team, lib = kernels
    owner, size = ints(64), ints(64)
    lib.dynamic_loop.argtypes = [ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    team.team_set_libgomp_spin(200_000_000)  # libgomp's workers said to spin 200 ms after a region
    try:
        lib.dynamic_loop(64, 2, 1, ptr(owner), ptr(size))  # on libgomp (no run)
        eager_end = time.perf_counter()
        before = team.team_regions()
        while time.perf_counter() - eager_end < 0.1:  # runs on libgomp, each with a region
            try:
                assert team.team_begin() == 0
                lib.dynamic_loop(64, 2, 1, ptr(owner), ptr(size))
            finally:
                team.team_end()
            assert team.team_regions() == before and (size == 2).all()
            time.sleep(0.005)
        time.sleep(max(0.0, 0.21 - (time.perf_counter() - eager_end)))  # past the eager region's 200 ms, not the runs'
        try:
            assert team.team_begin() == 1
            lib.dynamic_loop(64, 2, 1, ptr(owner), ptr(size))
        finally:
            team.team_end()
        assert team.team_regions() == before + 1 and (size == 2).all()
    finally:
        team.team_set_libgomp_spin(0)


@pytest.mark.parametrize("env,expected", [({}, 300_000 * native.PAUSE_NS + 500_000),
                                          ({"GOMP_SPINCOUNT": "20000"}, 20_000 * native.PAUSE_NS + 500_000),
                                          ({"GOMP_SPINCOUNT": "20k"}, 20_000 * native.PAUSE_NS + 500_000),
                                          ({"GOMP_SPINCOUNT": "infinity"}, 2**63),
                                          ({"OMP_WAIT_POLICY": "ACTIVE"}, 2**63),
                                          ({"OMP_WAIT_POLICY": "passive"}, 0),
                                          ({"OMP_WAIT_POLICY": "passive", "GOMP_SPINCOUNT": "5"}, 5 * native.PAUSE_NS + 500_000)])
def test_libgomp_spin_from_its_settings(monkeypatch, env, expected):
    for name in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert native.libgomp_spin_ns() == expected


def test_a_replayed_step_runs_its_regions_on_the_team(kernels):
    """Captured decode steps (runs of native calls) fork on the team; their tokens are the
    eager engine's."""
    team, _ = kernels
    prompts = [[40 + (7 * i + j) % 500 for j in range(60 + 9 * i)] for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)  # (runs past libgomp's spin)
    outputs = {}
    for eager in (True, False):
        llm = LLM(threads=2, enforce_eager=eager)
        before = team.team_regions()
        outputs[eager] = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
        regions = team.team_regions() - before
        llm.close()
        assert (regions == 0) if eager else (regions > 0)
    assert outputs[True] == outputs[False]


def test_a_kernel_calling_an_entry_point_not_wrapped_is_found(tmp_path):
    """GCC lowers a combined loop with constant bounds to GOMP_parallel_loop_*, which the team
    does not wrap: `native.load` refuses such a kernel (its regions would skip the team's
    bookkeeping), so the kernels' pragmas stay within what team.c handles."""
    combined = build(tmp_path, "combined", SOURCE.split("/* owner[i]")[0] + """
void combined(int32_t *out) {
    #pragma omp parallel for num_threads(2) schedule(dynamic, 4)
    for (int i = 0; i < 4000; i++) out[i] = i;
}
""")
    assert any(name.startswith("GOMP_parallel_loop") for name in native.unwrapped_openmp_calls(combined))
    assert native.unwrapped_openmp_calls(build(tmp_path, "loops", SOURCE)) == []
