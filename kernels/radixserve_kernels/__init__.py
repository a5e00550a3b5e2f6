"""Leaf kernels: torch + triton only, no radixserve imports. Every op has a torch reference,
a Triton kernel, and a dispatcher that picks Triton on CUDA and the torch path elsewhere."""
