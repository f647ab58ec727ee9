"""Engine configuration: one frozen dataclass per concern, validated on construction.

The CLI builds its options from these dataclasses (see `oxserve.cli`), so every field's
`help` metadata is what `--help` prints.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field


def opt(default, help: str, **extra):
    return field(default=default, metadata={"help": help, **extra})


def default_capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 3, 4, 6, 8, 12, 16, 24, ...: powers of two and 1.5 times each, up to and with
    `max_num_seqs`. A batch padded to the next size computes at most a third more rows, and
    a padding row costs less than a request's (one cached token); 64 requests need 12
    recordings."""
    sizes, power = [1], 2
    while power < max_num_seqs:
        sizes += [power, power * 3 // 2]
        power *= 2
    return tuple(size for size in sizes if size < max_num_seqs) + (max_num_seqs,)


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = opt(None, "checkpoint directory (Hugging Face format); default: the embedded trained model")
    dtype: str = opt("bfloat16", "weight and activation dtype", choices=("bfloat16", "float32", "float16"))
    device: str = opt("cpu", "torch device: cpu, cuda, cuda:1, ...")
    max_model_len: int | None = opt(None, "longest prompt + output in tokens (default: the model's limit, capped at 32768)")
    seed: int = opt(0, "seed for requests that do not set their own")
    threads: int | None = opt(
        None, "torch intra-op threads on CPU (default: one per CPU this process may use, after affinity and cgroup "
        "quota; logged at start; 1 is steadier on a machine shared with other work)"
    )
    linear_kernel: str = opt(
        "auto", "matrix products of the projections and LM head: weights packed in panels run by oxserve's kernel "
        "(panels; CPU bf16 with AMX-BF16, AVX512-BF16 or AVX2), oneDNN pre-packed weights (onednn; CPU fp32, and bf16 "
        "where oneDNN runs it natively), F.linear (torch), or auto (panels, else onednn, where supported)",
        choices=("auto", "panels", "onednn", "torch"),
    )
    quantization: str = opt(
        "none", "w8a8: quantize weights to int8 on load (per output channel; activations int8 per token at run time), "
        "all projections and routed experts but the LM head and kv_b_proj. A pre-quantized compressed-tensors "
        "checkpoint loads as it was quantized without this option", choices=("none", "w8a8"),
    )

    quantization_plan: str | None = opt(
        None, "YAML file choosing per layer: weights (w8a8 | none) and cache dtypes (latent, index_keys, kda_state, kda_conv); "
        "`oxserve quantize sensitivity` writes one. Layers and keys it leaves out take the other options",
    )
    smoothquant_alpha: float = opt(
        0.5, "w8a8: SmoothQuant migration strength, used for modules whose inputs on calibration text (4 x 128 "
        "tokens of the shipped corpus) show outlier channels; 0: no calibration, no smoothing",
    )
    enforce_eager: bool = opt(
        False, "run every step eagerly: no captured decode steps (by default, when a decode step's shape comes "
        "again, that step is recorded, kernel calls and torch ops, and later ones replay the recording without the "
        "Python between)",
    )
    compile_sizes: str | None = opt(
        None, "batch sizes whose decode steps are captured and replayed, comma-separated (those above "
        "max_num_seqs: max_num_seqs); a decode batch runs padded to the smallest of them that holds it (or to a "
        "larger one already recorded, until recording its own would have paid), a larger batch eagerly; a batch size that takes half of the last 64 decode steps, and verify steps up to the "
        "largest size, are recorded as they are (default: 1, 2, 3, 4, 6, 8, 12, 16, 24, ..., each at most 1.5x "
        "the one before, up to max_num_seqs)",
    )

    limit_mm_per_prompt: str = opt(
        '{"image": 8, "video": 1}', 'images and videos one prompt may carry, as JSON {"image": N, "video": M} (as '
        "vLLM spells it); all zero: the vision tower is not loaded and prompts are text only",
    )
    mm_encoder_cache_tokens: int = opt(
        16384, "vision tower outputs kept by content hash (embeddings, least recently used dropped), so a repeated "
        "image or video is encoded once",
    )

    def __post_init__(self) -> None:
        self.mm_limits()  # validated here, read where used
        if self.mm_encoder_cache_tokens < 0:
            raise ValueError(f"mm_encoder_cache_tokens must be >= 0, got {self.mm_encoder_cache_tokens}")
        if not 0 <= self.smoothquant_alpha <= 1:
            raise ValueError(f"smoothquant_alpha must be in [0, 1], got {self.smoothquant_alpha}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        self.capture_sizes(1)  # validated here, read where the engine knows max_num_seqs

    def capture_sizes(self, max_num_seqs: int) -> tuple[int, ...]:
        """The decode batch sizes captured, ascending: those `compile_sizes` names (one above
        `max_num_seqs` becomes `max_num_seqs`: no batch is larger), or the default series up
        to `max_num_seqs` (ValueError when malformed)."""
        if self.compile_sizes is None:
            return default_capture_sizes(max_num_seqs)
        try:
            sizes = {int(part) for part in self.compile_sizes.split(",") if part.strip()}
        except ValueError:
            raise ValueError(f"compile_sizes must be comma-separated batch sizes, got {self.compile_sizes!r}") from None
        if not sizes or min(sizes) < 1:
            raise ValueError(f"compile_sizes must name batch sizes >= 1, got {self.compile_sizes!r}")
        return tuple(sorted({min(size, max_num_seqs) for size in sizes}))


    def mm_limits(self) -> dict[str, int]:
        """{"image": N, "video": M} from `limit_mm_per_prompt` (ValueError when malformed)."""
        try:
            limits = json.loads(self.limit_mm_per_prompt)
        except json.JSONDecodeError as e:
            raise ValueError(f"limit_mm_per_prompt is not JSON: {e}") from None
        if not isinstance(limits, dict) or set(limits) - {"image", "video"} or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in limits.values()
        ):
            raise ValueError(f'limit_mm_per_prompt must be {{"image": N, "video": M}} with counts >= 0, got {self.limit_mm_per_prompt}')
        return {"image": limits.get("image", 0), "video": limits.get("video", 0)}


@dataclass(frozen=True)
class CacheConfig:
    cache_memory_gib: float = opt(2.0, "memory for the MLA/indexer block cache and KDA state slots, GiB")
    block_size: int | None = opt(None, "tokens per cache block (default: 64, or a multiple of index_kpool)")
    num_blocks: int | None = opt(None, "override: number of cache blocks (ignores cache_memory_gib for blocks)")
    num_slots: int | None = opt(None, "override: number of KDA state slots (default: max_num_seqs)")
    kv_cache_dtype: str = opt(
        "auto", "storage of every MLA latent and DSA indexer key: auto (the model's dtype), bfloat16, float32, "
        "fp8 (e4m3) or int8, the last two with an fp32 scale per token", choices=("auto", "bfloat16", "float32", "fp8", "int8"),
    )
    kda_state_dtype: str = opt("float32", "storage of the KDA recurrent state (computed in fp32 either way)", choices=("float32", "bfloat16"))
    kda_conv_dtype: str = opt("auto", "storage of the KDA conv state (the last K-1 inputs): auto (the model's dtype), "
                              "bfloat16 or float32", choices=("auto", "bfloat16", "float32"))
    kda_decode: str = opt(
        "write-back", "how KDA decode keeps its state: write-back (read and write the whole state each step) or "
        "replay (ReplaySSM: read a checkpoint, write one ring entry, fold the ring when it is full)",
        choices=("write-back", "replay"),
    )
    kda_replay_len: int = opt(16, "replay: ring length, the steps kept between folds (SGLang's --linear-replayssm-cache-len)")
    enable_prefix_caching: bool = opt(
        True, "reuse cached prefixes across requests: MLA/indexer blocks shared by content hash, KDA states from "
        "checkpoints saved at prompt ends, conversation boundaries, branch points and finished requests",
    )
    prefix_checkpoint_gib: float = opt(0.5, "prefix caching: memory for KDA state checkpoints, GiB (besides cache_memory_gib)")
    prefix_checkpoint_policy: str = opt(
        "marconi", "prefix caching: which checkpoints to keep: marconi (admit finished turns, boundaries and branch "
        "points; evict by recency + alpha * prefill saved per byte) or lru (admit every candidate, evict the least "
        "recently used)", choices=("marconi", "lru"),
    )
    prefix_checkpoint_alpha: float = opt(1.0, "marconi: weight of prefill saved per byte against recency in eviction")
    prefix_checkpoint_interval: int = opt(0, "prefix caching: also checkpoint every this many blocks of a prompt (0: no)")

    def __post_init__(self) -> None:
        if self.prefix_checkpoint_gib <= 0:
            raise ValueError(f"prefix_checkpoint_gib must be > 0, got {self.prefix_checkpoint_gib}")
        if self.prefix_checkpoint_alpha < 0:
            raise ValueError(f"prefix_checkpoint_alpha must be >= 0, got {self.prefix_checkpoint_alpha}")
        if self.prefix_checkpoint_interval < 0:
            raise ValueError(f"prefix_checkpoint_interval must be >= 0, got {self.prefix_checkpoint_interval}")
        if self.cache_memory_gib <= 0:
            raise ValueError(f"cache_memory_gib must be > 0, got {self.cache_memory_gib}")
        if self.kda_replay_len < 1:
            raise ValueError(f"kda_replay_len must be >= 1, got {self.kda_replay_len}")
        for name in ("block_size", "num_blocks", "num_slots"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = opt(64, "most requests running at once")
    max_num_batched_tokens: int = opt(2048, "token budget of one engine step (prefill chunks + decodes)")
    scheduling_policy: str = opt(
        "fcfs", "fcfs: requests run in arrival order; priority: by each request's priority (lower first, as vLLM's), "
        "then arrival, and preemption takes the least urgent", choices=("fcfs", "priority"),
    )
    max_stall: float = opt(
        2.0,
        "stall-free batching: a step that carries prefill next to decodes whose output is wanted as it comes (any "
        "output kind but FINAL_ONLY: every server request) may cost at most this many times a decode-only step (its prefill tokens are bounded from measured step costs), unless "
        "prompts queue up faster than that lets them through (then each step takes 1/16 of the backlog); beside "
        "decodes that want their output only at the end (FINAL_ONLY: LLM.generate) prefill is not bounded; 0 turns it off",
    )
    speculative_config: str | None = opt(
        None, 'speculative decoding, as vLLM spells it: JSON {"method": "ngram", "num_speculative_tokens": k, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 1}, or {"method": "mtp", "num_speculative_tokens": k} '
        "(the checkpoint's MTP layer drafts, applied k times); drafts are verified in one pass and KDA layers run "
        "with ReplaySSM rings of at least k + 1 (a rejection is a ring-count move)",
    )
    deterministic: bool = opt(
        False,
        "batch-invariant mode: every token runs alone (one token per request per step, one request per "
        "forward pass), so a request's logits never depend on its neighbours, chunking or preemption; slow",
    )

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_stall != 0 and self.max_stall <= 1:
            raise ValueError(f"max_stall must be > 1 (or 0: off), got {self.max_stall}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        from oxserve.engine.speculative import SpeculativeConfig  # the engine's own parser checks it

        if SpeculativeConfig.parse(self.speculative_config) and self.deterministic:
            raise ValueError("deterministic mode feeds one token per step: it cannot verify draft tokens")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = opt(
        1, "ranks that split every layer (KDA and MLA heads, expert and MLP channels, the vocabulary): this process "
        "is rank 0 and spawns the others on this host; joined by torch.distributed (gloo on CPU, NCCL on CUDA)",
    )
    enable_expert_parallel: bool = opt(
        False, "tensor parallelism: give each rank whole routed experts (n_routed_experts / tensor_parallel_size of them) "
        "instead of a share of every expert's channels; each rank runs the tokens routed to its own experts",
    )
    layer_split_size: int = opt(
        1, "ranks that split the MLA layers' caches (Layer Split): each stores, and runs the attention of, only its own "
        "block of MLA layers, so the same per-rank cache memory holds about this many times the tokens; combines with "
        "tensor parallelism as tensor_parallel_size x layer_split_size ranks",
    )
    nnodes: int = opt(1, "parallel ranks: hosts the ranks are spread over, the same number of ranks on each (as torchrun)")
    node_rank: int = opt(
        0, "parallel ranks: this host's place among --nnodes; host 0 runs the engine and rank 0, every other host runs "
        "`oxserve serve` with its --node-rank and the same parallel options, and serves ranks only",
    )
    master_addr: str = opt("127.0.0.1", "parallel ranks: address rank 0 listens on for the process group")
    master_port: int = opt(0, "parallel ranks: port for the process group (0: a free one, on one host only)")
    collective_timeout: float = opt(
        60.0, "parallel ranks: seconds a collective may wait for a rank before the engine fails its requests and stops"
    )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.layer_split_size

    @property
    def node_ranks(self) -> range:
        """The global ranks this host runs."""
        per_node = self.world_size // self.nnodes
        return range(self.node_rank * per_node, (self.node_rank + 1) * per_node)

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.layer_split_size < 1:
            raise ValueError(f"layer_split_size must be >= 1, got {self.layer_split_size}")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"need nnodes >= 1 and 0 <= node_rank < nnodes, got nnodes={self.nnodes}, node_rank={self.node_rank}")
        if self.world_size % self.nnodes:
            raise ValueError(f"{self.world_size} ranks (tensor_parallel_size x layer_split_size) do not divide among "
                             f"nnodes={self.nnodes} hosts")  # fmt: skip
        if self.nnodes > 1 and self.master_port == 0:
            raise ValueError("nnodes > 1 needs an explicit master_port: the other hosts must know where to join")
        if self.collective_timeout <= 0:
            raise ValueError(f"collective_timeout must be > 0, got {self.collective_timeout}")
        if not 0 <= self.master_port < 65536:
            raise ValueError(f"master_port must be in [0, 65535], got {self.master_port}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
