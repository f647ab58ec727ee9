"""Test support: a checkpoint with planted activation outlier channels and the same function.

Trained models have a few hidden channels 20-100x larger than the rest at the inputs of their
projections; random weights have none. This multiplies chosen channels of every layer's two
input norms by `factor` and divides the same input columns of every weight that reads those
norms' outputs by it. In exact arithmetic the model computes the same function (fp32 logits
agree to rounding), but the projections now see outlier channels that per-token int8
quantization cannot represent well, which is the case SmoothQuant exists for.

`head_gain` multiplies the final norm's weight (a different function then, on purpose): a
tiny random model's next-token distributions are nearly flat, so any error vanishes in its
KL; sharpened, its logits spread like a trained model's and quantization error shows.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

# The weights that read input_layernorm's output (attention side) and post_attention_layernorm's
# (MLP side), in checkpoint names.
_ATTENTION_INPUTS = r"self_attn\.(q_proj|k_proj|v_proj|f_a_proj|b_proj|g_a_proj|q_a_proj|kv_a_proj_with_mqa|indexer\.wk|indexer\.weights_proj)"
_MLP_INPUTS = r"mlp\.(gate_proj|up_proj|gate|experts\.\d+\.(gate|up)_proj|shared_experts\.(gate|up)_proj)"
_OTHER_INPUTS = r"self_attn\.indexer\.index_kpool_compress_gate"  # the indexer's pool gate reads x too
_LAYER = r"(?:model\.language_model\.)?layers\.\d+\."


def plant_outliers(src: Path, dst: Path, channels: list[int], factor: float, head_gain: float = 1.0) -> None:
    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst)
    for file in dst.glob("*.safetensors"):
        tensors = load_file(file)
        for name, t in tensors.items():
            if re.fullmatch(_LAYER + r"(input_layernorm|post_attention_layernorm)\.weight", name):
                t = t.float()
                t[channels] *= factor
            elif re.fullmatch(r"(?:model\.language_model\.)?norm\.weight", name):
                t = t.float() * head_gain
            elif re.fullmatch(_LAYER + f"(({_ATTENTION_INPUTS}|{_MLP_INPUTS})\\.weight|{_OTHER_INPUTS})", name):
                t = t.float()
                t[:, channels] /= factor
            else:
                continue
            tensors[name] = t.to(tensors[name].dtype)
        save_file(tensors, file, metadata={"format": "pt"})
