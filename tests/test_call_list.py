"""`CallRun`: recorded native kernel calls made from C give what the ctypes calls give, and a
call that returns another status than recorded fails loudly, naming the kernel."""

import ctypes

import pytest
import torch

from oxserve.kernels import native, rows
from oxserve.kernels.call_list import CallRun, callable_natively


def _kernels():
    lib = rows._kernel()
    return lib.rms_norm_bf16, lib.gather_rows, lib.scatter_rows


def test_a_run_of_calls_computes_what_ctypes_computes():
    """void and int results, pointers given as c_void_p or ints, int64 / int32 / float arguments."""
    norm, gather, scatter = _kernels()
    x, weight = (torch.randn(5, 64) * 3).bfloat16(), (torch.randn(64) + 1).bfloat16()
    table, ids = torch.randn(20, 64).bfloat16(), torch.tensor([3, 0, 19])
    outs = [torch.zeros(5, 64, dtype=torch.bfloat16), torch.zeros(3, 2, 64, dtype=torch.bfloat16), torch.zeros(20, 64, dtype=torch.bfloat16)]

    def calls(out_norm, out_gather, target):
        return [
            (norm, (native.pointer(x), 5, 64, native.pointer(weight), 1e-6, native.pointer(out_norm), 2), None),
            (gather, (table.data_ptr(), 20, ids.data_ptr(), 3, 128, 2, out_gather.data_ptr()), 0),
            (scatter, (target.data_ptr(), 20, ids.data_ptr(), 3, 128, out_gather.data_ptr()), 0),
        ]

    want = [torch.zeros_like(t) for t in outs]
    for function, args, expected in calls(*want):
        assert function(*args) == expected
    assert all(callable_natively(f, args) for f, args, _ in calls(*outs))
    run = CallRun.build(calls(*outs))
    assert run is not None
    run()
    for got, expected in zip(outs, want):
        assert torch.equal(got, expected)
    assert want[2].abs().sum() > 0  # the scatter read the gather's rows: the calls ran in order


def test_a_call_returning_another_status_than_recorded_fails_naming_the_kernel():
    _, gather, scatter = _kernels()
    table, out = torch.zeros(4, 8), torch.zeros(2, 8)
    bad = torch.tensor([1, 7])  # row 7 of 4: the kernel returns -1
    run = CallRun.build([(gather, (table.data_ptr(), 4, bad.data_ptr(), 2, 32, 1, out.data_ptr()), 0)])
    with pytest.raises(RuntimeError, match="gather_rows returned -1, 0 when recorded"):
        run()


def test_calls_libffi_cannot_make_as_ctypes_would_stay_with_ctypes():
    lib = ctypes.CDLL(native.load("rows", rows.BUILD_FLAGS)._name)  # its functions have no argument types
    assert CallRun.build([(lib.gather_rows, (0, 0, 0, 0, 0, 1, 0), 0)]) is None
    assert not callable_natively(lib.gather_rows, (0, 0, 0, 0, 0, 1, 0))
    assert CallRun.build([]) is None
    assert not callable_natively(lambda: None, ())
    norm, gather, _ = _kernels()  # typed, but an argument that does not fit its int32 slot (the thread count)
    assert CallRun.build([(norm, (0, 0, 8, 0, 1e-6, 0, 1 << 40), None)]) is None
    args = (ctypes.c_void_p(0), ctypes.c_int64(0), ctypes.c_void_p(0), 0, 8, 1, None)  # ctypes values unwrapped
    assert CallRun.build([(gather, args, 0)]) is not None
