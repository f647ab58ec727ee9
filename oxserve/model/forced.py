"""A model run on caller-chosen tokens, from an empty cache: logits for every position.

Teacher forcing needs the logits at every position of a given sequence, through the same
batch metadata and cache paths the engine uses: the parity and fidelity tests feed the
reference's tokens this way, and quantization measures what a change does to each position's
distribution (`oxserve.quantization.quality`).
"""

from __future__ import annotations

import random

import torch

from oxserve.cache.precision import CachePlan
from oxserve.cache.replay import ReplayBook
from oxserve.cache.spec import CacheLayout
from oxserve.engine.capture import CapturedDecode, has_forward_hooks
from oxserve.model.batch import BatchRequest, make_forward_batch
from oxserve.model.glm5_next import Glm5NextForCausalLM

BLOCK_SIZE = 32


def forced_logits(
    model: Glm5NextForCausalLM, tokens: list[int], chunk: int, decode_from: int | None = None,
    shuffle: random.Random | None = None, cache_plan: CachePlan | None = None, kda_replay: int = 0,
    captured: bool = False,
) -> torch.Tensor:
    """Logits [L, V] (fp32) of every position of `tokens` (under tensor parallelism: on the
    first rank; None on the others, which run the same steps with it).

    Positions before `decode_from` (default: all) are prefilled in chunks of `chunk` tokens;
    the rest are decoded one token per step. The request uses state slot 1 of 2, and with
    `shuffle` its blocks are scattered over the cache at random: pages and slots need not be
    in order. `cache_plan`: the caches' precision (default: the model's dtype); `kda_replay`:
    decode KDA with ReplaySSM rings of this length (0: write-back); `captured`: decode steps
    through `CapturedDecode`, as the engine runs them unless `--enforce-eager` (not while the
    model has hooks, which a replay would skip: the parity tests' choice forcing).
    """
    cfg = model.config
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    decode_from = len(tokens) if decode_from is None else decode_from
    block_size = max(BLOCK_SIZE, cfg.index_kpool)
    blocks = -(-len(tokens) // block_size)
    layout = CacheLayout(num_blocks=blocks + 3, block_size=block_size, num_slots=2)
    caches = [spec.allocate(layout, "cpu") for spec in model.cache_specs(dtype, cache_plan, kda_replay)]
    rings = ReplayBook(layout.num_slots, kda_replay) if kda_replay else None
    table = shuffle.sample(range(layout.num_blocks), blocks) if shuffle else list(range(blocks))
    spans = [(s, min(s + chunk, decode_from)) for s in range(0, decode_from, chunk)]
    spans += [(p, p + 1) for p in range(decode_from, len(tokens))]
    replays = CapturedDecode(lambda ids, batch: model.compute_logits(model(ids, batch, caches), batch.tracer)) if captured else None
    outs = []
    for start, end in spans:
        request = BatchRequest(start, end - start, table, state_slot=1, samples=True)
        batch = make_forward_batch([request], cfg, block_size, layout.num_blocks, "cpu", rings)
        batch.logits_indices = torch.arange(end - start)  # every position, not just the last
        ids = torch.tensor(tokens[start:end])
        with torch.inference_mode():
            if replays is not None and replays.wants(batch) and not has_forward_hooks(model):
                outs.append(replays.run(ids, batch).clone())  # a replay's logits tensor is reused
            else:
                outs.append(model.compute_logits(model(ids, batch, caches)))
    return None if outs[0] is None else torch.cat(outs).float()
