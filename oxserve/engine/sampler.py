"""Token sampling for one engine step (vLLM v1 semantics).

Order: penalties, then
- greedy rows (params.greedy: temperature below MIN_SAMPLING_TEMPERATURE, 1e-5): argmax;
  top-k, top-p and min-p are ignored;
- the others: temperature -> min-p -> top-k -> top-p -> sample. Min-p drops the tokens
  whose temperature-scaled probability is below min_p times the most likely one's; top-p
  then counts mass over what min-p and top-k left, renormalised. On CPU these rows run in
  one native pass each (`oxserve.kernels.sampling`: 8.6x the torch form at 32 rows with
  top-p, `oxserve bench kernels --ops sampler.random`); its top-k keeps every token tied
  with the k-th, as vLLM's does (the torch form keeps k of them).
Logprobs are reported from the raw model distribution, before any processing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from oxserve.kernels.rows import argmax_fit, argmax_native
from oxserve.kernels.sampling import filter_native, float32s, penalise_native, sample_fit, sample_native
from oxserve.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """One request's sampling state for this step."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None  # seeded per request; None -> default RNG


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one sampled token per row
    # Per row: None when params.logprobs is None, else {token: raw logprob} holding the
    # sampled token plus the top-`params.logprobs` tokens.
    logprobs: list[dict[int, float] | None]


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed)


def sample(logits: torch.Tensor, rows: list[SamplingRow], greedy: torch.Tensor | None = None) -> SamplerOutput:
    """Sample one token per row of `logits` [R, V]; `logits` is left untouched. `greedy`: each
    row's argmax, where the caller has it already (a replayed decode step makes it)."""
    if all(is_plain_greedy(row.params) for row in rows):
        return SamplerOutput((greedy_tokens(logits) if greedy is None else greedy).tolist(), [None] * len(rows))

    # A private float32 copy: everything below may work in place.
    x = logits.to(torch.float32, copy=True)
    raw_logprobs = _raw_logprobs(x, rows)
    x = apply_penalties(x, rows)

    random_rows = [i for i, row in enumerate(rows) if not row.params.greedy]
    if len(random_rows) == len(rows):  # (x is private: the random rows may overwrite it)
        tokens = _draw(x, rows)
    else:
        tokens = greedy_tokens(x)
        if random_rows:
            index = torch.tensor(random_rows, device=x.device)
            tokens[index] = _draw(x[index], [rows[i] for i in random_rows])

    token_ids = tokens.tolist()
    return SamplerOutput(token_ids, _logprob_dicts(raw_logprobs, token_ids, rows))


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest logit, the first one on a tie (as `argmax`, NaN
    included). On CPU one native pass (`oxserve.kernels.rows.argmax_native`): torch's index
    reductions are not vectorised (`oxserve bench kernels --ops sampler.greedy`, AMD EPYC, 2
    threads, 32 rows of 8192: `max` 229 us, native 56 us); elsewhere `max`, which beats
    `argmax` on CPU (Sapphire Rapids, 32 rows of 32k: 1.31 -> 0.50 ms)."""
    if argmax_fit(logits):
        return argmax_native(logits)
    return logits.max(dim=-1).indices


def is_plain_greedy(params: SamplingParams) -> bool:
    return params.greedy and params.logprobs is None and not _has_penalties(params)


def _has_penalties(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0
        or params.frequency_penalty != 0.0
        or params.presence_penalty != 0.0
    )


# --- penalties --------------------------------------------------------------------------


def apply_penalties(x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Repetition (prompt + output tokens), then frequency and presence (output tokens).

    A logit that was finite stays finite, however large the penalty: a grammar mask may leave
    only tokens the prompt holds, and an overflow to -inf there would leave nothing to sample
    (-inf, the mask's, stays -inf). On CPU in place, natively on the tokens each row has seen
    (`oxserve.kernels.sampling`); the torch form (`penalties_torch`) makes [R, V] count tensors
    and runs ~15 ops over the whole block."""
    if not any(_has_penalties(row.params) for row in rows):
        return x
    if sample_fit(x):
        penalise_native(x, [row.params for row in rows], [row.prompt_token_ids for row in rows],
                        [row.output_token_ids for row in rows])
        return x
    return penalties_torch(x, rows)


