"""The native DSA indexer scores against the torch form Indexer._select uses elsewhere."""

import pytest
import torch
import torch.nn.functional as F

from oxserve.kernels.dsa_index import expand_selection, expand_selection_torch, index_scores, index_scores_fit

BLOCK, KPOOL = 16, 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens,heads,dim", [(1, 1, 8), (7, 4, 32), (33, 2, 20)])
def test_native_index_scores_match_torch(dtype, tokens, heads, dim):
    gen = torch.Generator().manual_seed(tokens * 10 + dim)
    requests, blocks_per = 3, 5
    ppb = BLOCK // KPOOL
    blocks = torch.randperm(requests * blocks_per + 1, generator=gen)[: requests * blocks_per].view(requests, blocks_per)
    pool_keys = torch.randn((requests * blocks_per + 1) * ppb, dim, generator=gen).to(dtype)
    request = torch.randint(0, requests, (tokens,), generator=gen)
    visible = torch.randint(0, blocks_per * ppb + 1, (tokens,), generator=gen)  # 0: no complete pool yet
    num_pools = int(visible.max())
    q = torch.randn(tokens, heads, dim, generator=gen)
    weights = torch.randn(tokens, heads, generator=gen) * heads**-0.5
    assert index_scores_fit(q, pool_keys)
    got = index_scores(q, weights, visible, request, blocks, ppb, pool_keys, num_pools, dim**-0.5)
    pools = torch.arange(num_pools)
    rows = blocks[request[:, None], pools // ppb] * ppb + pools % ppb  # [T, P]
    scores = F.relu(torch.matmul(q, pool_keys[rows].float().transpose(1, 2)) * dim**-0.5)
    want = (weights.unsqueeze(1) @ scores).squeeze(1)
    seen = pools[None] < visible[:, None]
    torch.testing.assert_close(got[seen], want[seen], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[~seen], torch.zeros_like(got[~seen]))
    hidden = index_scores(q, weights, visible, request, blocks, ppb, pool_keys, num_pools, dim**-0.5, float("-inf"))
    assert torch.equal(hidden[seen], got[seen]) and (hidden[~seen] == float("-inf")).all()


@pytest.mark.parametrize("pool,tail", [(4, True), (4, False), (1, True), (16, True)])
@pytest.mark.parametrize("tokens,k", [(1, 3), (9, 5), (6, 0)])
def test_native_selection_expands_as_torch(pool, tail, tokens, k):
    """Chosen pools -> positions: pools past a query's visible ones (top-k's filler) and tail
    positions past the query itself become -1."""
    gen = torch.Generator().manual_seed(pool * 100 + tokens * 10 + k)
    query_pos = torch.randint(0, 40, (tokens,), generator=gen)
    visible = (query_pos + 1) // pool
    chosen = torch.randint(0, 12, (tokens, k), generator=gen)
    want = expand_selection_torch(chosen, visible, query_pos, pool, tail)
    got = expand_selection(chosen, visible, query_pos, pool, tail)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    assert ((want == -1) | (want <= query_pos[:, None])).all()


def test_quantized_tables_take_the_torch_path():
    q = torch.zeros(1, 1, 8)
    assert not index_scores_fit(q.bfloat16(), torch.zeros(4, 8))
    assert not index_scores_fit(q, torch.zeros(4, 16)[:, ::2])
    assert not index_scores_fit(q, torch.zeros(4, 8, dtype=torch.int8))
