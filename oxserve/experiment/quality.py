"""The quality gate: does B compute the same model as A?

A generates greedily on a fixed prompt set. Both arms then score A's tokens teacher-forced:
for each prompt p and position i, a request `p + A's tokens[:i]` with max_tokens=1 and
logprobs returns the logprob of A's token i. Scoring A's tokens in A as well means both
sides come from the same code path (prefill), so an A/A gate sees exactly the noise of the
engine, not the difference between its prefill and decode kernels.

    divergence(p, i) = |logprob_A(token_i) - logprob_B(token_i)|      (nats)

The gate passes when the largest divergence is within the bound. Also reported: how often
B's own greedy choice at a position equals A's (both scored the same way). A token outside B's
top-`TOP_LOGPROBS` has no reported logprob; its divergence is then at least
logprob_A - (B's lowest reported logprob), which is what is counted.
"""

from __future__ import annotations

import numpy as np

from oxserve.sampling_params import SamplingParams

TOP_LOGPROBS = 20


def quality_prompts(vocab_size: int, count: int, seed: int = 1234, min_token_id: int = 16) -> list[list[int]]:
    """A fixed, seeded set of token-id prompts of 8-24 tokens (model-agnostic: no tokenizer)."""
    rng = np.random.default_rng(seed)
    low = min(min_token_id, vocab_size - 1)
    return [rng.integers(low, vocab_size, size=int(rng.integers(8, 25))).tolist() for _ in range(count)]


def generate_greedy(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(f"q-gen-{k}", p, params) for k, p in enumerate(prompts)]
    finished = _run_to_completion(engine)
    return [finished[rid].outputs[0].token_ids for rid in ids]


def score_tokens(engine, prompts: list[list[int]], tokens: list[list[int]]) -> list[list[dict]]:
    """Per prompt and position: {"logprob": of the given token or None, "floor": the lowest
    reported logprob, "argmax": the engine's own greedy choice}."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=TOP_LOGPROBS)
    ids = {}
    for k, (prompt, toks) in enumerate(zip(prompts, tokens, strict=True)):
        for i in range(len(toks)):
            ids[(k, i)] = engine.add_request(f"q-score-{k}-{i}", prompt + toks[:i], params)
    finished = _run_to_completion(engine)
    scores = [[None] * len(toks) for toks in tokens]
    for (k, i), rid in ids.items():
        out = finished[rid].outputs[0]
        reported = {int(t): float(lp) for t, lp in out.logprobs[0].items()}
        scores[k][i] = {"logprob": reported.get(tokens[k][i]), "floor": min(reported.values()), "argmax": out.token_ids[0]}
    return scores


def output_loglikelihoods(engine, runs: list[dict]) -> list[list[float]]:
    """For each {"prompt", "output"} of a workload run: the logprob, under `engine`, of every
    output token, teacher-forced in one prefill of the prompt and all but the last output
    token (prompt logprobs; the last from the next-token top-`TOP_LOGPROBS`, or at most the
    lowest reported when outside it), so the request is never longer than the one that
    produced the output."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=0, logprobs=TOP_LOGPROBS)
    ids = {k: engine.add_request(f"q-verify-{k}", list(run["prompt"]) + list(run["output"][:-1]), params)
           for k, run in enumerate(runs) if run["output"]}
    finished = _run_to_completion(engine)
    scores: list[list[float]] = [[] for _ in runs]
    for k, rid in ids.items():
        out, run = finished[rid], runs[k]
        start = len(run["prompt"])
        for position, token in enumerate(run["output"][:-1], start):
            scores[k].append(float(out.prompt_logprobs[position][int(token)]))
        last = {int(t): float(lp) for t, lp in out.outputs[0].logprobs[0].items()}
        scores[k].append(last.get(int(run["output"][-1]), min(last.values())))
    return scores


GREEDY_MARGIN = 1.0  # nats: how far below A's own choice B's first different greedy token may be


