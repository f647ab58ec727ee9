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
    state = state * g.exp().unsqueeze(-1)
    kv_mem = torch.einsum("bhk,bhkv->bhv", k, state)
    delta = (v - kv_mem) * beta.unsqueeze(-1)
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    out = torch.einsum("bhk,bhkv->bhv", q, state)
    return out, state


def kda_reference(q, k, v, g, beta, state):
    """Token-by-token loop over one sequence. q,k,g: [L,H,Dk]; v: [L,H,Dv]; beta: [L,H]; state [H,Dk,Dv]."""
    outs = []
    for t in range(q.shape[0]):
        o, state = kda_recurrent_step(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], state[None])
        state = state[0]
        outs.append(o[0])
    return torch.stack(outs), state


def kda_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, chunk-parallel. Shapes as `kda_reference`; returns (o [L,H,Dv], final state).

    Within a chunk (positions i, j; G = cumulative log-decay from the chunk start):
        A[i,j]  = beta_i * sum_d k_i[d] k_j[d] exp(G_i[d] - G_j[d])      (j < i)
        T       = (I + A)^-1                                             (unit lower-triangular)
        U       = T (beta * v)          W = T (beta * k * exp(G))
        V_new   = U - W S_prev
        o_i     = (q_i * exp(G_i)) S_prev + sum_{j<=i} (q_i . k_j exp(G_i - G_j)) V_new_j
        S_next  = exp(G_last) * S_prev + sum_j (k_j exp(G_last - G_j)) V_new_j^T
    The per-channel decay stays inside exp(G_i - G_j) (never exp(-G_j) alone), so long chunks
    with strong decay do not overflow.
    """
    length, heads, dk = k.shape
    outs = []
    eye = torch.eye(chunk_size, dtype=q.dtype, device=q.device)
    strict = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril(-1)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril(0)
    for start in range(0, length, chunk_size):
        end = min(start + chunk_size, length)
        c = end - start
        qc, kc, vc = (x[start:end].transpose(0, 1) for x in (q, k, v))  # [H, c, D]
        gc = g[start:end].transpose(0, 1).cumsum(1)  # [H, c, Dk]
        bc = beta[start:end].transpose(0, 1).unsqueeze(-1)  # [H, c, 1]
        # diff[h,i,j,d] = G_i - G_j, masked to -inf above the diagonal before exp.
        diff = gc.unsqueeze(2) - gc.unsqueeze(1)
        decay = diff.masked_fill(~causal[:c, :c, None], float("-inf")).exp()
        kk = torch.einsum("hid,hjd,hijd->hij", kc, kc, decay)
        a = (bc * kk).masked_fill(~strict[:c, :c], 0.0)
        t_inv = torch.linalg.solve_triangular(eye[:c, :c] + a, eye[:c, :c].expand(heads, c, c), upper=False, unitriangular=True)
        u = t_inv @ (bc * vc)
        w = t_inv @ (bc * kc * gc.exp())
        v_new = u - w @ state
        qk = torch.einsum("hid,hjd,hijd->hij", qc, kc, decay)
        out = (qc * gc.exp()) @ state + qk @ v_new
        last = gc[:, -1:, :]  # [H,1,Dk]
        state = state * last.transpose(1, 2).exp() + (kc * (last - gc).exp()).transpose(1, 2) @ v_new
        outs.append(out.transpose(0, 1))
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
