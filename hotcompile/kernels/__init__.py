"""Kernels: pure-torch reference twins (reference.py), fused Triton kernels, custom-op registration (ops.py)."""
