"""The native DSA indexer kernels (scores, selections, key store and pool compression) against
the torch forms `Indexer` uses elsewhere."""

import random

import pytest
import torch
import torch.nn.functional as F

from oxserve.cache.layers import FP8, ScaledRows
from oxserve.kernels.dsa_index import (expand_selection, expand_selection_torch, index_scores, index_scores_fit,
                                       select_every_pool, store_keys, store_keys_fit, top_pools, top_pools_torch)

BLOCK, KPOOL = 16, 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("query_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens,heads,dim", [(1, 1, 8), (7, 4, 32), (33, 2, 20), (5, 2, 40), (5, 3, 64)])
def test_native_index_scores_match_torch(dtype, query_dtype, tokens, heads, dim):
    """Queries and head weights as projected (bf16 or fp32: widened in the kernel, weights
    scaled there), pools visible up to each query's position."""
    gen = torch.Generator().manual_seed(tokens * 10 + dim)
    requests, blocks_per = 3, 5
    ppb = BLOCK // KPOOL
    blocks = torch.randperm(requests * blocks_per + 1, generator=gen)[: requests * blocks_per].view(requests, blocks_per)
    pool_keys = torch.randn((requests * blocks_per + 1) * ppb, dim, generator=gen).to(dtype)
    request = torch.randint(0, requests, (tokens,), generator=gen)
    query_pos = torch.randint(0, blocks_per * BLOCK, (tokens,), generator=gen)  # below KPOOL - 1: no complete pool
    visible = (query_pos + 1) // KPOOL
    num_pools = max(int(visible.max()), 1)
    q = torch.randn(tokens, heads, dim, generator=gen).to(query_dtype)
    weights = torch.randn(tokens, heads, generator=gen).to(query_dtype)
    assert index_scores_fit(q, weights, pool_keys)
    got = index_scores(q, weights, query_pos, KPOOL, request, blocks, ppb, pool_keys, num_pools, dim**-0.5, heads**-0.5)
    pools = torch.arange(num_pools)
    rows = blocks[request[:, None], pools // ppb] * ppb + pools % ppb  # [T, P]
    scores = F.relu(torch.matmul(q.float(), pool_keys[rows].float().transpose(1, 2)) * dim**-0.5)
    want = ((weights.float() * heads**-0.5).unsqueeze(1) @ scores).squeeze(1)
    seen = pools[None] < visible[:, None]
    torch.testing.assert_close(got[seen], want[seen], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[~seen], torch.zeros_like(got[~seen]))
    hidden = index_scores(q, weights, query_pos, KPOOL, request, blocks, ppb, pool_keys, num_pools, dim**-0.5,
                          heads**-0.5, float("-inf"))  # fmt: skip
    assert torch.equal(hidden[seen], got[seen]) and (hidden[~seen] == float("-inf")).all()


@pytest.mark.parametrize("tokens,num_pools,dtype", [(1, 4096, torch.bfloat16), (3, 4096, torch.bfloat16),
                                                    (32, 1024, torch.bfloat16), (2, 3100, torch.float32)])
def test_native_index_scores_of_long_rows_are_the_same_on_any_number_of_threads(tokens, num_pools, dtype):
    """A decode query's row of thousands of pools is scored in pieces spread over threads, a
    piece starting mid-block (6 pools a block here), the last piece partial where the row is
    not a whole number of pieces: the torch form's scores, and the same bits on one thread as
    on two."""
    gen = torch.Generator().manual_seed(tokens * 7 + num_pools)
    kpool, block, requests, blocks_per, dim, heads = 4, 24, 2, 500, 32, 2
    ppb = block // kpool
    blocks = torch.randperm(requests * blocks_per + 3, generator=gen)[: requests * blocks_per].view(requests, blocks_per)
    pool_keys = torch.randn((requests * blocks_per + 3) * ppb, dim, generator=gen).to(dtype)
    request = torch.randint(0, requests, (tokens,), generator=gen)
    query_pos = torch.randint(0, min(blocks_per * block, num_pools * kpool), (tokens,), generator=gen)
    query_pos[0] = min(blocks_per * block, num_pools * kpool) - 1  # every pool of its blocks visible, or of the row
    visible = (query_pos + 1) // kpool
    q, weights = torch.randn(tokens, heads, dim, generator=gen).bfloat16(), torch.randn(tokens, heads, generator=gen).bfloat16()
    args = (q, weights, query_pos, kpool, request, blocks, ppb, pool_keys, num_pools, dim**-0.5, heads**-0.5, float("-inf"))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        got = index_scores(*args)
        torch.set_num_threads(1)
        alone = index_scores(*args)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got, alone)
    last = tokens - 1  # a query scored alone: the same bits as among the others
    single = (q[last:], weights[last:], query_pos[last:], kpool, request[last:], *args[5:])
    assert torch.equal(index_scores(*single)[0], got[last])
    pools = torch.arange(num_pools)
    seen = pools[None] < visible[:, None]
    rows = blocks[request[:, None], (pools // ppb).clamp(max=blocks_per - 1)] * ppb + pools % ppb
    scores = F.relu(torch.matmul(q.float(), pool_keys[rows].float().transpose(1, 2)) * dim**-0.5)
    want = ((weights.float() * heads**-0.5).unsqueeze(1) @ scores).squeeze(1)
    torch.testing.assert_close(got[seen], want[seen], rtol=1e-5, atol=1e-5)
    assert (got[~seen] == float("-inf")).all() and int(seen[0].sum()) > 512


def _ranked_first(row: list[float], k: int) -> list[int]:
    """The rule by hand: highest score first (every NaN above +inf, -0 = +0), the lower pool
    among equal scores; the first k, in pool order."""
    def rank(i):
        x = row[i]
        return (1, 0.0, -i) if x != x else (0, x + 0.0, -i)

    return sorted(sorted(range(len(row)), key=rank, reverse=True)[:k])


def _scores_with_ties(gen: torch.Generator, tokens: int, n: int, kind: str) -> torch.Tensor:
    x = torch.randn(tokens, n, generator=gen)
    if kind == "relu":  # the indexer's scores: many exact zeros, of either sign
        x = x.relu() * torch.where(torch.rand(tokens, n, generator=gen) < 0.5, -1.0, 1.0)
    elif kind == "coarse":  # few distinct values: ties straddle the k-th everywhere
        x = (x * 2).round() / 2
    elif kind == "special":  # hidden pools (-inf), NaN of either sign, +inf, -0 among the rest
        nan = float("nan")
        for value, share in (float("-inf"), 0.3), (nan, 0.05), (-nan, 0.05), (float("inf"), 0.05), (-0.0, 0.1):
            x[torch.rand(tokens, n, generator=gen) < share] = value
    return x


@pytest.mark.parametrize("kind", ["random", "relu", "coarse", "special"])
def test_top_pools_follow_their_rule(kind):
    """The native choice and its torch form each equal the rule written out by hand, on fresh
    random rows of every size around the kernel's radix passes and thread split, and a few as
    long as 64k-token contexts' pools; and so does the native choice told where each row's
    hidden pools (-inf from its query's position on) begin, with fewer visible pools than k,
    none, or a row's worth."""
    seed = random.randrange(2**63)
    gen = torch.Generator().manual_seed(seed)
    for trial in range(64):
        tokens, n = int(torch.randint(1, 40, (1,), generator=gen)), int(torch.randint(1, 600, (1,), generator=gen))
        if trial % 16 == 0:
            tokens, n = int(torch.randint(1, 4, (1,), generator=gen)), int(torch.randint(2000, 20000, (1,), generator=gen))
        k = int(torch.randint(0, n + 1, (1,), generator=gen))
        scores = _scores_with_ties(gen, tokens, n, kind)
        want = torch.tensor([_ranked_first(row, k) for row in scores.tolist()], dtype=torch.int64).view(tokens, k)
        assert torch.equal(top_pools(scores, k), want), (seed, tokens, n, k)
        assert torch.equal(top_pools_torch(scores, k), want), (seed, tokens, n, k)
        visible = torch.randint(0, n + 3, (tokens,), generator=gen)
        visible[0] = min(int(visible[0]), max(k - 1, 0))  # fewer than k (or none)
        visible[-1] = (0, n + 2)[trial % 2] if tokens > 1 else visible[-1]  # none, or past the row
        pos = visible * KPOOL - 1 + torch.randint(0, KPOOL, (tokens,), generator=gen)  # (pos + 1) // KPOOL = visible
        tail = torch.arange(n)[None] >= visible[:, None]
        hidden = scores.masked_fill(tail, float("-inf"))
        want = torch.tensor([_ranked_first(row, k) for row in hidden.tolist()], dtype=torch.int64).view(tokens, k)
        assert torch.equal(top_pools(hidden, k, hidden_from=(pos, KPOOL)), want), (seed, tokens, n, k, visible.tolist())
        # the hidden tails are not read: NaN there (the highest rank) changes nothing
        assert torch.equal(top_pools(scores.masked_fill(tail, float("nan")), k, hidden_from=(pos, KPOOL)), want)


def test_top_pools_refuse_more_than_the_row():
    with pytest.raises(ValueError, match="3 of 2 pools"):
        top_pools(torch.zeros(1, 2), 3)


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
    assert torch.equal(expand_selection(chosen, None, query_pos, pool, tail), want)  # visible pools from positions
    assert ((want == -1) | (want <= query_pos[:, None])).all()


@pytest.mark.parametrize("kind", [torch.int8, FP8], ids=["int8", "fp8"])
@pytest.mark.parametrize("read_as", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens,heads,dim", [(7, 4, 32), (5, 2, 40), (33, 2, 20), (3, 2, 256), (3, 2, 288)])  # 288: unstaged
def test_native_index_scores_on_scaled_keys(kind, read_as, tokens, heads, dim):
    """An int8/fp8 pool-key table (row magnitudes spread over 1e-3 .. 1e2): the scores the
    kernel gives a plain table of the keys as `ScaledRows.gather` reads them, bit for bit."""
    gen = torch.Generator().manual_seed(tokens * 10 + dim)
    requests, blocks_per, ppb = 3, 5, BLOCK // KPOOL
    table_rows = (requests * blocks_per + 1) * ppb
    blocks = torch.randperm(requests * blocks_per + 1, generator=gen)[: requests * blocks_per].view(requests, blocks_per)
    scaled = ScaledRows.zeros(table_rows, dim, kind, read_as, "cpu")
    spread = 10.0 ** (torch.rand(table_rows, 1, generator=gen) * 5 - 3)
    scaled.store(torch.arange(table_rows), torch.randn(table_rows, dim, generator=gen) * spread)
    plain = scaled.gather(torch.arange(table_rows))
    request = torch.randint(0, requests, (tokens,), generator=gen)
    query_pos = torch.randint(0, blocks_per * BLOCK, (tokens,), generator=gen)
    num_pools = max(int(((query_pos + 1) // KPOOL).max()), 1)
    q, weights = torch.randn(tokens, heads, dim, generator=gen).to(read_as), torch.randn(tokens, heads, generator=gen).to(read_as)
    assert index_scores_fit(q, weights, scaled)
    args = (q, weights, query_pos, KPOOL, request, blocks, ppb)
    got = index_scores(*args, scaled, num_pools, dim**-0.5, heads**-0.5)
    assert torch.equal(got, index_scores(*args, plain, num_pools, dim**-0.5, heads**-0.5))


def test_mismatched_tables_take_the_torch_path():
    q, w = torch.zeros(1, 1, 8), torch.zeros(1, 1)
    assert index_scores_fit(q, w, torch.zeros(4, 8))
    assert not index_scores_fit(q, w.bfloat16(), torch.zeros(4, 8))  # q and weights in one dtype
    assert not index_scores_fit(q, w, torch.zeros(4, 16)[:, ::2])
    assert not index_scores_fit(q, w, torch.zeros(4, 8, dtype=torch.int8))  # int8 without scales
    assert index_scores_fit(q, w, ScaledRows.zeros(4, 8, torch.int8, torch.bfloat16, "cpu"))
    assert not index_scores_fit(q.half(), w.half(), torch.zeros(4, 8))


def _store_step(gen, dtype, tokens: int, pools: int, pool: int, dim: int, table_rows: int = 64):
    """A step's raw keys and gate scores [T, D], norm weight and bias, position bias [P, D], the
    cache rows they go to, the completed pools' member rows [N, P] (this step's rows among them)
    and pool rows [N]."""
    raw, gates = (torch.randn(tokens, dim, generator=gen).to(dtype) * 3 for _ in range(2))
    weight, bias = torch.randn(dim, generator=gen).to(dtype), torch.randn(dim, generator=gen).to(dtype)
    ape = torch.randn(pool, dim, generator=gen).to(dtype)
    rows = torch.randperm(table_rows, generator=gen)[:tokens]
    members = torch.cat([rows, torch.randint(0, table_rows, (pools * pool,), generator=gen)])[torch.randperm(
        tokens + pools * pool, generator=gen)][: pools * pool].view(pools, pool)
    pool_rows = torch.randperm(table_rows // pool, generator=gen)[:pools]
    return raw, gates, weight, bias, ape, rows, members, pool_rows


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens,pools,pool,dim", [(1, 1, 4, 32), (9, 3, 4, 20), (16, 0, 4, 8), (5, 2, 16, 64)])
def test_native_key_store_and_pool_compression_match_torch(dtype, tokens, pools, pool, dim):
    """`store_keys` against the torch form: the keys layer-normed into their rows, the gate
    scores beside them, then each completed pool's softmax-weighted key from the tables (its
    members include this step's tokens, so the new keys must be in before it is read)."""
    gen = torch.Generator().manual_seed(tokens * 100 + pools * 10 + dim)
    table_rows = 64
    raw, gates, weight, bias, ape, rows, members, pool_rows = _store_step(gen, dtype, tokens, pools, pool, dim)
    tables = [torch.randn(table_rows, dim, generator=gen).to(dtype) for _ in range(2)]
    tables.append(torch.randn(table_rows // pool, dim, generator=gen).to(dtype))
    want = [t.clone() for t in tables]
    want[0][rows] = F.layer_norm(raw, (dim,), weight, bias, eps=1e-6)
    want[1][rows] = gates
    probs = (want[1][members].float() + ape.float()).softmax(dim=1).to(dtype)
    want[2][pool_rows] = (probs * want[0][members]).sum(1)
    assert store_keys_fit(raw, *tables)
    store_keys(raw, gates, weight, bias, 1e-6, rows, *tables[:2], members, pool_rows, ape, tables[2])
    tol = dict(rtol=1.6e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    for got, expected in zip(tables, want):
        torch.testing.assert_close(got, expected, **tol)
    assert torch.equal(tables[1], want[1])  # copied, not recomputed
    untouched = torch.ones(table_rows, dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(tables[0][untouched], want[0][untouched])
    before = [t.clone() for t in tables]
    for bad_rows, bad_members in ((rows.clone().fill_(table_rows), members), (rows, members.clone().fill_(-1))):
        if not len(bad_rows) or (bad_members is not members and not bad_members.numel()):
            continue
        with pytest.raises(IndexError):  # out of its table: an error before anything is written
            store_keys(raw, gates, weight, bias, 1e-6, bad_rows, *tables[:2], bad_members, pool_rows, ape, tables[2])
    assert all(torch.equal(t, b) for t, b in zip(tables, before))


@pytest.mark.parametrize("kind", [torch.int8, FP8], ids=["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_native_key_store_on_scaled_tables(kind, dtype):
    """int8/fp8 key and pool tables: the keys stored are the plain store's keys quantized (bit
    for bit), the gate scores the same, and each pool key is the torch form's compression of
    its members as the scaled table reads them, within the plain test's tolerance and a step
    of the pool row's quantization."""
    gen = torch.Generator().manual_seed(7)
    tokens, pools, pool, dim, table_rows = 9, 3, 4, 20, 64
    raw, gates, weight, bias, ape, rows, members, pool_rows = _store_step(gen, dtype, tokens, pools, pool, dim)
    start = torch.randn(table_rows, dim, generator=gen).to(dtype)
    plain = [start.clone(), torch.randn(table_rows, dim, generator=gen).to(dtype), torch.zeros(table_rows // pool, dim, dtype=dtype)]
    scaled_keys = ScaledRows.zeros(table_rows, dim, kind, dtype, "cpu")
    scaled_keys.store(torch.arange(table_rows), start)
    scaled_pools = ScaledRows.zeros(table_rows // pool, dim, kind, dtype, "cpu")
    gate_table = plain[1].clone()
    assert store_keys_fit(raw, scaled_keys, gate_table, scaled_pools, gates, weight, bias, ape)
    store_keys(raw, gates, weight, bias, 1e-6, rows, scaled_keys, gate_table, members, pool_rows, ape, scaled_pools)
    store_keys(raw, gates, weight, bias, 1e-6, rows, *plain[:2], members, pool_rows, ape, plain[2])
    want_keys = ScaledRows.zeros(tokens, dim, kind, dtype, "cpu")
    values, scales = want_keys.quantize(plain[0][rows])
    assert torch.equal(scaled_keys.values[rows], values) and torch.equal(scaled_keys.scales[rows], scales)
    assert torch.equal(gate_table, plain[1])
    member_keys = scaled_keys.gather(members)  # [N, P, D] as the kernel reads them
    probs = (gate_table[members].float() + ape.float()).softmax(dim=1).to(dtype)
    want = (probs * member_keys).sum(1).float()
    got = scaled_pools.gather(pool_rows).float()
    tol = 1.6e-2 if dtype == torch.bfloat16 else 1e-5
    step = scaled_pools.scales[pool_rows][:, None] * (1.0 if kind == torch.int8 else 32.0)  # fp8: up to 1/16 of 448
    assert ((got - want).abs() <= tol * want.abs() + tol + step).all()


def test_quantized_key_tables_the_store_cannot_take():
    raw = torch.zeros(2, 8, dtype=torch.bfloat16)
    plain = torch.zeros(8, 8, dtype=torch.bfloat16)
    assert store_keys_fit(raw, plain, plain, plain)
    assert store_keys_fit(raw, ScaledRows.zeros(8, 8, torch.int8, torch.bfloat16, "cpu"), plain, plain)
    assert not store_keys_fit(raw, ScaledRows.zeros(8, 8, torch.int8, torch.float32, "cpu"), plain, plain)  # read as fp32
    assert not store_keys_fit(raw, plain, ScaledRows.zeros(8, 8, torch.int8, torch.bfloat16, "cpu"), plain)  # gates plain
    assert not store_keys_fit(raw, plain.to(torch.int8), plain, plain)
    assert not store_keys_fit(raw, plain, plain.float(), plain)
    assert not store_keys_fit(torch.zeros(2, 2048, dtype=torch.bfloat16), plain, plain, plain)
    assert not store_keys_fit(raw, plain, plain, plain, raw.float())  # a gate score or weight of another dtype


@pytest.mark.parametrize("pool,tail", [(4, True), (4, False), (1, True), (16, True)])
@pytest.mark.parametrize("tokens,num_pools", [(1, 3), (9, 5), (6, 0)])
def test_every_pool_selected_as_torch(pool, tail, tokens, num_pools):
    query_pos = torch.randint(0, num_pools * pool + pool, (tokens,))
    want = expand_selection_torch(torch.arange(num_pools).expand(tokens, -1), (query_pos + 1) // pool, query_pos, pool, tail)
    assert torch.equal(select_every_pool(query_pos, num_pools, pool, tail), want)
