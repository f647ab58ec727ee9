"""The native MLA latent attention against the torch form the model runs elsewhere."""

import pytest
import torch

from oxserve.cache.layers import FP8, MLACache, ScaledRows
from oxserve.kernels.mla_attention import latent_attention, latent_attention_fit
from oxserve.model.batch import ForwardBatch
from oxserve.model.mla import MLAttention
from test_moe_kernels import make_config

BLOCK = 16


def _case(gen, tokens, heads, dim, width, dtype, block=BLOCK):
    """Queries of 3 requests whose blocks are scattered over the cache; each query selects up
    to `width` distinct positions of its request, -1 in between, some none at all."""
    requests, blocks_per = 3, 6
    blocks = torch.randperm(requests * blocks_per + 2, generator=gen)[: requests * blocks_per].view(requests, blocks_per)
    request = torch.randint(0, requests, (tokens,), generator=gen)
    positions = torch.full((tokens, width), -1, dtype=torch.long)
    for t in range(tokens):
        chosen = torch.randperm(blocks_per * block, generator=gen)[: int(torch.randint(0, width + 1, (), generator=gen))]
        slots = torch.randperm(width, generator=gen)[: chosen.numel()]
        positions[t, slots] = chosen
    positions[0] = -1  # a query with nothing selected attends to nothing
    latent = (torch.randn((requests * blocks_per + 2) * block, dim, generator=gen)).to(dtype)
    q = (torch.randn(tokens, heads, dim, generator=gen) * 0.3).to(dtype)
    return q, positions, request, blocks, latent


def _torch_attention(q, positions, request, blocks, latent, scale, block=BLOCK):
    with torch.device("meta"):  # `_attend` reads only `scale`
        attn = MLAttention(make_config(), has_indexer=False, name="test")
    attn.scale = scale
    tokens = q.shape[0]
    batch = ForwardBatch(
        query_lens=[1] * tokens, context_lens=[0] * tokens, num_decodes=tokens, positions=torch.zeros(tokens, dtype=torch.long),
        request_index=request, cache_rows=torch.zeros(tokens, dtype=torch.long), block_tables=blocks,
        state_slots=request, has_initial_state=torch.ones(tokens, dtype=torch.bool), block_size=block,
        seq_len_bound=1, logits_indices=request,
    )
    return attn._attend(q, positions, request, batch, MLACache(latent))


@pytest.fixture(params=["native", "plain"])
def build(request, monkeypatch):
    """The widest vector build this CPU has (bf16 pair products for bf16 latents of a multiple
    of 32 channels with AVX512-BF16; blocks of 4 heads by 16 lanes with AVX-512, by 8 with
    AVX2), and plain C (every score and sum in the scalar loops)."""
    if request.param == "plain":
        from oxserve.kernels import mla_attention, native

        lib = native.load("mla_attention", ("-O3", "-fopenmp", "-ffp-contract=fast", "-mno-avx512f"))
        lib.mla_latent_attention.argtypes = mla_attention._kernel().mla_latent_attention.argtypes
        monkeypatch.setattr(mla_attention, "_kernel", lambda: lib)
    return request.param


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens,heads,dim,width", [(1, 1, 16, 4), (9, 4, 64, 40), (33, 2, 40, 100), (5, 6, 48, 300),
                                                    (4, 3, 32, 17), (6, 6, 96, 150), (3, 9, 64, 33), (6, 5, 32, 33),
                                                    (6, 3, 64, 17), (4, 130, 32, 3)])
