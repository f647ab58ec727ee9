"""Runs of recorded native kernel calls, made from C (`native/call_list.c`, through libffi).

A captured decode step repeats ~140 ctypes calls, and ctypes converts every argument of
every call again. A `CallRun` converts them once (ledger 37 of docs/performance.md: batch-1
decode B/A 1.137 with it): each call's function
address, its signature (prepared once per signature) and its arguments in 8-byte slots, so a
replay makes one ctypes call for a whole run of kernel calls. Where libffi's header or a
call's types are missing, calls stay with ctypes (`CallRun.build` returns None for them).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import struct
from typing import Any, Sequence

from oxserve.kernels import native

log = logging.getLogger(__name__)

POINTER, INT64, INT32, FLOAT, DOUBLE, UINT8 = range(6)  # the argument codes of call_list.c
# ctypes argument types -> (code, how the value fills its 8-byte slot)
_CODES: dict[type, int] = {
    ctypes.c_void_p: POINTER, ctypes.c_char_p: POINTER,
    ctypes.c_int64: INT64, ctypes.c_uint64: INT64, ctypes.c_size_t: INT64, ctypes.c_ssize_t: INT64,
    ctypes.c_int32: INT32, ctypes.c_uint32: INT32, ctypes.c_float: FLOAT, ctypes.c_double: DOUBLE,
    ctypes.c_uint8: UINT8, ctypes.c_bool: UINT8,
}  # fmt: skip
_PACK = {POINTER: "Q", INT64: "q", INT32: "i", FLOAT: "f", DOUBLE: "d", UINT8: "B"}
Call = tuple[Any, tuple, Any]  # (ctypes function, its arguments, the result it must return)


@functools.cache
def _library() -> ctypes.CDLL | None:
    try:
        native.team()  # (first: a run's calls put their regions on it)
        lib = native.load("call_list", ("-O2",), libraries=("ffi",))
    except RuntimeError as e:  # no libffi header: the calls stay with ctypes
        log.warning("oxserve: native call runs unavailable (%s); replays call each kernel through ctypes", e)
        return None
    if lib is None:
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.prepare_call.argtypes, lib.prepare_call.restype = [ctypes.c_int, p, ctypes.c_int], p
    lib.run_calls.argtypes, lib.run_calls.restype = [i64, p, p, p, p, p, p], i64
    return lib


@functools.cache
def _signature(codes: tuple[int, ...], returns_int: bool) -> int | None:
    """The prepared call interface of a signature (address), kept for the process's life."""
    lib = _library()
    if lib is None:
        return None
    types = (ctypes.c_uint8 * max(len(codes), 1))(*codes)
    return lib.prepare_call(len(codes), types, int(returns_int)) or None


def _describe(function, args: tuple) -> tuple[tuple[int, ...], bool] | None:
    """(argument codes, whether its int result is checked) of a recorded call, or None when
    libffi cannot make it as ctypes would (no or unknown argument types, another result type)."""
    argtypes, restype = getattr(function, "argtypes", None), getattr(function, "restype", ctypes.c_int)
    if argtypes is None or len(argtypes) != len(args) or restype not in (None, ctypes.c_int):
        return None
    codes = tuple(_CODES.get(t) for t in argtypes)
    return None if None in codes else (codes, restype is ctypes.c_int)


def _slot_value(code: int, value):
    if isinstance(value, ctypes._SimpleCData):  # c_void_p(address), c_int64(n), ...
        value = value.value
    if code == POINTER:
        return value or 0
    return float(value) if code in (FLOAT, DOUBLE) else int(value)


class CallRun:
    """Consecutive recorded native calls, run by one ctypes call."""

    def __init__(self, calls: Sequence[Call], described: list[tuple[tuple[int, ...], bool]], cifs: list[int]):
        n, total = len(calls), sum(len(codes) for codes, _ in described)
        self.names = [getattr(function, "__name__", str(function)) for function, _, _ in calls]
        self.slots = ctypes.create_string_buffer(8 * max(total, 1))
        self.slot_pointers = (ctypes.c_void_p * max(total, 1))()
        self.arg_lists = (ctypes.c_void_p * n)()
        self.functions = (ctypes.c_void_p * n)(*(ctypes.cast(f, ctypes.c_void_p).value for f, _, _ in calls))
        self.cifs = (ctypes.c_void_p * n)(*cifs)
        self.expected = (ctypes.c_int64 * n)(*(int(r) if check else 0 for (_, _, r), (_, check) in zip(calls, described)))
        self.checks = (ctypes.c_uint8 * n)(*(int(check) for _, check in described))
        base, slot_base, k = ctypes.addressof(self.slots), ctypes.addressof(self.slot_pointers), 0
        for i, ((_, args, _), (codes, _)) in enumerate(zip(calls, described)):
            self.arg_lists[i] = slot_base + 8 * k
            for code, value in zip(codes, args):
                struct.pack_into("<" + _PACK[code], self.slots, 8 * k, _slot_value(code, value))
                self.slot_pointers[k] = base + 8 * k
                k += 1
        self.got = ctypes.c_int64()
        self._args = (n, self.functions, self.cifs, self.arg_lists, self.expected, self.checks, ctypes.byref(self.got))

    @classmethod
    def build(cls, calls: Sequence[Call]) -> "CallRun | None":
        """A run of these calls, or None where one of them cannot be made from C (an argument
        that does not fit its slot as ctypes would pass it included)."""
        described = [_describe(function, args) for function, args, _ in calls]
        if not calls or None in described:
            return None
        cifs = [_signature(codes, check) for codes, check in described]
        if None in cifs:
            return None
        try:
            return cls(calls, described, cifs)
        except (struct.error, TypeError, ValueError, OverflowError):
            return None

    def __call__(self) -> None:
        failed = _library().run_calls(*self._args)
        if failed >= 0:
            raise RuntimeError(f"captured step: {self.names[failed]} returned {self.got.value}, "
                               f"{self.expected[failed]} when recorded")  # fmt: skip


def callable_natively(function, args: tuple) -> bool:
    """A recorded native kernel call (a ctypes function with argument types libffi can make)
    that a `CallRun` may take."""
    return isinstance(function, ctypes._CFuncPtr) and _library() is not None and _describe(function, args) is not None
