"""A tiny glm5_next text config for fast engine tests (3 KDA layers + 1 MLA/DSA layer)."""

from oxserve.default_model import make_text_config

TINY_SHAPE = dict(
    hidden_size=64, num_hidden_layers=4, intermediate_size=96, n_routed_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=32, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=32, kv_lora_rank=16,
    qk_nope_head_dim=16, v_head_dim=16, index_n_heads=8, index_head_dim=16, index_topk=16, index_kpool=4,
    linear_num_heads=2, linear_head_dim=16, vocab_size=8192,
)
TINY_TEXT_CONFIG = make_text_config(**TINY_SHAPE)


def two_mla_checkpoint(directory):
    """The tiny shape with 8 layers: MLA layers 3 and 7, one for each of two Layer Split ranks."""
    import torch

    from oxserve.default_model import build_checkpoint

    return build_checkpoint(directory, make_text_config(**{**TINY_SHAPE, "num_hidden_layers": 8}), seed=5, dtype=torch.float32)
