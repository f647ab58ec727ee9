"""Plain references for the kernels: a loop over tokens, written the way the maths reads.

Tests and `oxserve bench kernels` check the fast kernels against these, often in float64.
"""

from __future__ import annotations

from typing import Callable

import torch


def delta_rule_step(q, k, v, g, beta, state):
    """One token per head, any leading dims:
    S <- diag(e^g) S;   S <- S + k (beta (v - S^T k))^T;   o = S^T q."""
    state = state * g.exp().unsqueeze(-1)
    predicted = (k.unsqueeze(-2) @ state).squeeze(-2)  # S^T k
    state = state + k.unsqueeze(-1) * (beta.unsqueeze(-1) * (v - predicted)).unsqueeze(-2)
    return (q.unsqueeze(-2) @ state).squeeze(-2), state


def delta_rule(q, k, v, g, beta, state):
    """One sequence, token by token. q,k,g: [L,H,Dk]; v: [L,H,Dv]; beta: [L,H]; state [H,Dk,Dv]."""
    outs = []
    for t in range(q.shape[0]):
        o, state = delta_rule_step(q[t], k[t], v[t], g[t], beta[t], state)
        outs.append(o)
    return torch.stack(outs) if outs else q.new_zeros(0, *v.shape[1:]), state


def causal_conv(x, state, weight, activation: Callable[[torch.Tensor], torch.Tensor]):
    """One sequence: out_t = act(sum_j w[:, j] * x[t - K + 1 + j]), earlier inputs from `state`.

    x: [L, C]; state: [K-1, C] (the previous inputs, oldest first); weight: [C, K].
    Returns (out [L, C], the last K-1 inputs)."""
    width = weight.shape[1]
    padded = torch.cat([state, x])
    out = torch.stack([(padded[t : t + width].T * weight).sum(-1) for t in range(x.shape[0])])
    return activation(out), padded[padded.shape[0] - (width - 1) :]
