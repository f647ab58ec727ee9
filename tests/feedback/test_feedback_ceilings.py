import dataclasses
import json

import pytest

from oxserve.feedback import ceilings
from oxserve.feedback.ceilings import (
    Ceilings, format_ceilings_table, load_or_measure_ceilings, measure_ceilings,
)


@pytest.fixture(scope="module")
def quick() -> Ceilings:
    return measure_ceilings("cpu", quick=True)


def test_quick_measurement_is_positive(quick):
    for value in (quick.copy_bandwidth, quick.read_bandwidth, quick.matmul_fp32,
                  quick.matmul_bf16, quick.matmul_int8):
        assert value is not None and value > 0
    assert quick.quick and quick.device == "cpu" and quick.threads >= 1
    assert quick.fingerprint == ceilings.fingerprint("cpu")


def test_dict_round_trip_and_table(quick):
    assert Ceilings.from_dict(json.loads(json.dumps(quick.to_dict()))) == quick
    table = format_ceilings_table(quick)
    for label in ("memory copy", "matmul fp32", "matmul bf16", "matmul int8", "B/s", "FLOP/s"):
        assert label in table


def test_roofline_time(quick):
    c = dataclasses.replace(quick, copy_bandwidth=10e9, read_bandwidth=5e9, matmul_bf16=1e12)
    assert c.min_time_s(bytes_moved=20e9) == pytest.approx(2.0)  # memory bound
    assert c.min_time_s(bytes_moved=1e9, flops=5e12) == pytest.approx(5.0)  # compute bound


def test_a_narrow_type_peaks_at_least_where_a_wider_one_does(quick):
    """On a CPU without bf16 products torch's bf16 matmul is far slower than fp32 (0.65 against
    28 GFLOP/s on a first-generation Zen); widened to fp32, bf16 work runs at fp32's rate, so
    the roofline must not take the slow path as the bound (experiments called runs faster than
    it "suspect")."""
    avx2 = dataclasses.replace(quick, matmul_fp32=28e9, matmul_bf16=0.65e9, matmul_int8=1e9)
    assert avx2.matmul_rate("bf16") == avx2.matmul_rate("int8") == avx2.matmul_rate("fp32") == 28e9
    amx = dataclasses.replace(quick, matmul_fp32=0.1e12, matmul_bf16=1.5e12, matmul_int8=3e12)
    assert (amx.matmul_rate("fp32"), amx.matmul_rate("bf16"), amx.matmul_rate("int8")) == (0.1e12, 1.5e12, 3e12)
    assert dataclasses.replace(amx, matmul_int8=None).matmul_rate("int8") == 1.5e12


def test_cache_avoids_remeasuring(monkeypatch, tmp_path, quick):
    calls = []
    template = quick

    def fake_measure(device="cpu", quick=False):
        calls.append(quick)
        return dataclasses.replace(template, quick=quick)

    monkeypatch.setattr(ceilings, "measure_ceilings", fake_measure)
    first = load_or_measure_ceilings("cpu", cache_dir=tmp_path, quick=True)
    second = load_or_measure_ceilings("cpu", cache_dir=tmp_path, quick=True)
    assert calls == [True] and second == first
    (cached,) = tmp_path.glob("ceilings-*.json")
    assert ceilings.fingerprint("cpu") in cached.name

    load_or_measure_ceilings("cpu", cache_dir=tmp_path)  # full wanted, quick cached
    load_or_measure_ceilings("cpu", cache_dir=tmp_path)  # full cached now
    load_or_measure_ceilings("cpu", cache_dir=tmp_path, quick=True)  # full serves quick
    assert calls == [True, False]
    load_or_measure_ceilings("cpu", cache_dir=tmp_path, refresh=True)
    assert calls == [True, False, False]

    cached.write_text("{not json")
    with pytest.warns(UserWarning, match="unreadable"):
        load_or_measure_ceilings("cpu", cache_dir=tmp_path)
    assert len(calls) == 4
