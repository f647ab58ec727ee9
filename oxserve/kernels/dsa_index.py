"""DSA indexer scores of decoding queries over their pool keys, on the paged cache in place.

`index_scores` runs `native/dsa_index.c` on CPU for a bf16 or fp32 pool-key table, or an
int8/fp8 one (`ScaledRows`, read as torch reads it); the torch form (`Indexer._select`:
gather the keys, two products) runs elsewhere, and is what the kernel is tested against. `top_pools` chooses each query's best pools
by one rule everywhere (ties to the lower pool; `top_pools_torch` is its torch form), in one
native pass on CPU, and `expand_selection` turns them into positions in another
(`expand_selection_torch` is its torch form). `store_keys` writes a
step's keys and compresses the pools it completes (`Indexer._write_keys`' torch form).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from oxserve.cache.layers import NATIVE_KINDS, ScaledRows
from oxserve.kernels import native

BUILD_FLAGS = native.NATIVE_ISA + native.OPENMP + ("-O3", "-ffp-contract=fast")
NATIVE_MAX_DIM = 1024  # MAX_DIM in dsa_index.c
NATIVE_MAX_HEADS = 256  # MAX_HEADS in dsa_index.c
NATIVE_MAX_QUERY = 16384  # MAX_QUERY in dsa_index.c: heads x head dim


def index_scores_fit(q: torch.Tensor, head_weights: torch.Tensor, pool_keys) -> bool:
    """Whether the kernel can score these queries on this pool-key table: a plain bf16 or fp32
    one, or int8/fp8 rows read as bf16 or fp32."""
    heads, dim = q.shape[-2:]
    if isinstance(pool_keys, ScaledRows):
        table_fits = (pool_keys.dtype in NATIVE_KINDS and pool_keys.read_as in (torch.bfloat16, torch.float32)
                      and pool_keys.values.is_contiguous() and pool_keys.scales.is_contiguous())
    else:
        table_fits = pool_keys.dtype in (torch.bfloat16, torch.float32) and pool_keys.is_contiguous()
    return (table_fits and q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float32)
            and head_weights.dtype == q.dtype and dim <= NATIVE_MAX_DIM and heads <= NATIVE_MAX_HEADS
            and heads * dim <= NATIVE_MAX_QUERY and _kernel() is not None)  # fmt: skip


def index_scores(q: torch.Tensor, head_weights: torch.Tensor, query_pos: torch.Tensor, pool: int, request: torch.Tensor,
                 block_tables: torch.Tensor, pools_per_block: int, pool_keys: torch.Tensor | ScaledRows, num_pools: int,
                 scale: float, weight_scale: float = 1.0, hidden: float = 0.0) -> torch.Tensor:
    """q [T, H, D], head_weights [T, H] (both bf16 or both fp32, as projected), query_pos [T]
    -> [T, num_pools] fp32: sum_h weight_scale w_h relu(scale q_h . key_p) for the pools each
    query sees ((pos + 1) // pool of them), `hidden` for the others (-inf: what a top-k over
    them should skip)."""
    tokens, heads, dim = q.shape
    q, head_weights = q.contiguous(), head_weights.contiguous()
    query_pos, request, block_tables = (t.contiguous() for t in (query_pos, request, block_tables))
    out = torch.empty(tokens, num_pools, dtype=torch.float32)
    ptr = native.pointer
    if isinstance(pool_keys, ScaledRows):
        keys, scales, kind, read_as = ptr(pool_keys.values), ptr(pool_keys.scales), NATIVE_KINDS[pool_keys.dtype], pool_keys.read_as
    else:
        keys, scales, kind, read_as = ptr(pool_keys), None, 0, pool_keys.dtype
    status = _kernel().dsa_index_scores(ptr(q), ptr(head_weights), int(q.dtype == torch.bfloat16), weight_scale,
                                        ptr(query_pos), pool, ptr(request), ptr(block_tables), block_tables.shape[1],
                                        pools_per_block, keys, scales, kind, int(read_as == torch.bfloat16), tokens,
                                        heads, dim, num_pools, scale, hidden, ptr(out), torch.get_num_threads())  # fmt: skip
    if status != 0:
        raise RuntimeError(f"dsa_index_scores failed ({status}): {heads} heads of {dim}")
    return out


def top_pools_torch(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The k highest scores' pools of each row of scores [T, P] (k <= P; NaN above +inf, the
    lower pool first among equal scores), in ascending pool order: int64 [T, k]."""
    best = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    return best.sort(dim=-1).values


