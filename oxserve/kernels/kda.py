"""Kimi Delta Attention (gated delta rule with a per-channel forget gate), in fp32.

Per head, with state S (Dk x Dv), q already l2-normalised and scaled, k l2-normalised:

    S_t = diag(exp(g_t)) S_{t-1}
    S_t = S_t + k_t (beta_t (v_t - k_t^T S_t))^T
    o_t = q_t^T S_t

`kda_recurrent_step` runs one token for a batch of requests (decode). `kda_chunked` runs a
whole prompt chunk with the WY/UT chunk form; `kda_reference` is the plain token loop
that both are tested against.
"""

from __future__ import annotations

import torch


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


def kda_reference(q, k, v, g, beta, state):
    """Token-by-token loop over one sequence. q,k,g: [L,H,Dk]; v: [L,H,Dv]; beta: [L,H]; state [H,Dk,Dv]."""
    outs = []
    for t in range(q.shape[0]):
        state = state * g[t].exp().unsqueeze(-1)
        delta = (v[t] - (k[t].unsqueeze(-1) * state).sum(-2)) * beta[t].unsqueeze(-1)
        state = state + k[t].unsqueeze(-1) * delta.unsqueeze(-2)
        outs.append((q[t].unsqueeze(-1) * state).sum(-2))
    return torch.stack(outs), state


# Within a chunk, exp(G_i - G_j) is computed as exp(G_i) * exp(-G_j): two small matmuls
# instead of a [C, C, Dk] tensor. That needs exp(-G) finite with room to spare, so the chunk
# shrinks when the decay inside it is too strong, and the exact form takes over below that.
MAX_CHUNK_DECAY = 60.0
CHUNK_SIZES = (16, 8, 4)