def penalties_torch(x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """`apply_penalties` in torch ops."""
    finite, masked = x.isfinite(), x == float("-inf")
    _, vocab = x.shape
    output_counts = _token_counts([row.output_token_ids for row in rows], vocab, x.device)

    repetition = _column([row.params.repetition_penalty for row in rows], x.device)
    if (repetition != 1.0).any():
        prompt_counts = _token_counts([row.prompt_token_ids for row in rows], vocab, x.device)
        seen = (prompt_counts + output_counts) > 0
        penalised = torch.where(x > 0, x / repetition, x * repetition)
        x = torch.where(seen, penalised, x)

    frequency = _column([row.params.frequency_penalty for row in rows], x.device)
    presence = _column([row.params.presence_penalty for row in rows], x.device)
    x -= frequency * output_counts
    x -= presence * (output_counts > 0)
    limit = torch.finfo(x.dtype).max
    # A masked -inf stays -inf whatever the penalty made of it (times a penalty that float32
    # rounds to 0 it was NaN).
    return torch.where(finite, x.clamp(-limit, limit), x).masked_fill_(masked, float("-inf"))


def _token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[R, vocab] float32 occurrence counts, built with one scatter_add_."""
    width = max((len(tokens) for tokens in token_lists), default=0)
    # Pad with an extra column `vocab` that absorbs the padding and is sliced off.
    padded = [tokens + [vocab] * (width - len(tokens)) for tokens in token_lists]
    ids = torch.tensor(padded, dtype=torch.long, device=device).reshape(len(token_lists), width)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))
    return counts[:, :vocab]


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    """[R, 1] float32, as `float32s` takes the values."""
    return float32s(values, device).unsqueeze(1)


# --- random sampling --------------------------------------------------------------------


def _draw(x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    return sample_random(x, [row.params for row in rows], uniforms([row.generator for row in rows], x.device))


def sample_random(x: torch.Tensor, params: list[SamplingParams], u: torch.Tensor) -> torch.Tensor:
    """One token per row of logits x [R, V] fp32 (overwritten) under its temperature, min-p,
    top-k and top-p, drawn with u [R] in [0, 1): natively on CPU (`oxserve.kernels.sampling`),
    with the torch form for the rows the kernel leaves (NaN or infinite logits, or a max that
    overflows float32 when divided by the temperature) and elsewhere."""
    if not sample_fit(x):
        return inverse_cdf(filtered_probs(x, params), u)
    tokens = sample_native(x, params, u)
    if left := [i for i, token in enumerate(tokens.tolist()) if token < 0]:  # those rows are untouched
        index = torch.tensor(left, device=x.device)
        tokens[index] = inverse_cdf(filtered_probs(x[index], [params[i] for i in left]), u[index])
    return tokens


def filtered_weights(x: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, V] fp32 -> what temperature, min-p, top-k and top-p keep of each row as weights
    [R, V] and their totals [R] float64 on the host (a token's probability: weight / total):
    natively on CPU (`filter_native`, the weights `sample_random` draws from; x is overwritten),
    with the torch form (`filtered_probs`: probabilities, total 1) for the rows the kernel
    leaves and elsewhere."""
    if not sample_fit(x):
        return filtered_probs(x, params), torch.ones(len(params), dtype=torch.float64)
    totals = filter_native(x, params)
    if left := [i for i, total in enumerate(totals.tolist()) if total < 0]:  # those rows are untouched
        index = torch.tensor(left, device=x.device)
        x[index], totals[index] = filtered_probs(x[index], [params[i] for i in left]), 1.0
    return x, totals


def filtered_probs(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, min-p, top-k, top-p on non-greedy rows; returns their probabilities."""
    x = x / _column([p.temperature for p in params], x.device)
    min_p = _column([p.min_p for p in params], x.device)
    if (min_p > 0).any():
        x = _apply_min_p(x, min_p)
    # top_k at or above the vocabulary keeps every token (and any int fits the tensor).
    top_k = torch.tensor([min(p.top_k, x.shape[-1]) for p in params], device=x.device)
    top_p = _column([p.top_p for p in params], x.device)
    if (top_k > 0).any() or (top_p < 1.0).any():
        x = _apply_top_k_top_p(x, top_k, top_p)
    return x.softmax(dim=-1)


def _apply_min_p(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf every token less likely than min_p times the most likely one."""
    probs = x.softmax(dim=-1)
    threshold = min_p * probs.amax(dim=-1, keepdim=True)
    return x.masked_fill(probs < threshold, float("-inf"))


def _apply_top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf everything outside top-k, then outside top-p of what remains.

    Sorting ascending lets top-p drop the low tail whose mass stays <= 1 - p; summing
    from the small end keeps top_p == 1 exact (only zero-probability tokens qualify).
    """
    vocab = x.shape[-1]
    sorted_x, order = x.sort(dim=-1)
    rank = torch.arange(vocab, device=x.device)
    keep_from = torch.where(top_k > 0, vocab - top_k, 0).unsqueeze(1)  # top_k == 0: keep all
    drop = rank < keep_from
    sorted_x.masked_fill_(drop, float("-inf"))

    tail_mass = sorted_x.softmax(dim=-1).cumsum(dim=-1)
    drop = tail_mass <= 1.0 - top_p
    drop[:, -1] = False  # the most likely token always survives
    sorted_x.masked_fill_(drop, float("-inf"))
    return torch.empty_like(x).scatter_(-1, order, sorted_x)


def uniforms(generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """One number in [0, 1) per row (not one per vocabulary entry: sampling stays cheap).
    Seeded rows draw theirs from their own generator, so their tokens do not depend on which
    other rows share the batch or where the row sits in it."""
    u = torch.rand(len(generators), dtype=torch.float64, device=device)
    for row, generator in enumerate(generators):
        if generator is not None:
            u[row] = torch.rand(1, dtype=torch.float64, device=device, generator=generator)
    return u


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose cumulative mass exceeds u [R] times the row's total."""
    cdf = probs.double().cumsum(dim=-1)
    u = u.unsqueeze(1) * cdf[:, -1:]
    picked = torch.searchsorted(cdf, u, right=True).clamp_(max=probs.shape[-1] - 1)
    # u can round up to the total mass and land past the last live token: take the top one then.
    return torch.where(probs.gather(1, picked) > 0, picked, probs.argmax(-1, keepdim=True)).squeeze(1)


# --- logprobs ---------------------------------------------------------------------------


def _raw_logprobs(x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor | None:
    if all(row.params.logprobs is None for row in rows):
        return None
    return torch.log_softmax(x, dim=-1)


def _logprob_dicts(
    raw_logprobs: torch.Tensor | None, token_ids: list[int], rows: list[SamplingRow]
) -> list[dict[int, float] | None]:
    if raw_logprobs is None:
        return [None] * len(rows)
    return logprob_entries(raw_logprobs, token_ids, [row.params.logprobs for row in rows])


def logprob_entries(raw_logprobs: torch.Tensor, token_ids: list[int], top: list[int | None]) -> list[dict[int, float] | None]:
    """Per row of raw logprobs [R, V]: None where top[r] is None, else {token: logprob} with
    the chosen token first (as vLLM), then the top[r] most likely."""
    top_n = max((n or 0 for n in top), default=0)
    top_values, top_ids = raw_logprobs.topk(top_n, dim=-1)
    chosen = raw_logprobs.gather(1, torch.tensor(token_ids, device=raw_logprobs.device).unsqueeze(1)).squeeze(1).tolist()
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    result: list[dict[int, float] | None] = []
    for i, n in enumerate(top):
        if n is None:
            result.append(None)
            continue
        entry = {token_ids[i]: chosen[i]}
        entry.update(zip(top_ids[i][:n], top_values[i][:n]))
        result.append(entry)
    return result
