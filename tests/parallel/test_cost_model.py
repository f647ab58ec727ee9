"""The parallel cost model: its collectives are the ones the model code makes, its fits recover
latency and bandwidth, and its memory accounting follows the ranks' real cache specs."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from tiny_models import two_mla_checkpoint

from oxserve.bench.parallel import _rank_memory
from oxserve.model.config import TextModelConfig
from oxserve.model.loader import load_model
from oxserve.parallel.cost_model import (
    Curve,
    Layout,
    PieceAlone,
    measure_collectives,
    step_collectives,
    timed_forward,
)
from oxserve.parallel.layer_split import LayerSplit


@dataclass(frozen=True)
class CountingPiece(PieceAlone):
    calls: list = field(default_factory=list, compare=False)

    def reduce(self, x):
        if self.size > 1:
            self.calls.append(("all_reduce", x.numel() * 4))
        return x

    def gather_to_first(self, x):
        if self.size > 1:
            self.calls.append(("gather", x.numel() * 4))
        return x


@dataclass(frozen=True)
class CountingSplit(LayerSplit):
    calls: list = field(default_factory=list, compare=False)

    def share(self, x, owner):
        self.calls.append(("broadcast", x.numel() * x.element_size()))
        return x


@pytest.mark.parametrize("layout", [Layout(2), Layout(1, 2)], ids=str)
def test_the_step_collectives_are_the_model_codes(tiny_model_dir, tmp_path, layout):
    batch, context = 3, 40
    tp, ls = CountingPiece(0, layout.tp), CountingSplit(0, layout.ls)
    # Layer Split needs two MLA layer groups: the tiny shape with 8 layers.
    path = tiny_model_dir if layout.ls == 1 else two_mla_checkpoint(tmp_path / "two-mla")
    model = load_model(path, dtype=torch.float32, tp=tp, ls=ls).model
    timed_forward(model, batch, context, steps=1)
    made = sorted(tp.calls + ls.calls)
    steps = 3  # timed_forward runs two warm-up steps and one timed
    predicted = [c for c in step_collectives(model.config, layout, batch, context, 4) if c[0] != "message"]
    assert made == sorted(predicted * steps)


def test_a_curve_interpolates_between_measured_sizes_and_extrapolates_past_them():
    curve = Curve(((1024, 1e-4), (4096, 4e-4), (16384, 5e-4)))
    assert curve.time(512) == pytest.approx(1e-4)  # below the smallest: its time
    assert curve.time(2560) == pytest.approx(2.5e-4)
    assert curve.time(28672) == pytest.approx(6e-4)  # the last segment's slope
    line = Curve.linear(20e-6, 1e9)
    assert line.time(1e6) == pytest.approx(20e-6 + 1e-3)


def test_collectives_are_measured_between_real_processes(tmp_path):
    costs = measure_collectives(2, tmp_path, repeats=3)
    assert costs.backend == "gloo" and set(costs.curves) == {"all_reduce", "broadcast", "gather", "message"}
    for curve in costs.curves.values():
        assert [size for size, _ in curve.points] == sorted({size for size, _ in curve.points})
        assert 0 < curve.latency_s < 1 and curve.bytes_per_s > 1e6


def test_glm_5_3_flash_memory_per_rank_follows_the_cut():
    cfg = TextModelConfig.from_hf_dict({})
    w1, token1, state1 = _rank_memory(cfg, Layout(1))
    w8, token8, state8 = _rank_memory(cfg, Layout(8))
    assert 300e9 * 2 < w1 < 340e9 * 2  # about 321B parameters in bf16
    assert w1 / 8 < w8 < w1 / 8 * 1.05  # all but the replicated norms, mHC, router and latent projection
    assert token8 == token1  # tensor parallelism replicates the MLA latent
    assert state8 == pytest.approx(state1 / 8)  # and cuts the KDA states by head
    _, token_ls2, _ = _rank_memory(cfg, Layout(8, 2))
    assert token_ls2 == pytest.approx(token1 * 6 / 11)  # the fullest of two ranks owns 6 of 11 MLA layers
