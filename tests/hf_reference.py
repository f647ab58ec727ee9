"""The oracle: HF transformers 5.23.0 `glm5_next` on random tiny configurations.

Discrete choices (MoE router top-k, DSA indexer top-k) are discontinuous: where the
reference's k-th and (k+1)-th candidates are nearly tied, two correct implementations may
pick differently, and the difference then flows on through the recurrent state. So the
choices themselves are compared: hooks record HF's picks and margins (`reference_run`) and
oxserve's picks (`OxserveChoices`) at every position, and a sequence is compared up to the
first position where oxserve picked differently. That is excused only where HF's margin
there is below `MARGIN_EPS` (relative); a different pick with a clear margin fails.

What the rule excuses is bounded: every comparison is recorded with `record_comparison`,
which fails a sequence compared over less than `MIN_SEQUENCE_FRACTION` of its positions, and
the session fails when less than `MIN_SUITE_FRACTION` of all positions were compared, or when
more than `MAX_SUITE_TIE_RATE` of all positions HF ran had a near tie (tests/conftest.py checks
both at the end and prints the tally per test).
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration
from transformers.models.glm5_next import modeling_glm5_next as hf

MARGIN_EPS = 1e-5
LOGIT_TOL = 1e-4  # times max |logit|
LOGPROB_TOL = 1e-4
MIN_SEQUENCE_FRACTION = 0.25
MIN_SUITE_FRACTION = 0.9
# Near ties are rare on these models (`make test` prints the session's rate with the tally:
# 0.38% of 25,519 positions on 2026-12-05), though a sequence whose random routers crowd
# can have several. Counted over the whole session, where a margin rule that excused too much
# would show, not per sequence, where such a tail fails at random.
MAX_SUITE_TIE_RATE = 0.02


@dataclass
class Tally:
    """Compared and total positions per test, over the whole session."""

    per_test: dict[str, list[int]] = field(default_factory=dict)  # [compared, total, ties broken]
    reference_positions: int = 0  # positions HF ran in `reference_run`
    near_ties: int = 0  # of those, positions with a discrete choice within MARGIN_EPS

    def add(self, test: str, compared: int, total: int, ties_broken: int = 0) -> None:
        entry = self.per_test.setdefault(test, [0, 0, 0])
        entry[0] += compared
        entry[1] += total
        entry[2] += ties_broken

    @property
    def compared(self) -> int:
        return sum(c for c, _, _ in self.per_test.values())

    @property
    def total(self) -> int:
        return sum(t for _, t, _ in self.per_test.values())

    @property
    def ties_broken(self) -> int:
        return sum(b for _, _, b in self.per_test.values())


TALLY = Tally()
FIDELITY_LINES: list[str] = []  # bf16 fidelity results, printed at the end of the session


def record_comparison(compared: int, total: int, ties_broken: int = 0) -> None:
    """Count a sequence compared over its first `compared` of `total` positions (the rest
    excused by a near tie), with `ties_broken` near ties decided HF's way; a sequence cut
    before a quarter of its positions fails."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
    TALLY.add(test, compared, total, ties_broken)
    assert compared >= MIN_SEQUENCE_FRACTION * total, (
        f"a near tie at position {compared} of {total} left this sequence nearly uncompared"
    )

VISION = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, projection_intermediate_size=32)


def tiny_config(**overrides) -> dict:
    """A small text config in the shape of GLM-5.3-Flash: KDA x3 then MLA/DSA, mHC, MoE."""
    cfg = dict(
        vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
        kv_lora_rank=32, q_lora_rank=48, v_head_dim=16, qk_nope_head_dim=16, index_topk=32, index_head_dim=16,
        index_n_heads=8, linear_head_dim=16, linear_num_heads=4, hc_mult=4, index_kpool=4, pad_token_id=0,
        eos_token_id=1,
    )
    cfg.update(overrides)
    return cfg


