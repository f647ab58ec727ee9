"""KDA kernels against the plain token-by-token references, on fresh random inputs."""

import random

import pytest
import torch
import torch.nn.functional as F

from oxserve.kernels import kda, reference


def _inputs(length, heads=3, dk=8, dv=12, decay_scale=1.0, requests=1, gen=None):
    """Packed inputs of `requests` sequences with `length` tokens in all, one state each."""
    g = gen or torch.Generator().manual_seed(torch.seed())
    q = kda.l2norm(torch.randn(length, heads, dk, generator=g)) * dk**-0.5
    k = kda.l2norm(torch.randn(length, heads, dk, generator=g))
    v = torch.randn(length, heads, dv, generator=g)
    gate = -decay_scale * torch.rand(length, heads, dk, generator=g)
    beta = torch.rand(length, heads, generator=g)
    states = torch.randn(requests, heads, dk, dv, generator=g)
    return q, k, v, gate, beta, states


def _split(total: int, parts: int, rng: random.Random) -> list[int]:
    cuts = sorted(rng.sample(range(1, total), parts - 1)) if parts > 1 else []
    return [b - a for a, b in zip([0] + cuts, cuts + [total])]


def _reference_packed(q, k, v, g, beta, states, lengths):
    outs, finals, start = [], [], 0
    for r, n in enumerate(lengths):
        o, s = reference.delta_rule(*(x[start : start + n].double() for x in (q, k, v, g, beta)), states[r].double())
        outs.append(o)
        finals.append(s)
        start += n
    return torch.cat(outs).float(), torch.stack(finals).float()


@pytest.mark.parametrize("length", [1, 5, 16, 17, 64, 100])
@pytest.mark.parametrize("lower_bound", [-0.05, -5.0, -40.0, None])
def test_chunked_matches_recurrence(length, lower_bound):
    """Bound -40 forces small chunks; None (unbounded, decays up to 60/token) the exact form."""
    size, exact = kda.chunk_plan(lower_bound)
    q, k, v, g, beta, states = _inputs(length, decay_scale=abs(lower_bound or 60.0))
    ref_out, ref_state = _reference_packed(q, k, v, g, beta, states, [length])
    out, new_state = kda.kda_chunked(q, k, v, g, beta, states, kda.chunk_layout([length], size, exact, "cpu"))
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(new_state, ref_state, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("exact", [False, True])
def test_packed_requests_match_each_alone(exact):
    """Several requests of very different lengths in one call, each from its own state."""
    rng = random.Random()
    lengths = _split(150, 5, rng)
    q, k, v, g, beta, states = _inputs(150, requests=5)
    ref_out, ref_state = _reference_packed(q, k, v, g, beta, states, lengths)
    out, new_state = kda.kda_chunked(q, k, v, g, beta, states, kda.chunk_layout(lengths, 16, exact, "cpu"))
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(new_state, ref_state, rtol=1e-4, atol=1e-5)


def test_chunk_plan_keeps_the_factored_form_in_fp32_range():
    assert kda.chunk_plan(-5.0) == (16, False)  # 16 * 5 = 80 <= SAFE_CHUNK_DECAY
    assert kda.chunk_plan(-10.0) == (8, False)
    assert kda.chunk_plan(None) == (16, True)
    assert kda.chunk_plan(-100.0)[1]


def test_split_sequence_equals_whole():
    q, k, v, g, beta, states = _inputs(50)
    layout = kda.chunk_layout([50], 16, False, "cpu")
    whole, s_whole = kda.kda_chunked(q, k, v, g, beta, states, layout)
    first, s_mid = kda.kda_chunked(*(x[:23] for x in (q, k, v, g, beta)), states, kda.chunk_layout([23], 16, False, "cpu"))
    second, s_end = kda.kda_chunked(*(x[23:] for x in (q, k, v, g, beta)), s_mid, kda.chunk_layout([27], 16, False, "cpu"))
    torch.testing.assert_close(torch.cat([first, second]), whole, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s_end, s_whole, rtol=1e-4, atol=1e-5)


def test_recurrent_step_matches_reference():
    q, k, v, g, beta, states = _inputs(3)
    ref_out, ref_state = reference.delta_rule(q, k, v, g, beta, states[0])
    state = states
    for t in range(3):
        o, state = kda.kda_recurrent_step(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], state)
        torch.testing.assert_close(o[0], ref_out[t], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state[0], ref_state, rtol=1e-5, atol=1e-6)


