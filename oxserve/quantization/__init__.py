"""Quantized weights: W8A8 modules (`w8a8`), installed on load or taken from a
pre-quantized compressed-tensors checkpoint (`scheme`)."""
