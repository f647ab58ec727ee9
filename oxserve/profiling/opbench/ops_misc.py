"""mHC hyper-connection collapse/expand, RMSNorm, the LM head, the structured-output token mask and
greedy sampling."""

from __future__ import annotations

import functools

import torch

from oxserve.engine.sampler import filtered_probs, filtered_weights, greedy_tokens, inverse_cdf, sample_random
from oxserve.kernels.hyper import hc_collapse, hc_collapse_torch, hc_expand, hc_expand_torch, hc_gates_torch
from oxserve.kernels.norm import rms_norm_torch
from oxserve.kernels.onednn import choose_linear_kernel
from oxserve.kernels.token_mask import apply_token_bitmask, apply_token_bitmask_torch
from oxserve.model.common import RMSNorm
from oxserve.model.glm5_next import Glm5NextForCausalLM
from oxserve.model.hyper import HyperConnection
from oxserve.profiling.opbench.checks import bind_params, close_for, precision_of, randn, token_counts
from oxserve.profiling.opbench.registry import Case, Op, register_op, returning
from oxserve.sampling_params import SamplingParams

FP32 = torch.float32


def _nbytes(i) -> int:
    return sum(v.numel() * v.element_size() for v in i.values())


# ---- hyper-connections -------------------------------------------------------------------


def _collapse_inputs(cfg, tokens, dtype, device, gen):
    n, h = cfg.hc_mult, cfg.hidden_size
    return {
        "streams": randn(gen, tokens, n, h, dtype=dtype, device=device),
        "fn": randn(gen, (2 + n) * n, n * h, dtype=dtype, device=device, scale=(n * h) ** -0.5),
        "base": randn(gen, (2 + n) * n, dtype=FP32, device=device),
        "scale": torch.rand(3, generator=gen, device=device) + 0.5,
    }


def reference_collapse(cfg, i):
    """Per token: normalise the flattened streams, project to (pre, post, comb), make comb
    doubly stochastic by alternating column and row normalisation, mix the streams by pre."""
    n, eps = cfg.hc_mult, cfg.hc_eps
    streams = i["streams"].double()
    flat = streams.flatten(1)
    flat = flat / torch.sqrt((flat * flat).mean(-1, keepdim=True) + cfg.rms_norm_eps)
    mixed = flat @ i["fn"].double().T
    base, scale = i["base"].double(), i["scale"].double()
    pre = torch.sigmoid(mixed[:, :n] * scale[0] + base[:n]) + eps
    post = 2 * torch.sigmoid(mixed[:, n : 2 * n] * scale[1] + base[n : 2 * n])
    comb = torch.softmax(mixed[:, 2 * n :].view(-1, n, n) * scale[2] + base[2 * n :].view(n, n), dim=-1) + eps
    comb = comb / (comb.sum(1, keepdim=True) + eps)  # columns
    for _ in range(cfg.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(2, keepdim=True) + eps)  # rows
        comb = comb / (comb.sum(1, keepdim=True) + eps)  # columns
    collapsed = sum(pre[:, j : j + 1] * streams[:, j] for j in range(n))
    return post, comb, collapsed