# Configurations the parity tests cover (see the engine-core and fidelity issues' lists).
CONFIGS = {
    # k-pool 4, sparse selection well below the context, a shared indexer layer after a full one.
    "kpool4_shared": tiny_config(
        layer_types=["linear_attention"] * 3 + ["indexed_attention"] * 2 + ["linear_attention"] * 2 + ["indexed_attention"],
        indexer_types=["full"] * 4 + ["shared"] + ["full"] * 3,
        mlp_layer_types=["dense"] + ["sparse"] * 7,
    ),
    # k-pool 16, the default i % 4 == 3 layer rule, two dense layers, unbounded forget gate.
    "kpool16": tiny_config(
        index_kpool=16, index_topk=64, mlp_layer_types=["dense"] * 2 + ["sparse"] * 6, linear_lower_bound=None,
    ),
    # The options a review found oxserve ignoring: no tail pool (queries may select nothing),
    # a GELU instead of SiLU, a 2-wide conv, the linear_attn_config form (its safe_gate bounds
    # the gate at -5 over the null given), grouped routing without renormalisation, two
    # shared experts, and a head tied to the embedding by the top-level flag.
    "variants": tiny_config(
        index_kpool_always_select_tail=False, hidden_act="gelu_pytorch_tanh", linear_lower_bound=None,
        linear_attn_config={"short_conv_kernel_size": 2, "gate_lower_bound": None, "safe_gate": True},
        n_group=2, topk_group=1, norm_topk_prob=False, n_shared_experts=2,
    ),
}
TOP_LEVEL = {"variants": {"tie_word_embeddings": True}}


@dataclass
class Reference:
    model: Glm5NextForConditionalGeneration
    path: Path


