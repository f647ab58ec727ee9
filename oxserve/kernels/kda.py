"""Kimi Delta Attention (gated delta rule with a per-channel forget gate), in fp32, and the
short causal conv in front of it. Every function takes a packed batch of many requests.

Per head, with state S (Dk x Dv), q already l2-normalised and scaled, k l2-normalised:

    S_t = diag(exp(g_t)) S_{t-1}
    S_t = S_t + k_t (beta_t (v_t - k_t^T S_t))^T
    o_t = q_t^T S_t

`kda_recurrent_step` runs one token for each of a batch of requests (decode); `kda_chunked`
runs the prompt chunks of several requests at once in the WY/UT chunk form, laid out by a
`ChunkLayout`; `causal_conv` runs the conv over any mix of requests, laid out by a
`ConvLayout`. Layouts are built once per step from host-side lengths, so nothing here
reads a tensor back to the host. The plain references live in `oxserve.kernels.reference`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    # sqrt(sum + eps), not max(norm, eps): matches the FLA kernel the reference mirrors.
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def kda_recurrent_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per request. q,k,g: [B,H,Dk]; v: [B,H,Dv]; beta: [B,H]; state: [B,H,Dk,Dv].

    Returns (o [B,H,Dv], new state). All fp32.
    """
    b, h, dk, dv = state.shape
    # Batched (B*H) matrix products, and the rank-1 update in place on the decayed copy:
    # a few large ops instead of elementwise broadcasts over the [B,H,Dk,Dv] state.
    decayed = (state * g.exp().unsqueeze(-1)).view(b * h, dk, dv)
    k_rows = k.reshape(b * h, 1, dk)
    kv_mem = torch.bmm(k_rows, decayed).view(b, h, dv)
    delta = (v - kv_mem) * beta.unsqueeze(-1)
    decayed.baddbmm_(k_rows.transpose(1, 2), delta.view(b * h, 1, dv))
    out = torch.bmm(q.reshape(b * h, 1, dk), decayed).view(b, h, dv)
    return out, decayed.view(b, h, dk, dv)


# ---- chunked prefill ------------------------------------------------------------------------

# Within a chunk, exp(G_i - G_j) is computed as exp(G_i) * exp(-G_j): two small matmuls instead
# of a [C, C, Dk] tensor. That needs |G| <= SAFE_CHUNK_DECAY over a chunk, so that exp(+-G) stays
# a normal fp32 number (fp32 tops out at e^88.7 and its normals end at e^-87.3). A lower-bounded
# gate (|g| <= |lower_bound| per token) fixes the chunk size statically; an unbounded gate takes
# the exact form, which forms exp(G_i - G_j) directly.
SAFE_CHUNK_DECAY = 80.0
MAX_CHUNK = 16
# The exact form builds [chunks, C, C, Dk] per head: process chunks in groups of bounded size.
EXACT_GROUP_ELEMENTS = 1 << 24


def chunk_plan(lower_bound: float | None) -> tuple[int, bool]:
    """(chunk size, exact form?) for a forget gate with this lower bound (None: unbounded)."""
    if lower_bound is None or abs(lower_bound) > SAFE_CHUNK_DECAY:
        return MAX_CHUNK, True
    size = MAX_CHUNK
    while size * abs(lower_bound) > SAFE_CHUNK_DECAY:
        size //= 2
    return size, False


@dataclass(frozen=True)
class ChunkLayout:
    """Where each request's tokens sit in fixed-size chunks (padding points at a zero row).

        tokens (packed):  | r0 r0 r0 r0 r0 | r1 r1 |          chunk size 4
        token_index:      [[0 1 2 3] [4 P P P] [5 6 P P]]     P = num_tokens (the zero row)
        grid (request x chunk step):  [[0 1] [2 N]]           N = num_chunks (an identity chunk)
        token_pos:        [0 1 2 3 4 8 9]                     token -> chunk * size + offset
    """

    size: int
    exact: bool
    token_index: torch.Tensor  # [N, size] long
    grid: torch.Tensor  # [R, S] long
    token_pos: torch.Tensor  # [T] long

    @property
    def num_chunks(self) -> int:
        return self.token_index.shape[0]