def collapse_candidate(cfg, i, kernel=hc_collapse):
    with torch.device("meta"):
        hc = HyperConnection(cfg.hidden_size, cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
    bind_params(hc, fn=i["fn"], base=i["base"], scale=i["scale"])
    hc.collapse_kernel = kernel

    def run(out):
        for buffer, value in zip(out, hc.collapse(i["streams"]), strict=True):
            buffer.copy_(value)
    return run


def _collapse_cases(cfg, shapes, dtype, device):
    n, h = cfg.hc_mult, cfg.hidden_size

    def cost(i):
        t = i["streams"].shape[0]
        return _nbytes(i) + t * (n + n * n) * 4 + t * h * i["streams"].element_size(), 2.0 * t * n * h * ((2 + n) * n + 1)

    return [
        Case(f"T={t}", lambda gen, t=t: _collapse_inputs(cfg, t, dtype, device, gen),
             lambda i, t=t: (torch.empty(t, n, device=device), torch.empty(t, n, n, device=device),
                             torch.empty(t, h, dtype=dtype, device=device)),
             cost, "fp32")
        for t in token_counts(shapes)
    ]


def _expand_inputs(cfg, tokens, dtype, device, gen):
    n, h = cfg.hc_mult, cfg.hidden_size
    comb = torch.rand(tokens, n, n, generator=gen, device=device)
    return {
        "post": 2 * torch.rand(tokens, n, generator=gen, device=device),
        "comb": comb / comb.sum(1, keepdim=True),
        "block_out": randn(gen, tokens, h, dtype=dtype, device=device),
        "streams": randn(gen, tokens, n, h, dtype=dtype, device=device),
    }


def reference_expand(cfg, i):
    """new stream s = post_s * block output + sum_j comb[j, s] * stream j."""
    post, comb = i["post"].double(), i["comb"].double()
    out, streams = i["block_out"].double(), i["streams"].double()
    n = post.shape[1]
    new = [post[:, s : s + 1] * out + sum(comb[:, j, s : s + 1] * streams[:, j] for j in range(n)) for s in range(n)]
    return (torch.stack(new, dim=1),)


def _expand_cases(cfg, shapes, dtype, device):
    n = cfg.hc_mult

    def cost(i):
        t, h = i["block_out"].shape
        return _nbytes(i) + i["streams"].numel() * i["streams"].element_size(), float(t * n * h * (2 * n + 2))

    return [
        Case(f"T={t}", lambda gen, t=t: _expand_inputs(cfg, t, dtype, device, gen),
             lambda i: (torch.empty_like(i["streams"]),), cost, precision_of(dtype))
        for t in token_counts(shapes)
    ]


# engine: one native call on CPU at any batch size; native-gates: torch around the native gates;
# torch: all torch
register_op(Op("hc.collapse", _collapse_cases, reference_collapse, close_for("streams"),
               {"engine": collapse_candidate,
                "native-gates": lambda cfg, i: collapse_candidate(cfg, i, hc_collapse_torch),
                "torch": lambda cfg, i: collapse_candidate(cfg, i, functools.partial(hc_collapse_torch, gates=hc_gates_torch))}))
register_op(Op("hc.expand", _expand_cases, reference_expand, close_for("streams"),
               {"engine": returning(hc_expand), "torch": returning(hc_expand_torch)}))


# ---- RMSNorm ----------------------------------------------------------------------------


def reference_rmsnorm(cfg, i):
    x = i["x"].double()
    return (i["weight"].double() * x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.rms_norm_eps),)


def rmsnorm_candidate(cfg, i):
    """The engine's RMSNorm module: one native pass for bf16 on CPU."""
    with torch.device("meta"):
        norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    bind_params(norm, weight=i["weight"])

    def run(out):
        out[0].copy_(norm(i["x"]))
    return run


def rmsnorm_torch_candidate(cfg, i):
    def run(out):
        out[0].copy_(rms_norm_torch(i["x"], i["weight"], cfg.rms_norm_eps))
    return run


def _rmsnorm_cases(cfg, shapes, dtype, device):
    h = cfg.hidden_size

    def make(gen, t):
        return {"x": randn(gen, t, h, dtype=dtype, device=device, scale=3.0),
                "weight": randn(gen, h, dtype=dtype, device=device, scale=0.5) + 1}

    return [
        Case(f"T={t}", lambda gen, t=t: make(gen, t), lambda i: (torch.empty_like(i["x"]),),
             lambda i: (2 * _nbytes(i), 4.0 * i["x"].numel()), precision_of(dtype))
        for t in token_counts(shapes)
    ]


register_op(Op("rmsnorm", _rmsnorm_cases, reference_rmsnorm, close_for("x"),
               {"engine": rmsnorm_candidate, "torch": rmsnorm_torch_candidate}))


# ---- LM head ----------------------------------------------------------------------------


def reference_lm_head(cfg, i):
    return (i["x"].double() @ i["weight"].double().T,)


def lm_head_candidate(cfg, i, linear_kernel="torch"):
    """The LM head as the engine builds it with `--linear-kernel` (auto: oneDNN's packed
    weight where it runs this dtype; torch: `F.linear`)."""
    with torch.device("meta"):
        model = Glm5NextForCausalLM(cfg)
    _, transform = choose_linear_kernel(linear_kernel, i["weight"].device, i["weight"].dtype)
    if transform is not None:
        transform(model)
    bind_params(model.lm_head, weight=i["weight"])
    if hasattr(model.lm_head, "after_load"):
        model.lm_head.shared_weight = True  # the weight is the harness's input: pack it, keep it
        model.lm_head.after_load()

    def run(out):
        out[0].copy_(model.compute_logits(i["x"]))
    return run


