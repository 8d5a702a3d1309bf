"""The g_x GEMM's path (``gemm.gx_format``): cuBLAS FP8 only where its operands hold HOT's
numbers exactly and its row-wise scales fit; the INT8 kernel elsewhere; CPU always INT8."""
import pytest
import torch

from hotcompile.kernels import formats, gemm
from hotcompile.kernels import reference as R

H100 = (9, 0)


@pytest.mark.parametrize("g_bits,w_bits,per_token,dtype,n,cap,forced,expect", [
    (4, 8, True, torch.bfloat16, 768, H100, None, "cublas_fp8"),      # the default
    (4, 4, True, torch.bfloat16, 768, (8, 9), None, "cublas_fp8"),    # Ada
    (8, 8, True, torch.bfloat16, 768, H100, None, "int8"),            # 8-bit g_y: not exact in e4m3
    (4, 8, False, torch.bfloat16, 768, H100, None, "int8"),           # per-tensor: no row-wise scale
    (4, 8, True, torch.float32, 768, H100, None, "int8"),             # fp32 output
    (4, 8, True, torch.float16, 768, H100, None, "int8"),
    (4, 8, True, torch.bfloat16, 770, H100, None, "int8"),            # N not a multiple of 16
    (4, 8, True, torch.bfloat16, 768, (8, 0), None, "int8"),          # A100: no FP8 tensor cores
    (4, 8, True, torch.bfloat16, 768, H100, "int8", "int8"),          # forced Triton INT8
    (4, 4, True, torch.bfloat16, 768, H100, "fp8", "fp8"),            # forced Triton FP8 (exact)
    (4, 8, True, torch.bfloat16, 768, H100, "fp8", "int8"),           # ... not where inexact
])
def test_gx_rule(g_bits, w_bits, per_token, dtype, n, cap, forced, expect):
    assert formats.gx_rule(g_bits, w_bits, per_token, dtype, n, cap, forced) == expect


def test_cpu_is_int8_and_w_format_follows_the_path():
    g = torch.randn(32, 48, dtype=torch.bfloat16)
    assert gemm.gx_format(g, 64, 4, 8, True) == "int8"
    assert formats.w_is_e4m3("cublas_fp8", 8) and not formats.w_is_e4m3("cublas_fp8", 4)
    assert not formats.w_is_e4m3("int8", 8) and not formats.w_is_e4m3("fp8", 4)
    # 4-bit W levels are exact in e4m3: the cuBLAS path keeps them as levels
    q, s = R.hq_weight(torch.randn(48, 32), 4)
    assert torch.equal(q.to(torch.float8_e4m3fn).float(), q.float())


def test_cublas_fp8_mm_contract_on_this_torch():
    """``cublas_fp8_mm``'s call of ``torch._scaled_mm`` (K-major operands, row-wise scales,
    bf16 out) on this torch version: torch's CPU kernel computes the same contract, so the
    argument layout is checked here against the exact product (the GPU tests check cuBLAS)."""
    if not hasattr(torch, "_scaled_mm"):
        pytest.skip("torch._scaled_mm missing")
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-7, 8, (40, 64), generator=g).to(torch.float8_e4m3fn)
    w, s_w = R.quantize_e4m3(torch.randn(48, 64, generator=g), per_row=True)
    s_a = torch.rand(40, generator=g) + 0.5
    try:
        out = gemm.cublas_fp8_mm(a, w, s_a, s_w / 16, torch.bfloat16, fast_accum=True)
    except RuntimeError as e:                       # no CPU kernel in this build
        pytest.skip(f"no CPU _scaled_mm: {e}")
    exact = (a.double() @ w.double().t()) * s_a.double()[:, None] * (s_w.double() / 16)[None, :]
    assert out.dtype == torch.bfloat16 and out.shape == (40, 48)
    assert float((out.double() - exact).norm() / exact.norm()) < 4e-3
