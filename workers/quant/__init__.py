"""Quantized checkpoints: the formats on the hub, round-to-nearest writing, and the kernels."""