def build_reference(
    name: str, directory: Path, seed: int, text: dict | None = None, top_level: dict | None = None
) -> Reference:
    """A random HF model whose every parameter is non-trivial, saved as a checkpoint: the
    config CONFIGS[name] (and TOP_LEVEL[name]), or `text` (and `top_level`) when given."""
    torch.manual_seed(seed)
    text = CONFIGS[name] if text is None else text
    top_level = TOP_LEVEL.get(name, {}) if top_level is None else top_level
    config = Glm5NextConfig(text_config=text, vision_config=dict(VISION, out_hidden_size=64), **top_level)
    model = Glm5NextForConditionalGeneration(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "visual" not in pname:
                # Inits such as zero ape / unit gates / zero bias would hide indexing bugs. Router
                # weights get a wider spread, as in trained models: tiny random routers crowd
                # their scores together and make near ties common.
                scale = 0.3 if pname.endswith("mlp.gate.weight") else 0.05 if p.dim() > 1 else 0.3
                p.add_(torch.randn_like(p) * scale)
    model.save_pretrained(directory)
    return Reference(model=model, path=directory)


Key = tuple[str, int]  # ("router" | "indexer", layer index): one discrete choice per position


@dataclass
class ReferenceRun:
    """HF on one sequence: logits, and per discrete choice its pick and margin at each position."""

    logits: torch.Tensor  # [L, V]
    choices: dict[Key, list[frozenset[int]]]  # chosen experts / selected positions
    margins: dict[Key, torch.Tensor]  # [L] relative gap between the last chosen and the first left out

    def first_tie(self) -> int:
        tight = torch.stack(list(self.margins.values())).min(0).values < MARGIN_EPS if self.margins else None
        return int(tight.nonzero()[0]) if tight is not None and tight.any() else len(self.logits)


@torch.no_grad()
def reference_run(ref: Reference, tokens: list[int]) -> ReferenceRun:
    choices: dict[Key, list[frozenset[int]]] = {}
    margins: dict[Key, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(ref.model.model.language_model.layers):
        if isinstance(layer.mlp, hf.Glm5NextTextMoE):
            hooks.append(layer.mlp.gate.register_forward_hook(_router_hook(("router", i), choices, margins)))
        if getattr(layer.self_attn, "indexer", None) is not None:
            hooks.append(layer.self_attn.indexer.register_forward_hook(_indexer_hook(("indexer", i), choices, margins), with_kwargs=True))
    try:
        logits = ref.model(input_ids=torch.tensor([tokens])).logits[0].float()
    finally:
        for h in hooks:
            h.remove()
    run = ReferenceRun(logits, choices, margins)
    TALLY.reference_positions += len(tokens)
    TALLY.near_ties += int((torch.stack(list(margins.values())).min(0).values < MARGIN_EPS).sum()) if margins else 0
    return run


def teacher_forced(ref: Reference, tokens: list[int]) -> tuple[torch.Tensor, int, int]:
    """HF logits [L, V] for `tokens`, the first position whose discrete choice is a near tie,
    and how many positions have one."""
    run = reference_run(ref, tokens)
    tight = torch.stack(list(run.margins.values())).min(0).values < MARGIN_EPS if run.margins else torch.zeros(0)
    return run.logits, run.first_tie(), int(tight.sum())


def _gap(values: torch.Tensor, keep: int) -> torch.Tensor:
    """Relative gap between the keep-th and (keep+1)-th largest of each row (inf if nothing is left out)."""
    if values.shape[-1] <= keep:
        return torch.full(values.shape[:-1], float("inf"))
    top = values.topk(keep + 1, dim=-1).values
    return (top[..., keep - 1] - top[..., keep]) / top[..., 0].abs().clamp(min=1.0)


def _router_hook(key: Key, choices, margins):
    def hook(module, args, result):
        router_logits, _, indices = result
        scores = router_logits.sigmoid() + module.e_score_correction_bias
        grouped = scores.view(scores.shape[0], module.num_group, -1)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        kept = group_scores.topk(module.topk_group, dim=-1).indices
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        in_kept = scores.masked_fill(~mask.repeat_interleave(grouped.shape[-1], dim=1), float("-inf"))
        margins[key] = torch.minimum(_gap(in_kept, module.top_k), _gap(group_scores, module.topk_group))
        choices[key] = [frozenset(row.tolist()) for row in indices]

    return hook


def _indexer_hook(key: Key, choices, margins):
    """Record the reference indexer's selection, and recompute its pool scores (same module,
    same functions) for their margins."""

    def hook(module, args, kwargs, result):
        hs, q_resid, mask = kwargs["hidden_states"], kwargs["q_resid"], kwargs["attention_mask"]
        b, s = hs.shape[:2]
        q = module.wq_b(q_resid).view(b, s, -1, module.head_dim)
        k = module.k_norm(module.wk(hs))
        packed = torch.cat([k, F.linear(hs, module.index_kpool_compress_gate), mask.to(k.dtype)[..., None]], -1)
        visible = module.get_visible_tokens(packed[..., -1].bool(), q_length=s, current_length=s)
        pool_keys, pool_idx, pool_valid = module.get_pooled_states(packed)
        scores = F.relu(torch.matmul(q.float(), pool_keys.transpose(-1, -2).float().unsqueeze(1)) * module.softmax_scale)
        weights = module.weights_proj(hs).float() * module.n_heads**-0.5
        index_scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)[0]  # [S, P]
        ends = pool_idx[0, :, -1].clamp(0, s - 1)
        candidate = visible[0][:, ends] & pool_valid[0][None]
        k_sel = module.index_topk // module.index_kpool
        margins[key] = torch.stack([_gap(index_scores[t][candidate[t]], k_sel) for t in range(s)])
        choices[key] = [frozenset(p for p in row.tolist() if p >= 0) for row in result[0]]

    return hook


Forced = dict[str, dict[Key, dict[int, frozenset[int]]]]  # request -> choice -> position -> pick


class OxserveChoices:
    """oxserve's discrete choices, by request and position, from hooks on its routers and
    indexers. Every computation of a position is kept (preemption recomputes positions), so
    a divergence in any of them is seen.

    `forced` breaks near ties the reference's way: where HF's margin is a near tie, either
    pick is right, and oxserve is made to take HF's so that the comparison can go on."""

    def __init__(self, model, forced: Forced | None = None):
        self.forced: Forced = forced or {}
        self.request_ids = ["0"]  # of the requests in the current forward pass, in order
        self.seen: dict[str, dict[Key, dict[int, set[frozenset[int]]]]] = {}
        self.num_forced = 0
        self._batch = None
        model.register_forward_pre_hook(self._take_batch)
        for i, layer in enumerate(model.layers):
            if layer.sparse:
                layer.mlp.gate.register_forward_hook(lambda m, a, out, key=("router", i): self._route(m, a[0], out, key))
            if layer.is_mla and layer.self_attn.indexer is not None:
                layer.self_attn.indexer.register_forward_hook(lambda m, a, out, key=("indexer", i): self._apply(key, out))

    def watch_runner(self, runner) -> None:
        """Follow the request ids of each forward pass of an engine's runner."""
        # The class's function and a weak reference: the runner's bound method would make the
        # runner reference itself, keeping a dropped engine's caches until the collector runs.
        forward, owner = type(runner)._forward, weakref.ref(runner)

        def tracked(scheduled):
            self.request_ids = [s.request_id for s in scheduled]
            return forward(owner(), scheduled)

        runner._forward = tracked

    def _take_batch(self, module, args):
        self._batch = args[1]

    def _route(self, router, x: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor], key: Key):
        """Record the router's picks (native or torch); where some are forced, route again by
        the torch form with the forced picks, which weighs them as the router would."""
        ids = out[1]
        picks = self._apply(key, ids)
        if torch.equal(picks, ids):
            return out
        choose = router.choose
        router.choose = lambda scores: picks
        try:
            return router.route_torch(x)
        finally:
            router.choose = choose

    def _apply(self, key: Key, picks: torch.Tensor) -> torch.Tensor:
        """Record each token's pick, after putting in the forced ones."""
        batch = self._batch
        picks = picks.clone()
        for row, (pos, r) in enumerate(zip(batch.positions.tolist(), batch.request_index.tolist())):
            rid = self.request_ids[r]
            forced = self.forced.get(rid, {}).get(key, {}).get(pos)
            if forced is not None:
                values = sorted(forced) + [-1] * (picks.shape[1] - len(forced))
                picks[row] = torch.tensor(values, dtype=picks.dtype)
                self.num_forced += 1
            pick = frozenset(p for p in picks[row].tolist() if p >= 0)
            self.seen.setdefault(rid, {}).setdefault(key, {}).setdefault(pos, set()).add(pick)
        return picks

    def first_divergence(self, request_id: str, run: ReferenceRun, length: int) -> tuple[int, dict[Key, frozenset[int]]]:
        """The first position at which oxserve chose differently from the reference (length if
        none), and HF's pick at the first (most upstream) choice that differs there; choices
        after it at that position follow from it. A different pick is allowed only at a near
        tie of HF's."""
        seen = self.seen.get(request_id, {})
        for t in range(length):
            for key, picks in run.choices.items():  # in the order the model makes them
                ours = seen.get(key, {}).get(t, set())
                if any(pick != picks[t] for pick in ours):
                    margin = float(run.margins[key][t])
                    assert margin < MARGIN_EPS, (
                        f"{key[0]} of layer {key[1]} at position {t}: oxserve chose {sorted(next(iter(ours)))}, "
                        f"the reference {sorted(picks[t])}, with a clear margin {margin:.3g}"
                    )
                    return t, {key: picks[t]}
        return length, {}


