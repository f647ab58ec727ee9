"""Step metadata: the block table filled from the runner's per-request arrays equals the one
built from the Python lists, each row a request's ids padded with `num_blocks`, and
`BlockIds` keeps its array in step with its list; a steady decode step written into a batch
in place equals one made for it."""

import random
from pathlib import Path

import pytest
import torch

from oxserve.cache.replay import ReplayBook
from oxserve.default_model import default_model
from oxserve.model.batch import BatchRequest, BlockIds, DecodeRows, make_forward_batch, table_shape
from oxserve.model.config import TextModelConfig


def test_block_ids_grow_as_their_list():
    blocks = BlockIds()
    assert blocks.array().size == 0
    want: list[int] = []
    for _ in range(40):
        new = [random.randrange(10_000) for _ in range(random.choice([0, 1, 1, 3, 17]))]
        blocks.extend(new)
        want += new
        assert blocks.ids == want and blocks.array().tolist() == want


def test_tables_from_arrays_equal_tables_from_lists_padded_with_an_id_no_cache_has():
    cfg = TextModelConfig.from_file(Path(default_model()) / "config.json")
    block_size, num_blocks = 16, 5_000
    rng = random.Random()
    requests = []
    for slot in range(rng.randrange(1, 12)):
        computed = rng.randrange(0, 700)
        new = 1 if computed and rng.random() < 0.5 else rng.randrange(1, 90)
        ids = rng.sample(range(num_blocks), -(-(computed + new) // block_size))
        requests.append((computed, new, ids, slot))
    requests.sort(key=lambda r: not (r[0] and r[1] == 1))  # decodes first, as the scheduler orders them
    plain = [BatchRequest(c, n, ids, slot, True) for c, n, ids, slot in requests]
    held = []
    for c, n, ids, slot in requests:
        blocks = BlockIds()
        blocks.extend(ids)
        held.append(BatchRequest(c, n, blocks.ids, slot, True, block_array=blocks.array()))
    a, b = (make_forward_batch(r, cfg, block_size, num_blocks, "cpu") for r in (plain, held))
    assert torch.equal(a.block_tables, b.block_tables) and torch.equal(a.cache_rows, b.cache_rows)
    longest = max(c + n for c, n, _, _ in requests)
    width = a.block_tables.shape[1]  # a power of two, covering every request and the step's bound
    assert width & (width - 1) == 0 and width * block_size >= a.seq_len_bound >= longest
    for row, (_, _, ids, _) in zip(a.block_tables.tolist(), requests):
        assert row == ids + [num_blocks] * (width - len(ids))
    assert torch.equal(a.pools.member_rows, b.pools.member_rows) and torch.equal(a.pools.pool_rows, b.pools.pool_rows)


def test_decode_steps_keep_their_shapes_while_contexts_grow():
    """What a captured decode step relies on: tables as wide as a power of two, a power-of-two
    bound on sequence lengths, and one pool compressed per decode, complete or not (a partial
    pool from the tokens it has so far, last one repeated; a prompt chunk's pools only when
    complete)."""
    cfg = TextModelConfig.from_file(Path(default_model()) / "config.json")
    kpool, block_size, num_blocks = cfg.index_kpool, 16, 500
    rng = random.Random()
    contexts = [rng.randrange(1, 300) for _ in range(rng.randrange(1, 6))]
    tables = [rng.sample(range(num_blocks), c // block_size + 1) for c in contexts]
    chunk = (rng.randrange(0, 40), rng.randrange(2, 30))  # a prompt chunk after the decodes
    chunk_table = rng.sample(range(num_blocks), (sum(chunk) - 1) // block_size + 1)
    requests = [BatchRequest(c, 1, t, i, True) for i, (c, t) in enumerate(zip(contexts, tables))]
    batch = make_forward_batch(requests + [BatchRequest(*chunk, chunk_table, 9, True)], cfg, block_size, num_blocks, "cpu")
    width = max(len(t) for t in tables + [chunk_table])
    longest = max([c + 1 for c in contexts] + [sum(chunk)])
    assert batch.seq_len_bound == 1 << (longest - 1).bit_length()
    assert batch.block_tables.shape[1] == max(1 << (width - 1).bit_length(), -(-batch.seq_len_bound // block_size))

    def row(table, p):
        return table[p // block_size] * block_size + p % block_size

    def pool_row(table, p):
        per_block = block_size // kpool
        return table[p // kpool // per_block] * per_block + p // kpool % per_block

    want_members, want_pools = [], []
    for c, t in zip(contexts, tables):  # the decode writes position c
        first = c - c % kpool
        want_members.append([row(t, min(p, c)) for p in range(first, first + kpool)])
        want_pools.append(pool_row(t, c))
    start, n = chunk
    for last in range(start, start + n):
        if last % kpool == kpool - 1:
            want_members.append([row(chunk_table, p) for p in range(last + 1 - kpool, last + 1)])
            want_pools.append(pool_row(chunk_table, last))
    assert batch.pools.member_rows.tolist() == want_members and batch.pools.pool_rows.tolist() == want_pools


def test_plain_decode_steps_build_the_metadata_the_general_path_builds(monkeypatch):
    """From `VECTOR_DECODES` plain decodes on, rows and pools come from array arithmetic: the
    same tensors, same dtypes, as the per-token lists give (random contexts, tables, block
    sizes, padding-row-like requests of one block repeated)."""
    from oxserve.model import batch as batch_module

    cfg = TextModelConfig.from_file(Path(default_model()) / "config.json")
    rng = random.Random()
    for _ in range(20):
        block_size, num_blocks = cfg.index_kpool * rng.choice([1, 2, 4, 16]), 3_000
        requests = []
        for slot in range(rng.randrange(batch_module.VECTOR_DECODES, 40)):
            context = rng.randrange(1, 900)
            ids = rng.sample(range(num_blocks), context // block_size + 1 + rng.randrange(2))
            if rng.random() < 0.1:
                context, ids = 1, [num_blocks - 1] * 2
            requests.append(BatchRequest(context, 1, ids, slot, True))
        vector = make_forward_batch(requests, cfg, block_size, num_blocks, "cpu")
        monkeypatch.setattr(batch_module, "VECTOR_DECODES", 1 << 30)
        lists = make_forward_batch(requests, cfg, block_size, num_blocks, "cpu")
        monkeypatch.undo()
        assert vector.num_decodes == lists.num_decodes == len(requests) and vector.num_verifies == 0
        for name in ("positions", "request_index", "cache_rows", "block_tables", "state_slots", "has_initial_state",
                     "logits_indices"):
            a, b = getattr(vector, name), getattr(lists, name)
            assert a.dtype == b.dtype and torch.equal(a, b), name
        for name in ("member_rows", "pool_rows"):
            a, b = getattr(vector.pools, name), getattr(lists.pools, name)
            assert a.dtype == b.dtype and torch.equal(a, b), name


@pytest.mark.parametrize("rings", [False, True], ids=["write-back", "replay-rings"])
def test_decodes_written_into_a_batch_of_their_shape_equal_a_batch_made_for_them(rings):
    """`DecodeRows` (a steady captured step's inputs, written in place step after step)
    against `make_forward_batch` for the same plain decodes: every tensor, the token ids, and
    the ReplaySSM book advanced alike. Random contexts, tables, slots, block sizes and batch
    sizes on both sides of `VECTOR_DECODES`; between steps requests advance a token, gain
    blocks (their lists appended to, as `BlockIds` does), are replaced by others or swap rows."""
    cfg = TextModelConfig.from_file(Path(default_model()) / "config.json")
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    num_blocks, num_slots, compared = 3_000, 100, 0
    for trial in range(40):
        block_size, n, bound = cfg.index_kpool * rng.choice([1, 2, 4, 16]), rng.randrange(1, 40), rng.choice([64, 256, 1024])

        def decode(slot: int) -> BatchRequest:
            context = rng.randrange(bound // 2, bound - 8)  # (its sequence, context + 1, within the bound a few steps on)
            return BatchRequest(context, 1, rng.sample(range(num_blocks), context // block_size + 1), slot, True)

        requests = [decode(slot) for slot in rng.sample(range(num_slots), n)]
        books = [ReplayBook(num_slots, 5) for _ in range(2)] if rings else [None] * 2
        counts = [rng.randrange(6) for _ in range(num_slots)]
        for book in books if rings else ():
            book.counts = list(counts)
        first = make_forward_batch(requests, cfg, block_size, num_blocks, "cpu", ReplayBook(num_slots, 5) if rings else None)
        token_ids = torch.zeros(n, dtype=torch.long)
        rows = DecodeRows(first, token_ids)
        for step in range(6):
            if step:  # the next step's requests: one more token each; some gain a block, leave, or move
                for r, req in enumerate(requests):
                    ids = req.block_ids
                    if (req.num_computed_tokens + 1) // block_size >= len(ids):
                        ids.append(rng.randrange(num_blocks))  # (the same list, appended to)
                    requests[r] = BatchRequest(req.num_computed_tokens + 1, 1, ids, req.state_slot, True)
                if rng.random() < 0.3:
                    requests[rng.randrange(n)] = decode(num_slots - 1 - step)
                if rng.random() < 0.3:
                    i, j = rng.randrange(n), rng.randrange(n)
                    requests[i], requests[j] = requests[j], requests[i]
                if table_shape(requests, block_size) != (first.seq_len_bound, first.block_tables.shape[1]):
                    break
            tokens = [rng.randrange(cfg.vocab_size) for _ in range(n)]
            made = make_forward_batch(requests, cfg, block_size, num_blocks, "cpu", books[0])
            rows.write(requests, tokens, num_blocks, cfg.index_kpool, books[1])
            where = f"(seed {seed}, trial {trial}, step {step}, {n} decodes, block size {block_size})"
            assert token_ids.tolist() == tokens, where
            for name in ("positions", "request_index", "cache_rows", "block_tables", "state_slots", "has_initial_state",
                         "logits_indices"):
                assert torch.equal(getattr(first, name), getattr(made, name)), f"{name} {where}"
            for name in ("member_rows", "pool_rows"):
                assert torch.equal(getattr(first.pools, name), getattr(made.pools, name)), f"{name} {where}"
            if rings:
                assert torch.equal(first.rings.decode_counts, made.rings.decode_counts), where
                assert books[1].counts == books[0].counts, where
            compared += 1
    assert compared > 100, f"seed {seed}: {compared} steps compared"


def test_decodes_that_do_not_fit_the_batch_are_refused():
    cfg = TextModelConfig.from_file(Path(default_model()) / "config.json")
    requests = [BatchRequest(20 + i, 1, [i], i, True) for i in range(3)]
    batch = make_forward_batch(requests, cfg, 64, 10, "cpu")
    rows = DecodeRows(batch, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="do not fit"):
        rows.write(requests[:2], [1, 2], 10, cfg.index_kpool)
    with pytest.raises(ValueError, match="rings"):
        rows.write(requests, [1, 2, 3], 10, cfg.index_kpool, ReplayBook(3, 4))
    with pytest.raises(ValueError, match="past the blocks"):
        rows.write([BatchRequest(70, 1, [0], 0, True)] + requests[1:], [1, 2, 3], 10, cfg.index_kpool)
    with pytest.raises(ValueError, match="plain decodes"):
        DecodeRows(make_forward_batch([BatchRequest(0, 3, [0], 0, True)], cfg, 64, 10, "cpu"), torch.zeros(3, dtype=torch.long))