def top_pools(scores: torch.Tensor, k: int, hidden_from: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
    """`top_pools_torch` in one native pass on CPU (fp32 scores): a replayed decode step calls
    it with its other kernels, where torch.topk's cold code cost 130-150 us a call at batch 32
    (docs/performance.md, "The indexer's pools chosen natively"). `hidden_from`: (query
    positions [T], kpool) where row t's pools at and past (pos + 1) // kpool score -inf (as
    `index_scores` hides them): the same choice, without reading those pools."""
    if not 0 <= k <= scores.shape[-1] < 2**31:
        raise ValueError(f"top_pools: {k} of {scores.shape[-1]} pools")
    if scores.device.type != "cpu" or scores.dtype != torch.float32 or scores.dim() != 2 or _kernel() is None:
        return top_pools_torch(scores, k)
    scores = scores.contiguous()
    chosen = torch.empty(scores.shape[0], k, dtype=torch.int64)
    pos, kpool = (None, 0) if hidden_from is None else (hidden_from[0].to(torch.int64).contiguous(), hidden_from[1])
    if pos is not None and (pos.shape != (scores.shape[0],) or kpool < 1):
        raise ValueError(f"top_pools: {tuple(pos.shape)} query positions for {scores.shape[0]} rows, kpool {kpool}")
    if _kernel().dsa_top_pools(scores.data_ptr(), scores.shape[0], scores.shape[1], k,
                               None if pos is None else pos.data_ptr(), kpool, chosen.data_ptr(), torch.get_num_threads()) != 0:
        raise MemoryError(f"dsa_top_pools: no scratch memory for rows of {scores.shape[1]} pools")
    return chosen


def expand_selection_torch(chosen: torch.Tensor, visible_pools: torch.Tensor, query_pos: torch.Tensor, pool: int,
                           tail: bool) -> torch.Tensor:
    """The positions [T, k P (+ P - 1)] a query attends to: the P positions of each pool top-k
    chose (chosen [T, k]; -1 for a pool the query does not see, which top-k took to fill k),
    then, with `tail`, the positions of the query's own incomplete pool up to itself (-1 past it)."""
    chosen = chosen.masked_fill(chosen >= visible_pools.unsqueeze(1), -1)
    offsets = torch.arange(pool, device=chosen.device)
    positions = (chosen.unsqueeze(-1) * pool + offsets).masked_fill(chosen.unsqueeze(-1) < 0, -1).flatten(1)
    if tail and pool > 1:
        own = visible_pools.unsqueeze(1) * pool + offsets[:-1]
        positions = torch.cat([positions, own.masked_fill(own > query_pos.unsqueeze(1), -1)], dim=1)
    return positions


def expand_selection(chosen: torch.Tensor, visible_pools: torch.Tensor | None, query_pos: torch.Tensor, pool: int,
                     tail: bool) -> torch.Tensor:
    """`expand_selection_torch` in one native pass on CPU (int64 tensors); `visible_pools`
    None: each query's complete pools, (query_pos + 1) // pool."""
    if chosen.device.type != "cpu" or _kernel() is None:
        visible_pools = (query_pos + 1) // pool if visible_pools is None else visible_pools
        return expand_selection_torch(chosen, visible_pools, query_pos, pool, tail)
    chosen, query_pos = (t.to(torch.int64).contiguous() for t in (chosen, query_pos))
    visible = None if visible_pools is None else visible_pools.to(torch.int64).contiguous()
    tokens, k = chosen.shape
    tail = tail and pool > 1
    out = torch.empty(tokens, k * pool + (pool - 1 if tail else 0), dtype=torch.int64)
    _kernel().dsa_expand_selection(chosen.data_ptr(), tokens, k, None if visible is None else visible.data_ptr(),
                                   query_pos.data_ptr(), pool, tail, out.data_ptr())
    return out


def store_keys_fit(raw: torch.Tensor, key_table, gate_table, pool_table, *params: torch.Tensor) -> bool:
    """The native store runs tables of the keys' own dtype (key and pool tables may be int8 /
    fp8 rows read as it), with the other inputs (`params`: gate scores, norm weight and bias,
    position bias) in it too."""
    def fits(table) -> bool:
        if isinstance(table, ScaledRows):
            return (table.dtype in NATIVE_KINDS and table.read_as == raw.dtype and table.values.is_contiguous()
                    and table.scales.is_contiguous())
        return isinstance(table, torch.Tensor) and table.dtype == raw.dtype and table.is_contiguous()
    return (raw.device.type == "cpu" and raw.dtype in (torch.bfloat16, torch.float32)
            and fits(key_table) and fits(pool_table) and isinstance(gate_table, torch.Tensor) and fits(gate_table)
            and all(t.dtype == raw.dtype for t in params)
            and raw.shape[-1] <= NATIVE_MAX_DIM and _kernel() is not None)  # fmt: skip


def _scaled_parts(table) -> tuple:
    """(values, scales, kind) pointers of a key table for the kernel (kind 0: a plain table)."""
    if isinstance(table, ScaledRows):
        return native.pointer(table.values), native.pointer(table.scales), NATIVE_KINDS[table.dtype]
    return native.pointer(table), None, 0


def _rows(table) -> int:
    return len(table.values) if isinstance(table, ScaledRows) else len(table)


def store_keys(raw: torch.Tensor, gates: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor, eps: float,
               rows: torch.Tensor, key_table: torch.Tensor | ScaledRows, gate_table: torch.Tensor, member_rows: torch.Tensor,
               pool_rows: torch.Tensor, ape: torch.Tensor, pool_table: torch.Tensor | ScaledRows) -> None:
    """Store this step's indexer keys (layer-normed `raw` [T, D]) and pool gate scores
    (`gates` [T, D]) at cache `rows` [T], then compress every pool the step completes
    (`member_rows` [N, P] -> `pool_rows` [N]): `Indexer._write_keys`' torch form in one pass."""
    tokens, dim = raw.shape
    num_pools, pool = member_rows.shape
    raw, gates, ln_weight, ln_bias, ape = (t.contiguous() for t in (raw, gates, ln_weight, ln_bias, ape))
    rows, member_rows, pool_rows = (t.to(torch.int64).contiguous() for t in (rows, member_rows, pool_rows))
    if gates.shape != raw.shape or ln_weight.numel() != dim or ln_bias.numel() != dim or ape.shape != (pool, dim):
        raise ValueError(f"store_keys: gates {tuple(gates.shape)}, norm {ln_weight.numel()}/{ln_bias.numel()} and "
                         f"position bias {tuple(ape.shape)} do not fit keys {tuple(raw.shape)} in pools of {pool}")
    ptr = native.pointer
    status = _kernel().dsa_store_keys(ptr(raw), ptr(gates), ptr(ln_weight), ptr(ln_bias), eps, ptr(rows), tokens, dim,
                                      *_scaled_parts(key_table), ptr(gate_table), min(_rows(key_table), len(gate_table)), ptr(member_rows),
                                      ptr(pool_rows), num_pools, pool, ptr(ape), *_scaled_parts(pool_table),
                                      _rows(pool_table), int(raw.dtype == torch.bfloat16))  # fmt: skip
    if status == -2:
        raise IndexError("store_keys: a cache row is out of range")
    if status != 0:
        raise RuntimeError(f"dsa_store_keys failed ({status}): dim {dim}")


def select_every_pool(query_pos: torch.Tensor, num_pools: int, pool: int, tail: bool) -> torch.Tensor:
    """`expand_selection` of the pools [0, num_pools) for every query (what top-k keeps when
    there are no more pools than it may keep), in one native pass on CPU."""
    if query_pos.device.type != "cpu" or _kernel() is None:
        pools = torch.arange(num_pools, device=query_pos.device).expand(len(query_pos), -1)
        return expand_selection_torch(pools, (query_pos + 1) // pool, query_pos, pool, tail)
    query_pos = query_pos.to(torch.int64).contiguous()
    tail = tail and pool > 1
    out = torch.empty(len(query_pos), num_pools * pool + (pool - 1 if tail else 0), dtype=torch.int64)
    _kernel().dsa_expand_selection(None, len(query_pos), num_pools, None, query_pos.data_ptr(), pool, tail, out.data_ptr())
    return out


@functools.cache
def _kernel() -> ctypes.CDLL | None:
    lib = native.load("dsa_index", BUILD_FLAGS)
    if lib is None:
        return None
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    f32 = ctypes.c_float
    lib.dsa_index_scores.argtypes = [p, p, i32, f32, p, i64, p, p, i64, i64, p, p, i32, i32, i64, i32, i64, i64, f32, f32,
                                     p, i32]
    lib.dsa_expand_selection.argtypes = [p, i64, i64, p, p, i64, i32, p]
    lib.dsa_expand_selection.restype = None
    lib.dsa_top_pools.argtypes = [p, i64, i64, i64, p, i64, p, i32]
    lib.dsa_store_keys.argtypes = [p, p, p, p, ctypes.c_float, p, i64, i64, p, p, i32, p, i64, p, p, i64, i64, p, p, p, i32,
                                   i64, i32]
    return lib
