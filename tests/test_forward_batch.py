"""Step metadata: the block table padded from the runner's per-request tensors equals the
one built from the Python lists, and `BlockIds` keeps its tensor in step with its list."""

import random
from pathlib import Path

import torch

from oxserve.default_model import default_model
from oxserve.model.batch import BatchRequest, BlockIds, make_forward_batch
from oxserve.model.config import TextModelConfig


def test_block_ids_grow_as_their_list():
    blocks = BlockIds()
    assert blocks.tensor().numel() == 0
    want: list[int] = []
    for _ in range(40):
        new = [random.randrange(10_000) for _ in range(random.choice([0, 1, 1, 3, 17]))]
        blocks.extend(new)
        want += new
        assert blocks.ids == want and blocks.tensor().tolist() == want


def test_tables_from_tensors_equal_tables_from_lists():
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
        held.append(BatchRequest(c, n, blocks.ids, slot, True, block_tensor=blocks.tensor()))
    a, b = (make_forward_batch(r, cfg, block_size, num_blocks, "cpu") for r in (plain, held))
    assert torch.equal(a.block_tables, b.block_tables) and torch.equal(a.cache_rows, b.cache_rows)
    assert torch.equal(a.pools.member_rows, b.pools.member_rows) and torch.equal(a.pools.pool_rows, b.pools.pool_rows)