def chunk_layout(lengths: list[int], size: int, exact: bool, device: torch.device | str) -> ChunkLayout:
    """The layout of requests with these token counts, packed one after the other."""
    total = sum(lengths)
    token_index: list[list[int]] = []
    rows: list[list[int]] = []
    token_pos: list[int] = []
    start = 0
    for n in lengths:
        chunks = -(-n // size)
        first = len(token_index)
        for c in range(chunks):
            idx = list(range(start + c * size, min(start + (c + 1) * size, start + n)))
            token_index.append(idx + [total] * (size - len(idx)))
        token_pos += [first * size + i for i in range(n)]
        rows.append(list(range(first, first + chunks)))
        start += n
    steps = max((len(r) for r in rows), default=0)
    num_chunks = len(token_index)
    grid = [r + [num_chunks] * (steps - len(r)) for r in rows]

    def as_long(values, shape):
        return torch.tensor(values, dtype=torch.long, device=device).reshape(shape)

    return ChunkLayout(
        size=size,
        exact=exact,
        token_index=as_long(token_index, (num_chunks, size)),
        grid=as_long(grid, (len(lengths), steps)),
        token_pos=as_long(token_pos, (total,)),
    )


def kda_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    layout: ChunkLayout,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed requests, chunk-parallel. q,k,g: [T,H,Dk]; v: [T,H,Dv]; beta: [T,H];
    states: [R,H,Dk,Dv] (the initial state of each request). Returns (o [T,H,Dv], final states).

    Within a chunk (positions i, j; G = cumulative log-decay from the chunk start):
        A[i,j]  = beta_i * sum_d k_i[d] k_j[d] exp(G_i[d] - G_j[d])      (j < i)
        T       = (I + A)^-1                                             (unit lower-triangular)
        U       = T (beta * v)          W = T (beta * k * exp(G))
        V_new   = U - W S_prev
        o_i     = (q_i * exp(G_i)) S_prev + sum_{j<=i} (q_i . k_j exp(G_i - G_j)) V_new_j
        S_next  = exp(G_last) * S_prev + sum_j (k_j exp(G_last - G_j)) V_new_j^T
    Everything that does not depend on S is computed for all chunks of all requests at once;
    only the state hand-off runs chunk step by chunk step, for all requests together.
    """
    q, k, v, g, beta = (_to_chunks(x, layout) for x in (q, k, v, g, beta))  # [H, N, C, ...]
    cum = g.cumsum(2)
    decay = cum.exp()
    kb = k * beta.unsqueeze(-1)
    a, qk = (_intra_exact if layout.exact else _intra_factored)(q, k, kb, cum)
    c = layout.size
    eye = torch.eye(c, dtype=q.dtype, device=q.device)
    t_inv = torch.linalg.solve_triangular(eye + a, eye.expand_as(a), upper=False, unitriangular=True)
    u = t_inv @ (v * beta.unsqueeze(-1))
    w = t_inv @ (kb * decay)
    q_dec = q * decay
    last = cum[:, :, -1:, :]  # [H, N, 1, Dk]
    k_to_end = (k * (last - cum).exp()).transpose(-1, -2)  # [H, N, Dk, C]
    last_decay = last.transpose(-1, -2).exp()  # [H, N, Dk, 1]
    # Chunk N is the identity: padding steps of shorter requests leave their state alone.
    u, w, q_dec, qk, k_to_end = (F.pad(x, (0, 0, 0, 0, 0, 1)) for x in (u, w, q_dec, qk, k_to_end))
    last_decay = F.pad(last_decay, (0, 0, 0, 0, 0, 1), value=1.0)
    out = torch.empty_like(u)
    state = states.transpose(0, 1)  # [H, R, Dk, Dv]
    for step in range(layout.grid.shape[1]):
        ids = layout.grid[:, step]

        def at(x: torch.Tensor) -> torch.Tensor:
            return x.index_select(1, ids)

        v_new = at(u) - at(w) @ state
        out.index_copy_(1, ids, at(q_dec) @ state + at(qk) @ v_new)  # repeated ids: the identity chunk
        state = state * at(last_decay) + at(k_to_end) @ v_new
    heads, dv = out.shape[0], out.shape[-1]
    flat = out[:, : layout.num_chunks].permute(1, 2, 0, 3).reshape(-1, heads, dv)
    return flat.index_select(0, layout.token_pos), state.transpose(0, 1)


def _to_chunks(x: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """[T, H, ...] -> [H, N, C, ...], padding rows zero (zeros leave the state unchanged)."""
    padded = torch.cat([x, x.new_zeros(1, *x.shape[1:])])
    chunks = padded.index_select(0, layout.token_index.flatten()).view(*layout.token_index.shape, *x.shape[1:])
    return chunks.movedim(2, 0).contiguous()


def _intra_factored(q, k, kb, cum):
    """A (strictly lower) and causal q.k, with exp(G_i - G_j) = exp(G_i) * exp(-G_j)."""
    decay, k_in = cum.exp(), k * (-cum).exp()
    a = ((kb * decay) @ k_in.transpose(-1, -2)).tril(-1)
    qk = ((q * decay) @ k_in.transpose(-1, -2)).tril(0)
    return a, qk


def _intra_exact(q, k, kb, cum):
    """The same two matrices with exp(G_i - G_j) formed directly: safe for any decay."""
    heads, n, c, dk = q.shape
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril(0)
    a = q.new_empty(heads, n, c, c)
    qk = q.new_empty(heads, n, c, c)
    group = max(1, EXACT_GROUP_ELEMENTS // (heads * c * c * dk))
    for s in range(0, n, group):
        e = min(s + group, n)
        g = cum[:, s:e]
        decay = (g.unsqueeze(3) - g.unsqueeze(2)).masked_fill(~causal[:, :, None], float("-inf")).exp()  # [H,n,C,C,Dk]
        a[:, s:e] = (kb[:, s:e].unsqueeze(3) * k[:, s:e].unsqueeze(2) * decay).sum(-1).tril(-1)
        qk[:, s:e] = (q[:, s:e].unsqueeze(3) * k[:, s:e].unsqueeze(2) * decay).sum(-1)
    return a, qk


# ---- causal conv ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ConvLayout:
    """Where each tap of each token's conv window reads from, in `source = [states; tokens]`
    (every request's K-1 previous inputs, flattened, then the step's new tokens):

        source rows:  | s0 s0 s0 s1 s1 s1 | t0 t0 t1 |          K = 4, request 0 has 2 new tokens
        taps[:, 1]:   [1, 2, 6, 7]         token 1 of request 0: inputs at offsets -2, -1, 0, +1
        final[0]:     [2, 6, 7]            its last K-1 inputs: the new conv state

    A token's output is sum_k w[:, k] * source[taps[k]]: K gathers and K multiply-adds for any
    mix of decodes and prefill chunks. Requests verifying drafts also get `windows`: the conv
    state after each of their tokens, so that rejected drafts can be undone."""

    taps: torch.Tensor  # [K, T]
    final: torch.Tensor  # [R, K-1]
    windows: torch.Tensor | None = None  # [V, max tokens, K-1]: the last K-1 inputs after each token


def conv_layout(
    query_lens: list[int], kernel: int, device: torch.device | str, windows_from: int = 0, num_windowed: int = 0
) -> ConvLayout:
    """`num_windowed` requests from `windows_from` on get their `windows`."""
    keep = kernel - 1
    tokens_start = keep * len(query_lens)
    taps: list[list[int]] = [[] for _ in range(kernel)]
    final: list[list[int]] = []
    windows: list[list[list[int]]] = []
    widest = max(query_lens[windows_from : windows_from + num_windowed], default=0)
    start = 0
    for r, n in enumerate(query_lens):

        def row(offset: int) -> int:  # source row of this request's input at `offset` from its first new token
            return tokens_start + start + offset if offset >= 0 else r * keep + keep + offset

        for i in range(n):
            for k in range(kernel):
                taps[k].append(row(i - keep + k))
        final.append([row(n - keep + j) for j in range(keep)])
        if windows_from <= r < windows_from + num_windowed:
            ends = [[row(i + 1 - keep + j) for j in range(keep)] for i in range(n)]
            windows.append(ends + [ends[-1]] * (widest - n))
        start += n

    def as_long(values, shape):
        return torch.tensor(values, dtype=torch.long, device=device).reshape(shape)

    layout_windows = as_long(windows, (num_windowed, widest, keep)) if num_windowed else None
    return ConvLayout(as_long(taps, (kernel, sum(query_lens))), as_long(final, (len(query_lens), keep)), layout_windows)


def conv_windows(x: torch.Tensor, states: torch.Tensor, layout: ConvLayout) -> torch.Tensor:
    """The conv states after each token of the windowed requests: [V, max tokens, K-1, C],
    from the same x [T, C] and states [R, K-1, C] that `causal_conv` took."""
    source = torch.cat([states.flatten(0, 1), x])
    return source.index_select(0, layout.windows.flatten()).view(*layout.windows.shape, x.shape[-1])


def causal_conv(
    x: torch.Tensor,
    states: torch.Tensor,
    weight: torch.Tensor,
    layout: ConvLayout,
    activation: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv, then the activation, for packed requests.

    x: [T, C]; states: [R, K-1, C] (zeros for a fresh request); weight: [C, K] (fp32).
    Returns (out [T, C] in x's dtype, new states [R, K-1, C]).
    """
    source = torch.cat([states.flatten(0, 1), x])
    wide = source.to(weight.dtype)
    out = wide.index_select(0, layout.taps[0]) * weight[:, 0]
    for k in range(1, weight.shape[1]):
        out.addcmul_(wide.index_select(0, layout.taps[k]), weight[:, k])
    new_states = source.index_select(0, layout.final.flatten()).view(states.shape)
    return activation(out).to(x.dtype), new_states
