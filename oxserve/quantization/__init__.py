"""Quantized weights and caches.

w8a8.py         int8 Linear and routed-Experts modules (quantized on load or pre-quantized)
smooth.py       SmoothQuant: calibration and per-channel migration of activation outliers
on_load.py      what `--quantization w8a8` does before and after the weights load
scheme.py       pre-quantized compressed-tensors checkpoints: the schemes accepted
plan.py         per-layer plans (`--quantization-plan`)
sensitivity.py  the per-layer sensitivity search (`oxserve quantize sensitivity`)
quality.py      teacher-forced KL and top-1 agreement between two models
"""
