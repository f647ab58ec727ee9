"""The native KDA conv inputs (conv + gates) and gated norm against their torch forms."""

import pytest
import torch

from oxserve.kernels import kda_io
from oxserve.kernels.kda import conv_layout, conv_windows
from oxserve.model.batch import token_runs
from oxserve.model.activations import activation

SILU = activation("silu")


def _decode_case(gen, batch, heads, dim, width, dtype, state_dtype, lower_bound, tokens=None):
    channels, slots_total, tokens = 3 * heads * dim, batch + 5, tokens or batch
    return {
        "mixed": torch.randn(tokens, channels, generator=gen).to(dtype),
        # the table holds conv inputs, values of the model dtype, whatever it stores them in
        "table": torch.randn(slots_total, width - 1, channels, generator=gen).to(dtype).to(state_dtype),
        "slots": torch.randperm(slots_total, generator=gen)[:batch],
        "weight": torch.randn(channels, width, generator=gen) * width**-0.5,
        "f": (torch.randn(tokens, heads * dim, generator=gen) * 3).to(dtype),
        "dt_bias": torch.randn(heads * dim, generator=gen),
        "a_log": torch.randn(heads, generator=gen) * 0.5,
        "lower_bound": lower_bound,
        "beta_logits": (torch.randn(tokens, heads, generator=gen) * 2).to(dtype),
        "dim": dim,
    }