def compare_outputs(reference: list[list[float]], candidate: list[list[float]], bound: float,
                    greedy: list[bool] | None = None, reference_tokens: list[list[int]] | None = None,
                    candidate_tokens: list[list[int]] | None = None) -> dict:
    """Are B's outputs as likely, under A, as A's own on the same prompts? Both are scored by
    A's engine (`output_loglikelihoods`), request by request.

    - mean logprob per token: B's may fall short of A's by `bound` nats plus three standard
      errors (over requests: sampled outputs vary). Outputs cached from other prompts, made
      up, cut short by an early stop, or computed by a cut-down model fall far below; a
      legitimate change (batching, a kernel, a careful precision cut) does not.
    - greedy requests: where B's output first differs from A's, A's logprob of B's token
      must be within GREEDY_MARGIN of A's own choice there -- a legitimate change flips only
      near-ties (degenerate but likely outputs pass the mean and fail this)."""
    ref_means = [float(np.mean(row)) for row in reference if row]
    cand_means = [float(np.mean(row)) for row in candidate if row]
    ref_all = [lp for row in reference for lp in row]
    cand_all = [lp for row in candidate for lp in row]
    mean_ref = float(np.mean(ref_all)) if ref_all else 0.0
    mean_cand = float(np.mean(cand_all)) if cand_all else 0.0
    se = 0.0
    if len(ref_means) > 1 and len(cand_means) > 1:
        se = float(np.sqrt(np.var(ref_means, ddof=1) / len(ref_means) + np.var(cand_means, ddof=1) / len(cand_means)))
    margins = []
    if greedy and reference_tokens is not None and candidate_tokens is not None:
        for k, is_greedy in enumerate(greedy):
            a, b = reference_tokens[k], candidate_tokens[k]
            d = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
            if is_greedy and d is not None:
                margins.append(reference[k][d] - candidate[k][d])
    worst_margin = max(margins, default=0.0)
    allowed = bound + 3 * se
    return {"passed": (mean_cand >= mean_ref - allowed) and worst_margin <= GREEDY_MARGIN, "bound": bound,
            "allowed_shortfall": allowed, "reference_mean_logprob": mean_ref, "candidate_mean_logprob": mean_cand,
            "shortfall": mean_ref - mean_cand, "tokens": len(cand_all), "greedy_divergences": len(margins),
            "worst_greedy_margin": worst_margin, "greedy_margin_bound": GREEDY_MARGIN}


def compare_scores(reference: list[list[dict]], candidate: list[list[dict]], bound: float) -> dict:
    """The gate's verdict and the numbers behind it (what the ledger stores). Both are
    `score_tokens` results for the same prompts and tokens: A's and B's."""
    divergences, outside, unscored, agree, total = [], 0, 0, 0, 0
    for ref_row, cand_row in zip(reference, candidate, strict=True):
        for ref, cand in zip(ref_row, cand_row, strict=True):
            total += 1
            agree += cand["argmax"] == ref["argmax"]  # both from the scoring (prefill) path
            if ref["logprob"] is None:  # not even in A's own top list: nothing to compare against
                unscored += 1
                continue
            if cand["logprob"] is None:
                outside += 1
                divergences.append(max(ref["logprob"] - cand["floor"], 0.0))
            else:
                divergences.append(abs(ref["logprob"] - cand["logprob"]))
    worst = max(divergences, default=0.0)
    return {
        "passed": bool(divergences) and worst <= bound,
        "bound": bound,
        "max_divergence": worst,
        "mean_divergence": float(np.mean(divergences)) if divergences else 0.0,
        "positions": total,
        "compared": len(divergences),
        "outside_top": outside,
        "unscored": unscored,
        "argmax_agreement": agree / total if total else 0.0,
        "prompts": len(reference),
    }


def _run_to_completion(engine) -> dict:
    """Step until every request has finished; request id -> its final output."""
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished
