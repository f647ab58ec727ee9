"""KDA kernels against the plain token-by-token recurrence, on fresh random inputs."""

import pytest
import torch

from oxserve.kernels import kda


def _inputs(length, heads=3, dk=8, dv=12, decay_scale=1.0, seed=None):
    g = torch.Generator().manual_seed(seed if seed is not None else torch.seed())
    q = kda.l2norm(torch.randn(length, heads, dk, generator=g)) * dk**-0.5
    k = kda.l2norm(torch.randn(length, heads, dk, generator=g))
    v = torch.randn(length, heads, dv, generator=g)
    gate = -decay_scale * torch.rand(length, heads, dk, generator=g)
    beta = torch.rand(length, heads, generator=g)
    state = torch.randn(heads, dk, dv, generator=g)
    return q, k, v, gate, beta, state


@pytest.mark.parametrize("length", [1, 5, 16, 17, 64, 100])
@pytest.mark.parametrize("decay_scale", [0.05, 5.0, 40.0])
def test_chunked_matches_recurrence(length, decay_scale):
    """decay 40/token forces the smaller chunks and then the exact fallback."""
    q, k, v, g, beta, state = _inputs(length, decay_scale=decay_scale)
    ref_out, ref_state = kda.kda_reference(q, k, v, g, beta, state)
    out, new_state = kda.kda_chunked(q, k, v, g, beta, state)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(new_state, ref_state, rtol=1e-4, atol=1e-5)


def test_exact_path_matches_recurrence():
    q, k, v, g, beta, state = _inputs(37, decay_scale=3.0)
    ref_out, ref_state = kda.kda_reference(q, k, v, g, beta, state)
    out, new_state = kda._chunked_exact(q, k, v, g, beta, state)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(new_state, ref_state, rtol=1e-4, atol=1e-5)


def test_split_sequence_equals_whole():
    q, k, v, g, beta, state = _inputs(50)
    whole, s_whole = kda.kda_chunked(q, k, v, g, beta, state)
    first, s_mid = kda.kda_chunked(q[:23], k[:23], v[:23], g[:23], beta[:23], state)
    second, s_end = kda.kda_chunked(q[23:], k[23:], v[23:], g[23:], beta[23:], s_mid)
    torch.testing.assert_close(torch.cat([first, second]), whole, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s_end, s_whole, rtol=1e-4, atol=1e-5)


def test_recurrent_step_matches_reference():
    q, k, v, g, beta, state = _inputs(3)
    ref_out, ref_state = kda.kda_reference(q, k, v, g, beta, state)
    for t in range(3):
        o, state = kda.kda_recurrent_step(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], state[None])
        state = state[0]
        torch.testing.assert_close(o[0], ref_out[t], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state, ref_state, rtol=1e-5, atol=1e-6)


def test_recurrent_step_batched_equals_single():
    q, k, v, g, beta, _ = _inputs(4)  # 4 requests, one token each
    states = torch.randn(4, 3, 8, 12)
    out, new = kda.kda_recurrent_step(q, k, v, g, beta, states)
    for b in range(4):
        o1, s1 = kda.kda_recurrent_step(q[b : b + 1], k[b : b + 1], v[b : b + 1], g[b : b + 1], beta[b : b + 1], states[b : b + 1])
        torch.testing.assert_close(out[b], o1[0])
        torch.testing.assert_close(new[b], s1[0])


def test_conv_chunk_then_steps_equals_whole_chunk():
    x = torch.randn(12, 10)
    weight = torch.randn(10, 4)
    zero = torch.zeros(3, 10)
    whole, _ = kda.causal_conv_chunk(x, zero, weight)
    head, state = kda.causal_conv_chunk(x[:7], zero, weight)
    outs = [head]
    for t in range(7, 12):
        o, state = kda.causal_conv_step(x[t : t + 1], state.unsqueeze(0), weight)
        state = state[0]
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs), whole)
    # The plain definition: out_t = silu(sum_k w[:, k] * x[t - 3 + k]).
    padded = torch.cat([zero, x])
    ref = torch.nn.functional.silu(torch.stack([(padded[t : t + 4].T * weight).sum(-1) for t in range(12)]))
    torch.testing.assert_close(whole, ref)