def test_recurrent_step_batched_equals_single():
    q, k, v, g, beta, _ = _inputs(4)  # 4 requests, one token each
    states = torch.randn(4, 3, 8, 12)
    out, new = kda.kda_recurrent_step(q, k, v, g, beta, states)
    for b in range(4):
        o1, s1 = kda.kda_recurrent_step(q[b : b + 1], k[b : b + 1], v[b : b + 1], g[b : b + 1], beta[b : b + 1], states[b : b + 1])
        torch.testing.assert_close(out[b], o1[0])
        torch.testing.assert_close(new[b], s1[0])


@pytest.mark.parametrize("kernel", [1, 2, 4])
def test_packed_conv_matches_each_request_alone(kernel):
    """Decodes and prefill chunks of several requests in one conv, against the plain loop."""
    rng = random.Random()
    lengths = [1, 1] + _split(40, 3, rng)  # two decodes, then three chunks
    channels = 10
    x = torch.randn(sum(lengths), channels)
    states = torch.randn(len(lengths), kernel - 1, channels)
    weight = torch.randn(channels, kernel)
    out, new_states = kda.causal_conv(x, states, weight, kda.conv_layout(lengths, kernel, "cpu"), F.silu)
    start = 0
    for r, n in enumerate(lengths):
        ref, ref_state = reference.causal_conv(x[start : start + n].double(), states[r].double(), weight.double(), F.silu)
        torch.testing.assert_close(out[start : start + n], ref.float(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(new_states[r], ref_state.float())
        start += n


def test_conv_chunk_then_steps_equals_whole_chunk():
    x = torch.randn(12, 10)
    weight = torch.randn(10, 4)
    zero = torch.zeros(1, 3, 10)

    def conv(xs, state):
        return kda.causal_conv(xs, state, weight, kda.conv_layout([xs.shape[0]], 4, "cpu"), F.silu)

    whole, _ = conv(x, zero)
    head, state = conv(x[:7], zero)
    outs = [head]
    for t in range(7, 12):
        o, state = conv(x[t : t + 1], state)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs), whole)


@pytest.mark.parametrize("dims", [(8, 12), (64, 64), (7, 40), (32, 96)])
def test_native_prefill_run_matches_reference_in_place(dims):
    """`writeback_run` on a state table: requests of random lengths (tokens packed), some
    fresh (zeroed first), others from their cached state; other slots untouched. (7, 40):
    odd key width and value width not a multiple of 32 take the kernel's plain loops."""
    from oxserve.kernels import kda_decode

    dk, dv = dims
    rng = random.Random(torch.seed())
    requests = rng.randint(1, 5)
    lengths = _split(rng.randint(requests, 90), requests, rng) if requests > 1 else [rng.randint(1, 90)]
    q, k, v, g, beta, _ = _inputs(sum(lengths), heads=3, dk=dk, dv=dv, decay_scale=5.0)
    table = torch.randn(requests + 3, 3, dk, dv) * 0.3
    before = table.clone()
    slots = torch.randperm(requests + 3)[:requests]
    fresh = torch.tensor([rng.random() < 0.5 for _ in range(requests)])
    initial = torch.where(fresh.view(-1, 1, 1, 1), 0.0, table[slots])
    assert kda_decode.writeback_run_fits(table)
    out = kda_decode.writeback_run(table, slots, fresh, lengths, q, k, v, g, beta)
    ref_out, ref_states = _reference_packed(q, k, v, g, beta, initial, lengths)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(table[slots], ref_states, atol=2e-5, rtol=1e-4)
    others = [s for s in range(requests + 3) if s not in slots.tolist()]
    assert torch.equal(table[others], before[others])
