"""int8/fp8 cache rows stored by the native pass (`kernels.rows.scaled_store_native`, what
`ScaledRows.store` runs on CPU) exactly as the torch form (`ScaledRows.quantize`) stores them:
values and scales bit for bit, ties included."""

from __future__ import annotations

import pytest
import torch

from oxserve.cache.layers import FP8, NATIVE_KINDS, ScaledRows
from oxserve.kernels.rows import scaled_store_fit, scaled_store_native

KINDS = pytest.mark.parametrize("kind", [torch.int8, FP8], ids=["int8", "fp8"])


def _torch_stored(kind: torch.dtype, rows: torch.Tensor, x: torch.Tensor, table_rows: int) -> ScaledRows:
    table = ScaledRows.zeros(table_rows, x.shape[-1], kind, torch.float32, "cpu")
    values, scales = table.quantize(x.reshape(rows.numel(), -1))
    table.values.index_copy_(0, rows, values)
    table.scales.index_copy_(0, rows, scales)
    return table


def _native_stored(kind: torch.dtype, rows: torch.Tensor, x: torch.Tensor, table_rows: int) -> ScaledRows:
    table = ScaledRows.zeros(table_rows, x.shape[-1], kind, torch.float32, "cpu")
    assert scaled_store_fit(table.values, table.scales, x)
    scaled_store_native(table.values, table.scales, NATIVE_KINDS[kind], rows, x)
    return table


def _same(a: ScaledRows, b: ScaledRows) -> bool:
    return torch.equal(a.values, b.values) and torch.equal(a.scales, b.scales)


@KINDS
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dim", [1, 40, 64, 300])
def test_random_rows_store_as_torch_stores_them(kind, dtype, dim):
    """Row magnitudes spread over 1e-4 .. 1e3 (fp8 subnormals among them), a row of zeros."""
    gen = torch.Generator().manual_seed(dim)
    x = (torch.randn(24, dim, generator=gen) * 10.0 ** (torch.rand(24, 1, generator=gen) * 7 - 4)).to(dtype)
    x[5] = 0
    rows = torch.randperm(40, generator=gen)[:24]
    assert _same(_native_stored(kind, rows, x, 40), _torch_stored(kind, rows, x, 40))


def test_fp8_ties_go_to_the_even_byte():
    """Scale 1 (the row's largest value is 448): every midpoint between neighbouring e4m3
    values, subnormal ones too, both signs, and values just off them."""
    values = torch.arange(0x7F, dtype=torch.int32).to(torch.uint8).view(FP8).float()  # 0 .. 448
    midpoints = (values[1:] + values[:-1]) / 2
    row = torch.cat([torch.tensor([448.0, -448.0]), midpoints, -midpoints, midpoints * (1 + 2**-20), midpoints * (1 - 2**-20)])
    rows = torch.tensor([0])
    assert _same(_native_stored(FP8, rows, row[None], 1), _torch_stored(FP8, rows, row[None], 1))


def test_fp8_bytes_of_values_across_every_binade():
    """Values from 1e-8 to 1e4 (448 first in each row, so that rows of small values have scale
    1): fp8 subnormals, normals, values that round up into the next binade."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(50000, 8, generator=gen) * 10.0 ** (torch.rand(50000, 8, generator=gen) * 12 - 8)
    x[:, 0] = 448.0
    rows = torch.arange(len(x))
    assert _same(_native_stored(FP8, rows, x, len(x)), _torch_stored(FP8, rows, x, len(x)))


@KINDS
def test_a_row_holding_a_nan_gets_scale_1(kind):
    """torch's amax of such a row is NaN, and NaN > 0 is false: scale 1, the finite values
    stored as they are (what a NaN itself stores is the cast's business: not compared)."""
    x = torch.tensor([[1.0, float("nan"), -3.0, 2.0], [0.5, 1.0, float("nan"), 0.25]])
    rows = torch.tensor([0, 1])
    got, want = _native_stored(kind, rows, x, 2), _torch_stored(kind, rows, x, 2)
    assert torch.equal(got.scales, torch.ones(2)) and torch.equal(want.scales, torch.ones(2))
    finite = ~x.isnan()
    assert torch.equal(got.values[finite], want.values[finite])


def test_int8_halves_go_to_the_even_value():
    row = torch.cat([torch.tensor([127.0, -127.0]), torch.arange(-126, 126) + 0.5])  # scale 1
    rows = torch.tensor([0])
    stored = _native_stored(torch.int8, rows, row[None], 1)
    assert _same(stored, _torch_stored(torch.int8, rows, row[None], 1))
    assert stored.values[0, 2 + 126].item() == 0 and stored.values[0, 2 + 127].item() == 2  # 0.5 -> 0, 1.5 -> 2


def test_a_row_outside_the_table_writes_nothing():
    table = ScaledRows.zeros(4, 8, torch.int8, torch.float32, "cpu")
    with pytest.raises(IndexError):
        scaled_store_native(table.values, table.scales, NATIVE_KINDS[torch.int8], torch.tensor([1, 4]), torch.ones(2, 8))
    assert not table.values.any() and torch.equal(table.scales, torch.ones(4))