def _lm_head_cases(cfg, shapes, dtype, device):
    h, v = cfg.hidden_size, cfg.vocab_size

    def make(gen, b):
        return {"x": randn(gen, b, h, dtype=dtype, device=device),
                "weight": randn(gen, v, h, dtype=dtype, device=device, scale=h**-0.5)}

    return [
        Case(f"B={b}", lambda gen, b=b: make(gen, b), lambda i, b=b: (torch.empty(b, v, device=device),),
             lambda i: (_nbytes(i) + i["x"].shape[0] * v * 4, 2.0 * i["x"].shape[0] * h * v), precision_of(dtype))
        for b in shapes.batches  # logits are computed for the last token of each request only
    ]


register_op(Op("lm_head", _lm_head_cases, reference_lm_head, close_for("x"),
              {"engine": functools.partial(lm_head_candidate, linear_kernel="auto"), "torch": lm_head_candidate},
              weights=("weight",)))


# ---- structured outputs' token mask -----------------------------------------------------


def _mask_inputs(batch, vocab, device, gen):
    """Half the rows constrained; their masks mix all-disallowed words (most of a JSON
    grammar's vocabulary), all-allowed words and single bits."""
    rows = torch.arange(0, batch, 2, device=device)
    words = (vocab + 31) // 32
    bits = torch.randint(-(2**31), 2**31 - 1, (len(rows), words), generator=gen, dtype=torch.int64).to(torch.int32)
    kind = torch.randint(0, 4, (len(rows), words), generator=gen)
    bits = torch.where(kind == 0, 0, torch.where(kind == 1, -1, bits))
    return {"logits": randn(gen, batch, vocab, dtype=FP32, device=device), "rows": rows, "bitmask": bits.to(device)}