@pytest.mark.parametrize("dtype,state_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                               (torch.float32, torch.float32), (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("batch,heads,dim,width", [(1, 1, 8, 4), (7, 3, 16, 4), (33, 2, 64, 2), (4, 2, 32, 1)])
@pytest.mark.parametrize("prompts", [False, True])
def test_conv_inputs_match_the_general_path(dtype, state_dtype, lower_bound, batch, heads, dim, width, prompts):
    """Decodes (one token each, all with context), or prompt chunks of random lengths, some
    requests without context (their stale table rows must read as zeros)."""
    gen = torch.Generator().manual_seed(batch * 100 + dim + width + prompts)
    lens = torch.randint(1, 40, (batch,), generator=gen).tolist() if prompts else [1] * batch
    case = _decode_case(gen, batch, heads, dim, width, dtype, state_dtype, lower_bound, tokens=sum(lens))
    has_context = torch.rand(batch, generator=gen) < 0.5 if prompts else torch.ones(batch, dtype=torch.bool)
    assert kda_io.conv_inputs_fit(case["mixed"], case["f"], case["beta_logits"], case["table"], "silu", dim)
    table_native, table_torch = case["table"].clone(), case["table"].clone()
    args = (case["f"], case["dt_bias"], case["a_log"], lower_bound, case["beta_logits"], dim)
    got = kda_io.conv_inputs(case["mixed"], table_native, case["slots"], has_context, token_runs(lens),
                             kda_io.conv_taps(case["weight"]), *args)
    want = kda_io.conv_inputs_torch(case["mixed"], table_torch, case["slots"], has_context, lens, case["weight"], SILU,
                                    *args)
    # v is the conv output rounded to the model dtype: one bf16 step where fp32 sums land
    # on either side of a rounding boundary.
    tol = 8e-3 if dtype == torch.bfloat16 else 2e-5
    for name, g, w in zip("qkvg", got[:4], want[:4]):
        assert g.shape == w.shape == (sum(lens), heads, dim) and g.dtype == torch.float32, name
        torch.testing.assert_close(g, w, rtol=tol, atol=tol, msg=name)
    torch.testing.assert_close(got[4], want[4], rtol=tol, atol=tol)
    assert torch.equal(table_native, table_torch)  # the shifted windows are copies: exact
    untouched = torch.ones(table_native.shape[0], dtype=torch.bool)
    untouched[case["slots"]] = False
    assert torch.equal(table_native[untouched], case["table"][untouched])


@pytest.mark.parametrize("dtype,state_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                               (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("width", [4, 2, 1])
def test_conv_windows_and_accept_match_the_torch_staging(dtype, state_dtype, width):
    """Decodes, then requests verifying runs of random lengths (one without context), then a
    prompt chunk: the native windows equal the torch staging's (`kda.conv_windows`) in the
    table's dtype, and keeping random tokens writes the same states as the torch accept."""
    gen = torch.Generator().manual_seed(width * 10 + (dtype == state_dtype))
    num_decodes, verify_lens = 2, torch.randint(1, 6, (4,), generator=gen).tolist()
    lens = [1] * num_decodes + verify_lens + [7]
    case = _decode_case(gen, len(lens), 2, 16, width, dtype, state_dtype, None, tokens=sum(lens))
    has_context = torch.ones(len(lens), dtype=torch.bool)
    has_context[num_decodes + 1] = False
    nv = len(verify_lens)
    layout = conv_layout(lens, width, "cpu", windows_from=num_decodes, num_windowed=nv)
    states = torch.where(has_context.view(-1, 1, 1), case["table"][case["slots"]].to(dtype), 0.0)
    want = conv_windows(case["mixed"], states, layout)
    got = kda_io.conv_windows(case["mixed"], case["table"], case["slots"], has_context, token_runs(lens), num_decodes,
                              nv, max(verify_lens))
    assert got.dtype == state_dtype and got.shape == want.shape == (nv, max(verify_lens), width - 1, case["mixed"].shape[1])
    assert torch.equal(got, want.to(state_dtype))  # copies of inputs: exact
    kept = [int(torch.randint(0, n, (1,), generator=gen)) for n in verify_lens]
    slots = case["slots"][num_decodes : num_decodes + nv]
    native, reference = case["table"].clone(), case["table"].clone()
    assert kda_io.accept_windows(native, slots, got, kept)
    for b, n in enumerate(kept):
        reference[slots[b]] = want[b, n].to(state_dtype)
    assert torch.equal(native, reference)
    assert not kda_io.accept_windows(native, slots, want.to(torch.float16), kept)  # not the table's dtype: declined


def test_conv_inputs_decline_what_the_kernel_does_not_compute():
    mixed, f, beta = torch.zeros(2, 48), torch.zeros(2, 16), torch.zeros(2, 2)
    table = torch.zeros(4, 3, 48)
    assert kda_io.conv_inputs_fit(mixed, f, beta, table, "silu", 8)
    assert not kda_io.conv_inputs_fit(mixed, f, beta, table, "gelu", 8)  # another conv activation
    assert not kda_io.conv_inputs_fit(mixed.half(), f.half(), beta.half(), table, "silu", 8)
    assert not kda_io.conv_inputs_fit(mixed, f.bfloat16(), beta, table, "silu", 8)  # mixed dtypes
    assert not kda_io.conv_inputs_fit(mixed, f, beta, table[:, ::2], "silu", 8)  # strided table
    assert not kda_io.conv_inputs_fit(mixed, f, beta, table, "silu", kda_io.NATIVE_MAX_DIM + 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens,heads,dim", [(1, 1, 8), (9, 4, 32), (300, 2, 128)])
def test_gated_norm_matches_torch(dtype, tokens, heads, dim):
    gen = torch.Generator().manual_seed(tokens + dim)
    core = torch.randn(tokens, heads, dim, generator=gen) * 3
    gate = (torch.randn(tokens, heads * dim, generator=gen) * 2).to(dtype)
    weight = (torch.rand(dim, generator=gen) + 0.5).to(dtype)
    got = kda_io.gated_norm(core, gate, weight, 1e-6)
    want = kda_io.gated_norm_torch(core, gate, weight, 1e-6)
    assert got.dtype == dtype and got.shape == (tokens, heads * dim)
    tol = 8e-3 if dtype == torch.bfloat16 else 2e-6
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    # float64 definition
    exact = core.double() / (core.double().pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    exact = (weight.double() * exact * torch.sigmoid(gate.double().view(tokens, heads, dim))).flatten(1)
    torch.testing.assert_close(got.double(), exact, rtol=tol * 2, atol=tol * 2)
