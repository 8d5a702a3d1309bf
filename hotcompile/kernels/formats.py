"""Which GEMM paths and operand formats HOT's g_x and g_W take: pure rules, no triton import.

Why a module of its own: the cost gate (``passes/cost.py``) predicts each site on the path
it will run, at compile time, also on machines where triton is not installed (CPU runs
the reference twins); the kernels (``gemm.gx_format``) apply the same rule at run time.
"""
from __future__ import annotations

import os

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


def unit_w_is_e4m3(g: torch.Tensor, n: int, block: int, g_bits: int, w_bits: int,
                   gw_bits: int, per_token: bool) -> bool:
    """Whether a ``hot::linear_backward`` op on this g_y (fake or real) will run its fused
    g_x with W as scaled e4m3 (``fused.linear_backward``'s conditions for fused kernels,
    then ``gx_rule`` as ``gemm.gx_format`` applies it): the W operand the forward's
    ``hot::weight_operands`` can write for it at compile time."""
    if g.device.type != "cuda" or block != 16 \
            or not all(2 <= b <= 8 for b in (g_bits, w_bits, gw_bits)):
        return False
    path = gx_rule(g_bits, w_bits, per_token, g.dtype, n,
                   torch.cuda.get_device_capability(g.device), os.environ.get("HOT_GEMM_FORMAT"))
    return w_is_e4m3(path, w_bits)


GW_FORMATS = ("auto", "int8", "e4m3")


def fp8_gemm_dims(*dims) -> bool:
    """Whether every size is a multiple of 16, as cuBLAS's FP8 GEMM (``_scaled_mm``) asks of
    both operands' dimensions. A symbolic size counts as not: the formats are fixed at
    compile time, and a size that may not be a multiple of 16 must not crash at run time."""
    return all(isinstance(d, int) and d % 16 == 0 for d in dims)


def gw_rule(requested: str, device_type: str, capability: tuple[int, int] | None,
            dims: tuple = ()) -> str:
    """The g_W path's operand format, fixed at compile time (the forward saves x in it):
    "e4m3" (scaled FP8 on both sides, cuBLAS ``_scaled_mm``) or "int8" (8-bit levels, the
    INT8 Triton GEMM).

    ``requested`` is ``HOTConfig.gw_format``. "auto": e4m3 on CUDA devices with FP8 tensor
    cores (compute capability >= 8.9), int8 elsewhere (CPU runs the reference twins, which
    take either). Why e4m3 there: cuBLAS's FP8 GEMM is 1.12-2.1x the INT8 Triton kernel at
    g_W shapes (H100, layers_2026-11-24T030739: GPT d4096 fc1 1.70 vs 1.94 ms, ViT-B fc2
    0.049 vs 0.103 ms). Accuracy: e4m3 keeps a relative step per value where int8 has one
    absolute step per tensor, so its g_W error is ~2x int8's on Gaussian data but several
    times smaller where channel magnitudes spread (``test_reference``); the byte-level GPT
    and digits gates pass with it (accuracy_2026-11-24T024525, ..T031414). A forced "e4m3"
    on a CUDA device without FP8 falls back to int8.

    ``dims``: the in- and out-features of the sites that share the saved x. On a CUDA device
    e4m3 needs all of them multiples of 16 (``fp8_gemm_dims``: the g_W GEMM's N and M on
    cuBLAS); any other size takes int8, whose Triton GEMM masks its edges. Found by the
    property suite on the GPU (fiftieth stop): a 24-wide layer forced onto e4m3 raised
    "mat2 shape (16x24) must be divisible by 16" in its backward.
    """
    if requested not in GW_FORMATS:
        raise ValueError(f"HOTConfig.gw_format must be one of {GW_FORMATS}, got {requested!r}")
    fp8_ok = device_type != "cuda" or (capability is not None and capability >= (8, 9))
    if requested == "int8" or not fp8_ok or (device_type == "cuda" and not fp8_gemm_dims(*dims)):
        return "int8"
    return "e4m3" if requested == "e4m3" or device_type == "cuda" else "int8"


def gw_format_for(requested: str, device: torch.device, dims: tuple = ()) -> str:
    """``gw_rule`` for a tensor's device and the sites' sizes (compile time: the pass)."""
    cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    return gw_rule(requested, device.type, cap, dims)


def e4m3_gx_fused(device: torch.device, dtype: torch.dtype, O: int, I: int) -> bool:
    """Whether ``hot::e4m3_gx_backward`` runs its FP8 g_x on this device and these shapes:
    FP8 tensor cores (Ada/Hopper), bf16 g (the row-wise scaled GEMM's output), and O and I
    multiples of 16 (the GEMM's K and N). Elsewhere on a GPU the op keeps g_x exact; the
    pass asks this first and rewrites only where it holds, so the report is true."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        return False
    return dtype == torch.bfloat16 and O % 16 == 0 and I % 16 == 0