def kda_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, chunk-parallel. Shapes as `kda_reference`; returns (o [L,H,Dv], final state).

    Within a chunk (positions i, j; G = cumulative log-decay from the chunk start):
        A[i,j]  = beta_i * sum_d k_i[d] k_j[d] exp(G_i[d] - G_j[d])      (j < i)
        T       = (I + A)^-1                                             (unit lower-triangular)
        U       = T (beta * v)          W = T (beta * k * exp(G))
        V_new   = U - W S_prev
        o_i     = (q_i * exp(G_i)) S_prev + sum_{j<=i} (q_i . k_j exp(G_i - G_j)) V_new_j
        S_next  = exp(G_last) * S_prev + sum_j (k_j exp(G_last - G_j)) V_new_j^T
    Everything that does not depend on S is computed for all chunks at once; only the
    state hand-off runs chunk by chunk.
    """
    for size in CHUNK_SIZES:
        chunks = _to_chunks(size, q, k, v, g, beta)
        cum = chunks[3].cumsum(2)
        if -float(cum[:, :, -1].min()) <= MAX_CHUNK_DECAY if cum.numel() else True:
            out, state = _chunked_factored(*chunks[:3], cum, chunks[4], state)
            return _from_chunks(out, q.shape[0]), state
    return _chunked_exact(q, k, v, g, beta, state)


def _to_chunks(size: int, *xs: torch.Tensor) -> list[torch.Tensor]:
    """[L, H, ...] -> [H, N, size, ...], zero-padded at the end (zeros leave the state unchanged)."""
    length = xs[0].shape[0]
    pad = (-length) % size
    out = []
    for x in xs:
        x = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 1) + (0, pad))
        x = x.view(-1, size, *x.shape[1:])  # [N, C, H, ...]
        out.append(x.movedim(2, 0).contiguous())  # [H, N, C, ...]
    return out


def _from_chunks(out: torch.Tensor, length: int) -> torch.Tensor:
    heads, n, c, dv = out.shape
    return out.permute(1, 2, 0, 3).reshape(n * c, heads, dv)[:length]


def _chunked_factored(q, k, v, cum, beta, state):
    """q,k,v,cum: [H, N, C, D]; beta: [H, N, C]; state [H, Dk, Dv]."""
    c = q.shape[2]
    eye = torch.eye(c, dtype=q.dtype, device=q.device)
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril(0)
    decay, inv_decay = cum.exp(), (-cum).exp()
    k_in = k * inv_decay
    kb = k * beta.unsqueeze(-1)
    a = ((kb * decay) @ k_in.transpose(-1, -2)).tril(-1)
    t_inv = torch.linalg.solve_triangular(eye + a, eye.expand_as(a), upper=False, unitriangular=True)
    u = t_inv @ (v * beta.unsqueeze(-1))
    w = t_inv @ (kb * decay)
    q_dec = q * decay
    qk = (q_dec @ k_in.transpose(-1, -2)).masked_fill(~causal, 0.0)
    last = cum[:, :, -1:, :]  # [H, N, 1, Dk]
    k_to_end = (k * (last - cum).exp()).transpose(-1, -2)  # [H, N, Dk, C]
    last_decay = last.transpose(-1, -2).exp()  # [H, N, Dk, 1]
    out = torch.empty_like(u)
    for n in range(q.shape[1]):
        v_new = u[:, n] - w[:, n] @ state
        out[:, n] = q_dec[:, n] @ state + qk[:, n] @ v_new
        state = state * last_decay[:, n] + k_to_end[:, n] @ v_new
    return out, state


def _chunked_exact(q, k, v, g, beta, state, chunk_size: int = 16):
    """The same recurrence with exp(G_i - G_j) formed directly: slower, safe for any decay."""
    length, heads, _ = k.shape
    outs = []
    for start in range(0, length, chunk_size):
        end = min(start + chunk_size, length)
        c = end - start
        eye = torch.eye(c, dtype=q.dtype, device=q.device)
        causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril(0)
        qc, kc, vc = (x[start:end].transpose(0, 1) for x in (q, k, v))  # [H, c, D]
        gc = g[start:end].transpose(0, 1).cumsum(1)  # [H, c, Dk]
        bc = beta[start:end].transpose(0, 1).unsqueeze(-1)  # [H, c, 1]
        decay = (gc.unsqueeze(2) - gc.unsqueeze(1)).masked_fill(~causal[:, :, None], float("-inf")).exp()
        kk = (kc.unsqueeze(2) * kc.unsqueeze(1) * decay).sum(-1)
        a = (bc * kk).tril(-1)
        t_inv = torch.linalg.solve_triangular(eye + a, eye.expand(heads, c, c), upper=False, unitriangular=True)
        u = t_inv @ (bc * vc)
        w = t_inv @ (bc * kc * gc.exp())
        v_new = u - w @ state
        qk = (qc.unsqueeze(2) * kc.unsqueeze(1) * decay).sum(-1)
        outs.append(((qc * gc.exp()) @ state + qk @ v_new).transpose(0, 1))
        last = gc[:, -1:, :]
        state = state * last.transpose(1, 2).exp() + (kc * (last - gc).exp()).transpose(1, 2) @ v_new
    return torch.cat(outs, 0), state


def causal_conv_step(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv for one token per request, then SiLU.

    x: [B, C]; conv_state: [B, K-1, C] (the previous K-1 inputs, oldest first); weight: [C, K].
    Returns (out [B, C], new conv_state).
    """
    window = torch.cat([conv_state, x.unsqueeze(1)], dim=1)  # [B, K, C]
    out = torch.einsum("bkc,ck->bc", window.to(weight.dtype), weight)
    return torch.nn.functional.silu(out).to(x.dtype), window[:, 1:]


def causal_conv_chunk(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv over one sequence chunk, then SiLU.

    x: [L, C]; conv_state: [K-1, C] (zeros for a fresh request); weight: [C, K].
    """
    kernel = weight.shape[1]
    padded = torch.cat([conv_state, x], dim=0)  # [L+K-1, C]
    out = torch.nn.functional.conv1d(padded.T.unsqueeze(0).to(weight.dtype), weight.unsqueeze(1), groups=weight.shape[0])
    out = torch.nn.functional.silu(out[0].T).to(x.dtype)
    return out, padded[-(kernel - 1) :]
