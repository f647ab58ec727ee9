"""Teacher-forced accuracy of W8A8 against the fp32 model, with the dense MLPs and shared
experts in one native call (W8A8DenseMLP: the GLU between the products in fp32) and in the
separate form (two W8A8Linear products around the eager GLU in the model dtype), and of the
unquantized model, on held-out windows of the trained default model (docs/quantization.md).

    python docs/bench/w8a8_mlp_forms.py
"""

import torch
from oxserve.default_model import default_model
from oxserve.default_model.train import held_out_windows
from oxserve.model.forced import forced_logits
from oxserve.model.loader import load_model
from oxserve.quantization.quality import agreement
import oxserve.quantization.w8a8 as w
torch.set_num_threads(2)
path = default_model()
ref = load_model(path, dtype=torch.float32).model
seqs = held_out_windows(path, 24, 128, 1234)
refl = [forced_logits(ref, s, 64) for s in seqs]
for dtype in (torch.bfloat16, torch.float32):
    bf = load_model(path, dtype=dtype).model
    print(dtype, "unquantized       ", agreement(refl, [forced_logits(bf, s, 64) for s in seqs]))
    fused = load_model(path, dtype=dtype, transform=w.quantize_w8a8_on_load).model
    print(dtype, "w8a8 one-call MLPs", agreement(refl, [forced_logits(fused, s, 64) for s in seqs]))
    keep = w._mlps_in_one_call  # the separate form: the MLPs stay DenseMLP around W8A8Linear products
    w._mlps_in_one_call = lambda m: None
    sep = load_model(path, dtype=dtype, transform=w.quantize_w8a8_on_load).model
    w._mlps_in_one_call = keep
    print(dtype, "w8a8 separate MLPs", agreement(refl, [forced_logits(sep, s, 64) for s in seqs]))