@pytest.mark.parametrize("block", [BLOCK, 12])  # a power of two (rows by shifts) or not (by division)
def test_native_latent_attention_matches_torch(build, dtype, tokens, heads, dim, width, block):
    gen = torch.Generator().manual_seed(tokens * 7 + dim)
    q, positions, request, blocks, latent = _case(gen, tokens, heads, dim, width, dtype, block)
    scale = dim**-0.5
    assert latent_attention_fit(q, latent)
    got = latent_attention(q, positions, request, blocks, block, latent, scale)
    want = _torch_attention(q, positions, request, blocks, latent, scale, block)
    assert got.dtype == dtype and got.shape == (tokens, heads, dim)
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    # bf16: scores and probabilities are rounded where torch rounds them; fp32 sums in another order.
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_native_latent_attention_gives_a_query_the_same_bits_alone_and_in_a_batch(dtype):
    """A query's output does not depend on the other queries of its call, nor on the threads
    that share the call (or a request's output would depend on the batch)."""
    gen = torch.Generator().manual_seed(11)
    q, positions, request, blocks, latent = _case(gen, 12, 4, 64, 40, dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        whole = latent_attention(q, positions, request, blocks, BLOCK, latent, 0.125)
        torch.set_num_threads(1)
        for t in range(12):
            alone = latent_attention(q[t : t + 1], positions[t : t + 1], request[t : t + 1], blocks, BLOCK, latent, 0.125)
            assert torch.equal(alone[0], whole[t])
    finally:
        torch.set_num_threads(threads)


def _scaled(latent: torch.Tensor, kind: torch.dtype, gen) -> ScaledRows:
    """`latent` stored as int8 or fp8 rows (row magnitudes spread over 1e-3 .. 1e2, so the
    scales matter), read as latent's dtype."""
    table = ScaledRows.zeros(latent.shape[0], latent.shape[1], kind, latent.dtype, "cpu")
    spread = 10.0 ** (torch.rand(latent.shape[0], 1, generator=gen) * 5 - 3)
    table.store(torch.arange(latent.shape[0]), latent.float() * spread)
    return table


@pytest.mark.parametrize("kind", [torch.int8, FP8], ids=["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens,heads,dim,width", [(9, 4, 64, 40), (5, 6, 48, 300), (6, 3, 32, 17), (3, 2, 40, 9)])
def test_native_latent_attention_on_scaled_rows(build, kind, dtype, tokens, heads, dim, width):
    """An int8/fp8 table: exactly what the kernel computes on a table of the model's dtype
    holding the rows as `ScaledRows.gather` dequantizes them, and within the same tolerance
    of the torch form on the scaled table."""
    gen = torch.Generator().manual_seed(tokens * 13 + dim)
    q, positions, request, blocks, latent = _case(gen, tokens, heads, dim, width, dtype)
    scaled = _scaled(latent, kind, gen)
    scale = dim**-0.5
    assert latent_attention_fit(q, scaled)
    got = latent_attention(q, positions, request, blocks, BLOCK, scaled, scale)
    plain = scaled.gather(torch.arange(latent.shape[0]))
    assert plain.dtype == dtype
    assert torch.equal(got, latent_attention(q, positions, request, blocks, BLOCK, plain, scale))
    want = _torch_attention(q, positions, request, blocks, scaled, scale)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * want.abs().max().item())


@pytest.mark.parametrize("dim", [32, 33])  # 33: the scalar tail too (the only path without AVX-512)
def test_every_fp8_byte_dequantizes_as_torch_reads_it(dim):
    """One position a query: its output is the row itself. Rows hold all 254 finite e4m3 bytes
    (subnormals, zeros of both signs, the largest) under random scales (a NaN byte, which
    quantizing never stores, would make its whole row's output NaN)."""
    finite = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    rows = 8
    table = ScaledRows.zeros(rows, dim, FP8, torch.float32, "cpu")
    table.values.copy_(finite.repeat(2)[: rows * dim].view(rows, dim))
    table.scales.copy_(torch.rand(rows) * 4)
    blocks = torch.arange(rows * dim // BLOCK).view(1, -1)[:, : -(-rows // BLOCK)]
    got = latent_attention(torch.randn(rows, 1, dim), torch.arange(rows).view(rows, 1), torch.zeros(rows, dtype=torch.long),
                           blocks, BLOCK, table, 1.0)
    assert torch.equal(got[:, 0], table.gather(torch.arange(rows)))


def test_mismatched_tables_take_the_torch_path():
    q = torch.zeros(2, 1, 8)
    assert latent_attention_fit(q, torch.zeros(16, 8))
    assert not latent_attention_fit(q, torch.zeros(16, 8).bfloat16())
    assert not latent_attention_fit(q.half(), torch.zeros(16, 8).half())
    assert not latent_attention_fit(q, torch.zeros(16, 16)[:, ::2])
    assert not latent_attention_fit(q, ScaledRows.zeros(16, 8, torch.int8, torch.bfloat16, "cpu"))  # read as bf16
    assert latent_attention_fit(q, ScaledRows.zeros(16, 8, FP8, torch.float32, "cpu"))
