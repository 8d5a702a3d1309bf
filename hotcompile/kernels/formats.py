"""Which GEMM path and operand formats HOT's g_x takes: pure rules, no triton import.

Why a module of its own: the cost gate (``passes/cost.py``) predicts each site on the path
it will run, at compile time, also on machines where triton is not installed (CPU runs
the reference twins); the kernels (``gemm.gx_format``) apply the same rule at run time.
"""
from __future__ import annotations

import torch


def gx_rule(g_bits: int, w_bits: int, per_token: bool, dtype: torch.dtype, n: int,
            capability: tuple[int, int], forced: str | None) -> str:
    """The g_x GEMM's path on a CUDA device of this compute capability: "cublas_fp8",
    "int8" or "fp8" (the Triton kernel's two formats, only when ``forced``). Why each
    condition, with the measurements: ``gemm.gx_format``, which applies it at run time."""
    if forced in ("int8", "fp8"):
        return "fp8" if forced == "fp8" and max(g_bits, w_bits) <= 5 else "int8"
    if (g_bits <= 5 and per_token and dtype == torch.bfloat16 and n % 16 == 0
            and capability >= (8, 9)):
        return "cublas_fp8"
    return "int8"


def w_is_e4m3(fmt: str, w_bits: int) -> bool:
    """HQ's W operand is scaled FP8 (reference.quantize_e4m3) instead of ``w_bits`` levels:
    on the cuBLAS FP8 GEMM when the levels do not fit e4m3 exactly (8-bit W)."""
    return fmt == "cublas_fp8" and w_bits > 5