def near_ties(run: ReferenceRun) -> dict[Key, dict[int, frozenset[int]]]:
    """HF's picks wherever its margin is a near tie: what to force on oxserve up front."""
    return {
        key: {t: run.choices[key][t] for t in (margins < MARGIN_EPS).nonzero().flatten().tolist()}
        for key, margins in run.margins.items()
    }


MAX_TIE_ROUNDS = 4


def check_generation(ref: Reference, generate, prompts: dict[str, list[int]]) -> None:
    """Run `generate(forced) -> ({request id: RequestOutput}, OxserveChoices)` (greedy, with
    logprobs) and check each continuation by teacher forcing: every token is HF's argmax (to
    LOGIT_TOL) with HF's logprob, and every discrete choice of the whole sequence is HF's.
    Where oxserve's choice parted from HF's at a near tie, the generation runs again with HF's
    choice forced there, until none part (near ties are rare: a round or two at most)."""
    forced: Forced = {}
    for _ in range(MAX_TIE_ROUNDS):
        outputs, choices = generate(forced)
        parted = False
        runs = {}
        for rid, prompt in prompts.items():
            tokens = outputs[rid].outputs[0].token_ids
            runs[rid] = run = reference_run(ref, prompt + tokens)
            t, hf_picks = choices.first_divergence(rid, run, len(prompt) + len(tokens))
            for key, pick in hf_picks.items():
                forced.setdefault(rid, {}).setdefault(key, {})[t] = pick
                parted = True
        if not parted:
            break
    else:
        raise AssertionError(f"oxserve kept parting from HF at near ties after {MAX_TIE_ROUNDS} rounds")
    for rid, prompt in prompts.items():
        out = outputs[rid].outputs[0]
        _check_tokens(runs[rid].logits, prompt, out.token_ids, out.logprobs)
        record_comparison(len(out.token_ids), len(out.token_ids), sum(len(p) for p in forced.get(rid, {}).values()))


def _check_tokens(logits: torch.Tensor, prompt: list[int], tokens: list[int], logprobs: list[dict[int, float]]) -> None:
    for i, token in enumerate(tokens):
        row = logits[len(prompt) - 1 + i]
        scale = max(1.0, float(row.abs().max()))
        assert float(row.max() - row[token]) <= LOGIT_TOL * scale, (
            f"step {i}: token {token} is not HF's argmax {int(row.argmax())} (gap {float(row.max() - row[token]):.3g})"
        )
        hf_logprob = float(torch.log_softmax(row, -1)[token])
        assert abs(logprobs[i][token] - hf_logprob) <= LOGPROB_TOL, (
            f"step {i}: logprob {logprobs[i][token]:.6f} vs HF {hf_logprob:.6f}"
        )
