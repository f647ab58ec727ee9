"""Weights and caches on transparent huge pages (Linux, CPU).

A decode step reads every weight it uses and each request's caches: ~60 MB a step for the
default model at batch 32, some 15,000 pages of 4 KiB. Each page is a TLB miss and a page
walk, and the hardware prefetchers stop at each page's end; on 2 MiB pages the same bytes are
~30 pages. Linux backs anonymous memory with huge pages where THP is enabled ("always", or
"madvise" for ranges so advised) when the pages are first touched; memory already in use is
collapsed only later and slowly (khugepaged). So weights are copied once, after loading, into
one fresh mapping advised before anything touches it, and caches are allocated in such
mappings from the start and zeroed there, committed as torch.zeros' memset commits them (left
to their first write, a step's new cache rows each faulted in a 2 MiB page and the profile's
first decode steps took twice as long).

`OXSERVE_HUGE_PAGES=0` (or false, off, no) turns this off (an A/B: `python
docs/bench/step_ab.py huge-pages BATCH`).
"""

from __future__ import annotations

import functools
import math
import mmap
import os
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from oxserve.engine.memory import release_free_memory

HUGE_PAGE = 2 << 20
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
MIN_TENSOR_BYTES = 64 << 10  # smaller weights stay where they are (norms, biases: a few pages all told)
RELEASE_EVERY = 256 << 20  # freed weight copies given back to the OS this often during a move


@functools.cache
def available() -> bool:
    """Whether THP can back an advised mapping here (and this process has not turned it off)."""
    if os.environ.get("OXSERVE_HUGE_PAGES", "1").lower() in ("0", "false", "off", "no") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in THP_SETTING.read_text()
    except OSError:
        return False


def mapping(nbytes: int) -> torch.Tensor:
    """`nbytes` (uint8) of fresh anonymous memory starting on a huge-page boundary, advised for
    huge pages before any of it is touched; zero until written. The mapping holds whole huge
    pages past the boundary (a last partial one would get 4 KiB pages); the tensor keeps it
    alive (torch.frombuffer holds a reference)."""
    whole_pages = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    region = mmap.mmap(-1, whole_pages + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(region, dtype=torch.uint8)
    start = (-whole.data_ptr()) % HUGE_PAGE
    return whole[start : start + nbytes]


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """torch.zeros, on huge pages where that helps: CPU tensors of a huge page or more,
    committed now (written, as torch.zeros writes them)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes < HUGE_PAGE or not available():
        return torch.zeros(shape, dtype=dtype, device=device)
    return mapping(nbytes).zero_().view(dtype).view(shape)


# ---- moving a loaded model's weights ------------------------------------------------------------

Rebind = Callable[[torch.Tensor], None]


def _replace_in_tuple(module: nn.Module, name: str, i: int) -> Rebind:
    def rebind(new: torch.Tensor) -> None:
        old = module.__dict__[name]
        module.__dict__[name] = old[:i] + (new,) + old[i + 1 :]

    return rebind


def _references(model: nn.Module) -> list[tuple[torch.Tensor, Rebind]]:
    """Every tensor the model's modules hold: parameters, buffers, and plain attributes (a
    tensor, or a tuple of them: packed panels), each with how to put another in its place.
    Tensors held elsewhere (W8A8's packed stacks, which keep raw pointers) stay where they are."""
    found: list[tuple[torch.Tensor, Rebind]] = []
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None:
                found.append((param, lambda new, p=param: setattr(p, "data", new)))
        for name, buffer in module._buffers.items():
            if buffer is not None:
                found.append((buffer, lambda new, m=module, n=name: m._buffers.__setitem__(n, new)))
        for name, value in vars(module).items():
            if isinstance(value, torch.Tensor):
                found.append((value, lambda new, m=module, n=name: m.__dict__.__setitem__(n, new)))
            elif isinstance(value, tuple) and value and all(isinstance(v, torch.Tensor) for v in value):
                found += [(v, _replace_in_tuple(module, name, i)) for i, v in enumerate(value)]
    return found


def _movable(t: torch.Tensor) -> bool:
    return (t.device.type == "cpu" and t.layout == torch.strided and not t.is_mkldnn and not t.is_quantized
            and t.untyped_storage().nbytes() >= MIN_TENSOR_BYTES)  # fmt: skip


Place = tuple[Rebind, torch.dtype, int, torch.Size, tuple[int, ...]]  # where a tensor lies in its storage


def _by_storage(model: nn.Module) -> dict[int, tuple[torch.UntypedStorage, list[Place]]]:
    """The model's movable storages, each with where its tensors lie in it, taken before any
    is moved (a parameter held twice, as tied weights are, is rebound once its storage moves)."""
    groups: dict[int, tuple[torch.UntypedStorage, list[Place]]] = {}
    for t, rebind in _references(model):
        if _movable(t):
            storage = t.untyped_storage()
            groups.setdefault(storage.data_ptr(), (storage, []))[1].append(
                (rebind, t.dtype, t.storage_offset(), t.shape, t.stride()))
    return groups


def move_weights(model: nn.Module) -> int:
    """Copy the model's weights (storages of MIN_TENSOR_BYTES or more) into one huge-page
    mapping and point every module at the copies, views and shared storages kept as they were;
    returns the bytes moved (0 where huge pages are not available). One storage at a time, the
    freed heap given back every RELEASE_EVERY bytes (the engine's malloc settings keep freed
    memory, `engine.memory`): the move never holds much more than one copy of the weights.
    Call it before anything else holds a weight's address (a captured step's recording would
    keep the old one)."""
    if not available():
        return 0
    groups = _by_storage(model)
    total = sum(-(-storage.nbytes() // 64) * 64 for storage, _ in groups.values())  # 64-byte aligned, as torch's
    if total == 0:
        return 0
    arena = mapping(total)
    home = arena.untyped_storage()
    offset = arena.data_ptr() - home.data_ptr()  # where the next storage goes, in the mapping
    freed = 0
    with torch.no_grad():
        for address in list(groups):
            storage, places = groups.pop(address)
            nbytes = storage.nbytes()
            old = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,), (1,))
            torch.empty(0, dtype=torch.uint8).set_(home, offset, (nbytes,), (1,)).copy_(old)
            del storage, old  # (the model's own references go as its tensors are rebound)
            for rebind, dtype, start, shape, stride in places:
                rebind(torch.empty(0, dtype=dtype).set_(home, offset // dtype.itemsize + start, shape, stride))
            offset += -(-nbytes // 64) * 64
            freed += nbytes
            if freed >= RELEASE_EVERY:
                release_free_memory()
                freed = 0
    release_free_memory()
    return total
