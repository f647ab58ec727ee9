"""Weights and caches on transparent huge pages: the same values where they were, the same
tokens from an engine, and huge pages behind them where the kernel offers THP (elsewhere,
the plain allocations they replace)."""

from __future__ import annotations

import torch
from torch import nn

from oxserve import LLM, SamplingParams, huge_pages


def huge_page_kb(address: int) -> int:
    """AnonHugePages of the mapping holding `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            first = line.split()[0]
            if "-" in first and ":" not in first:  # a mapping's header: "start-end perms ..."
                start, end = (int(x, 16) for x in first.split("-"))
                inside = start <= address < end
            elif inside and first == "AnonHugePages:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def on_huge_pages(t: torch.Tensor) -> bool:
    return huge_page_kb(t.data_ptr()) >= 2048


def test_zeros_come_on_huge_pages_and_small_ones_as_before():
    big = huge_pages.zeros((3, 1 << 20), torch.float32, "cpu")
    assert big.shape == (3, 1 << 20) and big.dtype == torch.float32 and not big.any()
    big.fill_(1.0)  # pages are committed as they are written
    if huge_pages.available():
        assert big.data_ptr() % huge_pages.HUGE_PAGE == 0 and on_huge_pages(big)
    small = huge_pages.zeros((4, 8), torch.bfloat16, "cpu")
    assert small.shape == (4, 8) and small.dtype == torch.bfloat16 and not small.any()


class Holder(nn.Module):
    """Weights held every way a model holds them: parameters (one a view of another's
    storage, one held by a child module too, as tied weights are), a buffer, a plain tensor
    attribute, a tuple of packed tensors, and a small one."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
        self.a = nn.Parameter(torch.randn(512, 300, generator=g), requires_grad=False)
        self.b = nn.Parameter(self.a.data[100:200, 7:], requires_grad=False)  # same storage, offset, strided
        self.register_buffer("panels", torch.randn(70_000, generator=g).bfloat16())
        self.plain = torch.randint(-100, 100, (40_000,), generator=g, dtype=torch.int32)
        self.packed = (torch.randn(256, 256, generator=g), torch.randn(128, 512, generator=g).bfloat16())
        self.norm = nn.Parameter(torch.randn(64, generator=g))
        self.c = nn.Parameter(torch.randn(300, 200, generator=g), requires_grad=False)  # moved after a: not at offset 0
        self.child = nn.Module()
        self.child.tied = self.c


def test_moved_weights_keep_their_values_views_and_parameters(monkeypatch):
    """The move runs wherever the test does (huge pages asked for or not); where THP is on,
    the copies lie on huge pages."""
    thp = huge_pages.available()
    monkeypatch.setattr(huge_pages, "available", lambda: True)
    holder = Holder()
    before = {name: t.clone() for name, t in holder.state_dict().items()}
    before["plain"], before["packed"] = holder.plain.clone(), tuple(t.clone() for t in holder.packed)
    a_param, c_param, norm_address = holder.a, holder.c, holder.norm.data_ptr()
    moved = huge_pages.move_weights(holder)
    assert moved >= 512 * 300 * 4 + 300 * 200 * 4 + 70_000 * 2 + 40_000 * 4 + 256 * 256 * 4 + 128 * 512 * 2
    assert holder.a is a_param and holder.child.tied is c_param is holder.c and isinstance(holder.b, nn.Parameter)
    assert not holder.a.requires_grad
    for name, t in holder.state_dict().items():
        assert torch.equal(t, before[name]), name
    assert torch.equal(holder.plain, before["plain"]) and all(map(torch.equal, holder.packed, before["packed"]))
    assert holder.b.untyped_storage().data_ptr() == holder.a.untyped_storage().data_ptr()  # still one storage
    assert holder.b.data_ptr() == holder.a[100, 7].data_ptr() and holder.b.stride() == (300, 1)
    holder.a.data[150, 10] = 7.0
    assert holder.b[50, 3] == 7.0
    assert holder.norm.data_ptr() == norm_address  # below MIN_TENSOR_BYTES: left where it was
    assert not thp or all(on_huge_pages(t) for t in (holder.a, holder.panels, holder.plain, *holder.packed))


def test_an_engine_on_huge_pages_generates_what_one_on_small_pages_does(monkeypatch):
    prompts = ["def fibonacci(n):", "The quick brown fox " * 12]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    runs = []
    for setting in ("0", "1"):
        monkeypatch.setenv("OXSERVE_HUGE_PAGES", setting)
        huge_pages.available.cache_clear()
        llm = LLM(dtype="bfloat16", threads=2)
        huge_pages.available.cache_clear()  # (the next test reads the environment as it is then)
        try:
            runs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)])
            runner = llm.engine.runner
            tensors = [*runner.model.parameters(), *runner.model.buffers()]
            largest = max(tensors, key=lambda t: t.untyped_storage().nbytes())  # the experts' panels, or the LM head
            if setting == "1" and huge_pages.available():  # (read again: the environment says "1")
                assert on_huge_pages(largest) and on_huge_pages(runner.kda_caches[0].recurrent)
        finally:
            llm.close()
    assert runs[0] == runs[1]