def reference_token_mask(cfg, i):
    """Token t of constrained row r is allowed when bit t % 32 of word t // 32 is set."""
    out = i["logits"].clone()
    vocab = out.shape[1]
    for k, row in enumerate(i["rows"].tolist()):
        words = [w & 0xFFFFFFFF for w in i["bitmask"][k].tolist()]
        allowed = torch.tensor([bool(words[t // 32] >> (t % 32) & 1) for t in range(vocab)], device=out.device)
        out[row][~allowed] = float("-inf")
    return (out,)


def token_mask_candidate(apply):
    def bind(cfg, i):
        def run(out):
            out[0].copy_(i["logits"])
            apply(out[0], i["rows"].tolist(), i["bitmask"])
        return run
    return bind


def exact(cfg, out, ref, inputs) -> str | None:
    bad = int((out[0] != ref[0]).sum())  # -inf == -inf; NaN (unwritten) never equals
    return f"{bad} of {out[0].numel()} logits differ" if bad else None


def _mask_cases(cfg, shapes, dtype, device):
    v = cfg.vocab_size
    return [
        Case(f"B={b}", lambda gen, b=b: _mask_inputs(b, v, device, gen), lambda i: (torch.empty_like(i["logits"]),),
             lambda i: (2 * i["logits"].numel() * 4 + i["bitmask"].numel() * 4, 0.0), "fp32")
        for b in shapes.batches if b >= 2  # a row constrained, a row free
    ]


register_op(Op("sampler.token_mask", _mask_cases, reference_token_mask, exact,
               {"engine": token_mask_candidate(apply_token_bitmask),  # native on CPU float32
                "torch": token_mask_candidate(apply_token_bitmask_torch)}))


# ---- greedy sampling ----------------------------------------------------------------------


def reference_greedy(cfg, i):
    """Each row's first index of its largest logit."""
    rows = i["logits"].tolist()
    return (torch.tensor([row.index(max(row)) for row in rows], device=i["logits"].device),)


def _greedy_cases(cfg, shapes, dtype, device):
    v = cfg.vocab_size
    return [
        Case(f"B={b}", lambda gen, b=b: {"logits": randn(gen, b, v, dtype=FP32, device=device)},
             lambda i: (torch.empty(i["logits"].shape[0], dtype=torch.long, device=device),),
             lambda i: (i["logits"].numel() * 4, 0.0), "fp32")
        for b in shapes.batches  # the sampler's fp32 logits, one row per request
    ]


register_op(Op("sampler.greedy", _greedy_cases, reference_greedy, exact,
               {"engine": returning(greedy_tokens), "max": returning(lambda logits: logits.max(dim=-1).indices),
                "argmax": returning(lambda logits: logits.argmax(dim=-1))}))


# ---- random sampling ----------------------------------------------------------------------

# Chat traffic's sampling (workloads/short_chat.yaml): the nucleus is the costly part.
CHAT_SAMPLING = SamplingParams(temperature=0.7, top_p=0.95)


def reference_random(cfg, i):
    """Per row, the first token whose cumulative probability (after temperature and top-p)
    exceeds its uniform number: the sampler's torch form."""
    logits = i["logits"]
    return (inverse_cdf(filtered_probs(logits.clone(), [CHAT_SAMPLING] * len(logits)), i["u"]),)


def _random_cases(cfg, shapes, dtype, device):
    v = cfg.vocab_size
    return [
        Case(f"B={b}", lambda gen, b=b: {"logits": randn(gen, b, v, dtype=FP32, device=device),
                                          "u": torch.rand(b, generator=gen, dtype=torch.float64, device=device)},
             lambda i: (torch.empty(i["logits"].shape[0], dtype=torch.long, device=device),),
             lambda i: (i["logits"].numel() * 4, 0.0), "fp32")
        for b in shapes.batches  # one row per request, fp32 as the sampler takes them
    ]


def same_tokens(cfg, out, ref, inputs) -> str | None:
    """The torch form's tokens; one row may differ where its draw falls within rounding of a
    cut (e^x's last bits), a systematic error differs in many (tests/test_sampler.py holds the
    native sampler to at most 2 in 2,000)."""
    bad = int((out[0] != ref[0]).sum())
    return f"{bad} of {out[0].numel()} tokens differ" if bad > 1 else None


register_op(Op("sampler.random", _random_cases, reference_random, same_tokens,
               {"engine": returning(lambda logits, u: sample_random(logits.clone(), [CHAT_SAMPLING] * len(logits), u)),
                "torch": returning(lambda logits, u: reference_random(None, {"logits": logits, "u": u})[0])}))


# ---- the filters alone (speculative verification reads a draft's probability) ---------------


def reference_filter(cfg, i):
    """Each row's probabilities after temperature and top-p: the torch form."""
    return (filtered_probs(i["logits"].clone(), [CHAT_SAMPLING] * len(i["logits"])),)


def engine_filter(logits):
    weights, totals = filtered_weights(logits.clone(), [CHAT_SAMPLING] * len(logits))
    return weights / totals.unsqueeze(1).float()


def same_probabilities(cfg, out, ref, inputs) -> str | None:
    """The torch form's probabilities, to float32 rounding; one row may keep a token more or
    less where a weight lies within rounding of the top-p cut (a weight below 1e-30 counts as
    dropped: the kernel floors e^x at e^-87 where torch gives 0)."""
    same_cut = ((out[0] > 1e-30) == (ref[0] > 1e-30)).all(dim=1)
    if int((~same_cut).sum()) > 1:
        return f"{int((~same_cut).sum())} of {len(same_cut)} rows keep other tokens"
    err = float((out[0][same_cut] - ref[0][same_cut]).abs().max()) if same_cut.any() else 0.0
    return f"max error {err:.3g}" if err > 1e-5 else None


def _filter_cases(cfg, shapes, dtype, device):
    v = cfg.vocab_size
    return [
        Case(f"B={b}", lambda gen, b=b: {"logits": randn(gen, b, v, dtype=FP32, device=device)},
             lambda i: (torch.empty_like(i["logits"]),), lambda i: (i["logits"].numel() * 8, 0.0), "fp32")
        for b in shapes.batches  # verify rows: a request's tokens and drafts, fp32
    ]


register_op(Op("sampler.filter", _filter_cases, reference_filter, same_probabilities,
               {"engine": returning(engine_filter), "torch": returning(lambda logits: reference_filter(None, {"logits": logits})[0])}))
