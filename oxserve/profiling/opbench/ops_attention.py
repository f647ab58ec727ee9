"""MLA latent attention over the selected latents (gathered in torch, in place natively), DSA indexer
scoring/selection and its key store with pool compression (decode).

Both read a paged cache. A case is a decode batch: request 0 has exactly `context` tokens,
the others between context/2 and context, their blocks scattered at random over the cache:

    block_tables[r] = [b7, b2, b11, ...]      row of position p = block * block_size + p % block_size
"""

from __future__ import annotations

import math

import torch

from oxserve.cache.layers import FP8, MLACache, ScaledRows
from oxserve.kernels.mla_attention import latent_attention
from oxserve.model.batch import ForwardBatch, PoolCompletions, power_of_two
from oxserve.model.indexer import Indexer
from oxserve.model.mla import QUERY_BLOCK, MLAttention
from oxserve.profiling.opbench.checks import bind_params, close_for, precision_of, randint, randn, randperm
from oxserve.profiling.opbench.registry import Case, Op, register_op

BLOCK_SIZE = 64
FP32 = torch.float32


def _paging(batch: int, context: int, block_size: int, device, gen) -> dict:
    contexts = randint(gen, max(context // 2, 1), context + 1, batch, device=device)
    contexts[0] = context
    width = math.ceil(context / block_size)
    num_blocks = batch * width + 1
    blocks = randperm(gen, num_blocks, device)[: batch * width].view(batch, width)
    return {"contexts": contexts, "block_tables": blocks, "request": torch.arange(batch, device=device)}


def _decode_batch(i: dict, block_size: int) -> ForwardBatch:
    """A decode batch over the case's paging. These ops read only its paging fields."""
    batch = i["block_tables"].shape[0]
    device = i["block_tables"].device
    return ForwardBatch(
        query_lens=[1] * batch, context_lens=(i["contexts"] - 1).tolist(), num_decodes=batch,
        positions=i["contexts"] - 1, request_index=i["request"], cache_rows=torch.ones(batch, dtype=torch.long, device=device),
        block_tables=i["block_tables"], state_slots=i["request"], has_initial_state=torch.ones(batch, dtype=torch.bool, device=device),
        block_size=block_size, seq_len_bound=power_of_two(int(i["contexts"].max())), logits_indices=i["request"],
    )


def _rows(i: dict, r: int, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    return i["block_tables"][r, positions // block_size] * block_size + positions % block_size


# ---- MLA latent attention -------------------------------------------------------------------


def _selected_per_query(cfg, context: int) -> int:
    return min(context, cfg.index_topk + cfg.index_kpool - 1)


def _attention_inputs(cfg, batch: int, context: int, dtype, device, gen) -> dict:
    i = _paging(batch, context, BLOCK_SIZE, device, gen)
    width = _selected_per_query(cfg, context)
    positions = torch.full((batch, width), -1, dtype=torch.long, device=device)
    for r, n in enumerate(i["contexts"].tolist()):
        chosen = randperm(gen, n, device)[: min(n, width)]
        positions[r, : chosen.numel()] = chosen
    rows = (i["block_tables"].numel() + 1) * BLOCK_SIZE
    c = cfg.kv_lora_rank
    return {
        **i, "positions": positions,
        "q_latent": randn(gen, batch, cfg.num_attention_heads, c, dtype=dtype, device=device),
        "latent": randn(gen, rows, c, dtype=dtype, device=device),
    }


def reference_attention(cfg, i):
    scale = cfg.qk_head_dim**-0.5
    q, out = i["q_latent"].double(), torch.empty_like(i["q_latent"], dtype=torch.float64)
    for r in range(q.shape[0]):
        chosen = i["positions"][r][i["positions"][r] >= 0]
        latents = i["latent"][_rows(i, r, chosen, BLOCK_SIZE)].double()  # [K, C]
        probs = torch.softmax(q[r] @ latents.T * scale, dim=-1)  # [H, K]
        out[r] = probs @ latents
    return (out,)


def attention_candidate(cfg, i):
    with torch.device("meta"):  # only `scale` and the method are used: no weights needed
        attn = MLAttention(cfg, has_indexer=False, name="bench")
    batch, cache = _decode_batch(i, BLOCK_SIZE), MLACache(i["latent"])

    def run(out):
        q, pos, req = i["q_latent"], i["positions"], i["request"]
        for s in range(0, q.shape[0], QUERY_BLOCK):  # as MLAttention.forward does
            e = min(s + QUERY_BLOCK, q.shape[0])
            out[0][s:e] = attn._attend(q[s:e], pos[s:e], req[s:e], batch, cache)
    return run


def _attention_cost(i) -> tuple[float, float]:
    selected = int((i["positions"] >= 0).sum())
    q = i["q_latent"]
    heads, c = q.shape[1], q.shape[2]
    return (selected * c + 2 * q.numel()) * q.element_size() + i["positions"].numel() * 8, 4.0 * heads * c * selected


def _attention_cases(cfg, shapes, dtype, device):
    return [
        Case(f"B={b} ctx={n}", lambda gen, b=b, n=n: _attention_inputs(cfg, b, n, dtype, device, gen),
             lambda i: (torch.empty_like(i["q_latent"]),), _attention_cost, precision_of(dtype))
        for b in shapes.batches for n in shapes.contexts
    ]


def native_attention_candidate(cfg, i):
    scale = cfg.qk_head_dim**-0.5

    def run(out):
        out[0].copy_(latent_attention(i["q_latent"], i["positions"], i["request"], i["block_tables"], BLOCK_SIZE,
                                      i["latent"], scale))
    return run


register_op(Op("mla.attention", _attention_cases, reference_attention, close_for("q_latent"),
               {"torch": attention_candidate, "native": native_attention_candidate}))


# ---- the same on an int8 or fp8 latent cache (`--kv-cache-dtype int8|fp8`) -------------------
# The inputs carry the table as stored (values, scales) and, for the reference, the latents as
# the table reads them (dequantized to the activation dtype); candidates bind a ScaledRows view.


def _scaled_attention_cases(kind: torch.dtype):
    def cases(cfg, shapes, dtype, device):
        def inputs(gen, b, n):
            i = _attention_inputs(cfg, b, n, dtype, device, gen)
            table = ScaledRows.zeros(*i["latent"].shape, kind, dtype, device)
            table.store(torch.arange(len(i["latent"]), device=device), i["latent"])
            return {**i, "latent": table.gather(torch.arange(len(i["latent"]), device=device)),
                    "latent_values": table.values, "latent_scales": table.scales}

        def cost(i) -> tuple[float, float]:
            selected = int((i["positions"] >= 0).sum())
            q = i["q_latent"]
            return (selected * (q.shape[2] + 4) + 2 * q.numel() * q.element_size() + i["positions"].numel() * 8,
                    4.0 * q.shape[1] * q.shape[2] * selected)

        return [Case(f"B={b} ctx={n}", lambda gen, b=b, n=n: inputs(gen, b, n),
                     lambda i: (torch.empty_like(i["q_latent"]),), cost, precision_of(dtype))
                for b in shapes.batches for n in shapes.contexts]
    return cases


def scaled_table_candidate(candidate, kind: torch.dtype):
    """`candidate` on the case's latents as the int8/fp8 table stores them."""
    def bind(cfg, i):
        table = ScaledRows(i["latent_values"], i["latent_scales"], kind, i["q_latent"].dtype)
        return candidate(cfg, {**i, "latent": table})
    return bind


for _kind, _name in ((torch.int8, "int8"), (FP8, "fp8")):
    register_op(Op(f"mla.attention_{_name}", _scaled_attention_cases(_kind), reference_attention, close_for("q_latent"),
                   {"torch": scaled_table_candidate(attention_candidate, _kind),
                    "native": scaled_table_candidate(native_attention_candidate, _kind)}))


# ---- DSA indexer: score pools, keep the best, add the tail -----------------------------------


def _indexer_inputs(cfg, batch: int, context: int, dtype, device, gen) -> dict:
    i = _paging(batch, context, BLOCK_SIZE, device, gen)
    pools = (i["block_tables"].numel() + 1) * BLOCK_SIZE // cfg.index_kpool
    heads, dim = cfg.index_n_heads, cfg.index_head_dim
    return {
        **i, "query_pos": i["contexts"] - 1,
        # as the projections give them: the activation dtype, head weights not yet scaled
        "q": randn(gen, batch, heads, dim, dtype=dtype, device=device),
        "head_weights": randn(gen, batch, heads, dtype=dtype, device=device),
        "pool_keys": randn(gen, pools, dim, dtype=dtype, device=device),
    }


def _indexer_width(cfg, context: int) -> int:
    pools = min(cfg.index_topk // cfg.index_kpool, context // cfg.index_kpool)
    tail = cfg.index_kpool - 1 if cfg.index_kpool_always_select_tail and cfg.index_kpool > 1 else 0
    return pools * cfg.index_kpool + tail


def reference_indexer(cfg, i):
    """Pool scores [B, most pools], -inf where not visible. The check judges a selection by
    them, so that near-ties may go either way."""
    kpool, dim = cfg.index_kpool, cfg.index_head_dim
    per_block = BLOCK_SIZE // kpool
    batch = i["q"].shape[0]
    scores = torch.full((batch, int(i["contexts"].max()) // kpool), float("-inf"), dtype=torch.float64)
    for r in range(batch):
        visible = (int(i["query_pos"][r]) + 1) // kpool
        pool = torch.arange(visible, device=i["q"].device)
        keys = i["pool_keys"][i["block_tables"][r, pool // per_block] * per_block + pool % per_block].double()
        per_head = torch.relu(i["q"][r].double() @ keys.T * dim**-0.5)  # [H, pools]
        weights = i["head_weights"][r].double() * cfg.index_n_heads**-0.5
        scores[r, :visible] = (weights @ per_head).cpu()
    return (scores,)


def check_indexer(cfg, out, ref, inputs, tolerance: float = 1e-4) -> str | None:
    """Each query must get whole pools -- as many as it may keep, none scoring clearly below
    one left out -- plus exactly its incomplete tail pool."""
    kpool, keep = cfg.index_kpool, cfg.index_topk // cfg.index_kpool
    with_tail = cfg.index_kpool_always_select_tail and kpool > 1
    got, scores = out[0].cpu(), ref[0]
    if (got < -1).any():
        return "output 0: values below -1 (not written)"
    for r in range(got.shape[0]):
        pos = int(inputs["query_pos"][r])
        visible = (pos + 1) // kpool
        chosen = sorted(got[r][got[r] >= 0].tolist())
        in_pools = [p for p in chosen if p < visible * kpool]
        tail = [p for p in chosen if p >= visible * kpool]
        want_tail = list(range(visible * kpool, pos + 1)) if with_tail else []
        if tail != want_tail:
            return f"query {r}: tail {tail}, expected {want_tail}"
        pools = sorted({p // kpool for p in in_pools})
        if in_pools != [q * kpool + o for q in pools for o in range(kpool)]:
            return f"query {r}: selected positions are not whole pools"
        if len(pools) != min(keep, visible):
            return f"query {r}: {len(pools)} pools selected, expected {min(keep, visible)}"
        row = scores[r, :visible]
        kept = torch.zeros(visible, dtype=torch.bool)
        kept[pools] = True
        if kept.all():
            continue
        best_left, worst_kept = row[~kept].max().item(), row[kept].min().item()
        if best_left - worst_kept > tolerance * max(row.abs().max().item(), 1e-12):
            return f"query {r}: a pool scoring {best_left:.6g} was left out while one scoring {worst_kept:.6g} was kept"
    return None


def indexer_candidate(cfg, i, native_scores: bool = True):
    with torch.device("meta"):  # _select uses the config values only, not the weights
        indexer = Indexer(cfg)
    indexer.native_scores = native_scores
    batch = _decode_batch(i, BLOCK_SIZE)
    cache = MLACache(torch.empty(0, device=i["q"].device), pool_keys=i["pool_keys"])
    longest = max(batch.seq_lens)

    def run(out):
        out[0].copy_(indexer._select(i["q"], i["head_weights"], i["query_pos"], batch, i["request"], longest, cache))
    return run


def _indexer_cost_for(kpool: int):
    def cost(i) -> tuple[float, float]:
        scored = float(((i["query_pos"] + 1) // kpool).sum())  # pool keys scored, all queries
        heads, dim = i["q"].shape[1], i["q"].shape[2]
        data = scored * dim * i["pool_keys"].element_size() + (i["q"].numel() + i["head_weights"].numel()) * i["q"].element_size()
        return data, scored * heads * (2 * dim + 2)
    return cost


def _indexer_cases(cfg, shapes, dtype, device):
    return [
        Case(f"B={b} ctx={n}", lambda gen, b=b, n=n: _indexer_inputs(cfg, b, n, dtype, device, gen),
             lambda i, b=b, n=n: (torch.empty(b, _indexer_width(cfg, n), dtype=torch.long, device=device),),
             _indexer_cost_for(cfg.index_kpool), "fp32")
        for b in shapes.batches for n in shapes.contexts if n >= cfg.index_kpool
    ]


register_op(Op("dsa.indexer", _indexer_cases, reference_indexer, check_indexer,
               {"engine": indexer_candidate, "torch": lambda cfg, i: indexer_candidate(cfg, i, native_scores=False)}))


# ---- DSA indexer key store and pool compression (decode) -----------------------------------


def _store_inputs(cfg, batch: int, dtype, device, gen) -> dict:
    """A decode batch: each request stores one key and compresses its pool, whose other
    members are earlier tokens (rows scattered over a table of 64 rows a request)."""
    dim, kpool, rows = cfg.index_head_dim, cfg.index_kpool, 64 * batch
    order = randperm(gen, rows, device)
    members = order[batch:].view(-1)[: batch * kpool].view(batch, kpool).clone()
    members[:, -1] = order[:batch]  # the new token closes its pool
    return {
        "raw": randn(gen, batch, dim, dtype=dtype, device=device, scale=3.0),
        "gates": randn(gen, batch, dim, dtype=dtype, device=device),
        "k_norm_weight": randn(gen, dim, dtype=dtype, device=device, scale=0.5) + 1,
        "k_norm_bias": randn(gen, dim, dtype=dtype, device=device, scale=0.1),
        "compress_ape": randn(gen, kpool, dim, dtype=dtype, device=device),
        "rows": order[:batch].clone(), "member_rows": members,
        "pool_rows": randperm(gen, rows // kpool, device)[:batch].clone(),
        "key_table": randn(gen, rows, dim, dtype=dtype, device=device),
        "gate_table": randn(gen, rows, dim, dtype=dtype, device=device),
        "pool_table": randn(gen, rows // kpool, dim, dtype=dtype, device=device),
    }


def reference_store_keys(cfg, i):
    """The stored keys (layer-normed) and each compressed pool key: the softmax over the pool's
    tokens of gate + position bias, per channel, weighting their keys (fp64)."""
    keys, gates = i["key_table"].double().clone(), i["gate_table"].double().clone()
    keys[i["rows"]] = torch.nn.functional.layer_norm(i["raw"].double(), (keys.shape[1],), i["k_norm_weight"].double(),
                                                     i["k_norm_bias"].double(), eps=1e-6)  # fmt: skip
    gates[i["rows"]] = i["gates"].double()
    members = i["member_rows"]
    probs = (gates[members] + i["compress_ape"].double()).softmax(dim=1)
    return keys[i["rows"]], (probs * keys[members]).sum(1)


def store_keys_candidate(cfg, i, native: bool = True):
    with torch.device("meta"):
        indexer = Indexer(cfg)
    bind_params(indexer, **{name: i[name] for name in ("k_norm_weight", "k_norm_bias", "compress_ape")})
    indexer.native_store = native
    cache = MLACache(torch.empty(0, device=i["raw"].device), i["key_table"], i["gate_table"], i["pool_table"])
    pools = PoolCompletions(i["member_rows"], i["pool_rows"])

    def run(out):
        indexer.store_step_keys(i["raw"], i["gates"], i["rows"], pools, cache)
        out[0].copy_(i["key_table"][i["rows"]])
        out[1].copy_(i["pool_table"][i["pool_rows"]])
    return run


def _store_cases(cfg, shapes, dtype, device):
    def cost(i) -> tuple[float, float]:
        moved = (2 * i["raw"].numel() + i["member_rows"].numel() * i["raw"].shape[1] * 2 + i["pool_rows"].numel() * i["raw"].shape[1])
        return moved * i["raw"].element_size(), 10.0 * i["member_rows"].numel() * i["raw"].shape[1]
    return [
        Case(f"B={b}", lambda gen, b=b: _store_inputs(cfg, b, dtype, device, gen),
             lambda i: (torch.empty_like(i["raw"]), torch.empty_like(i["raw"])), cost, "fp32")
        for b in shapes.batches
    ]


register_op(Op("dsa.store_keys", _store_cases, reference_store_keys, close_for("raw"),
               {"engine": store_keys_candidate, "torch": lambda cfg, i: store_keys_candidate(cfg, i, native=False)},
               weights=("k_norm_weight", "k_norm_bias", "compress_ape")))
