"""The g_W path's format (``formats.gw_rule``, ``HOTConfig.gw_format``): e4m3 on cuBLAS FP8
where the device has FP8 tensor cores, int8 elsewhere; fixed at compile time because the
forward saves x in it. End to end on CPU with the reference twins in both formats."""
import pytest
import torch

import hotcompile
from hotcompile import HOTConfig
from hotcompile.kernels import formats
from hotcompile.passes import cost
from helpers import HOT_OPS, Block, capture_graphs, is_bw, rel

H100 = (9, 0)


@pytest.mark.parametrize("requested,device,cap,expect", [
    ("auto", "cuda", H100, "e4m3"),          # the default on Hopper
    ("auto", "cuda", (8, 9), "e4m3"),        # Ada
    ("auto", "cuda", (8, 0), "int8"),        # A100: no FP8 tensor cores
    ("auto", "cpu", None, "int8"),           # CPU: the reference twins, as before
    ("int8", "cuda", H100, "int8"),
    ("e4m3", "cpu", None, "e4m3"),           # the reference twin takes e4m3 too
    ("e4m3", "cuda", (8, 0), "int8"),        # forced where it cannot run: int8
])
def test_gw_rule(requested, device, cap, expect):
    assert formats.gw_rule(requested, device, cap) == expect


@pytest.mark.parametrize("dims,expect", [
    ((768, 3072), "e4m3"),
    ((768, 1000), "int8"),        # ViT's head: 1000 outputs, not a multiple of 16
    ((24, 32, 32, 48), "int8"),   # one site of a shared x 24 wide makes the group int8
    ((4096, "s0"), "int8"),       # a size without a hint: not provably aligned
])
def test_gw_rule_needs_cublas_fp8_sizes_on_cuda(dims, expect):
    """cuBLAS's FP8 GEMM takes only multiples of 16: other sizes take the INT8 kernel on a
    GPU (the property suite on the GPU raised "mat2 shape (16x24) must be divisible by
    16" before); the CPU's reference twin takes e4m3 at any size."""
    assert formats.gw_rule("auto", "cuda", H100, dims) == expect
    assert formats.gw_rule("e4m3", "cuda", H100, dims) == expect
    assert formats.gw_rule("e4m3", "cpu", None, dims) == "e4m3"


def test_gw_rule_rejects_unknown_formats():
    with pytest.raises(ValueError, match="gw_format"):
        formats.gw_rule("fp4", "cuda", H100)
    with pytest.raises(ValueError, match=r"HOTConfig\.gw_format"):
        HOTConfig(gw_format="fp8")


def test_cost_gate_predicts_the_saved_format():
    """The e4m3 path runs the cuBLAS GEMM, the int8 path the INT8 kernel (and, up to rank 8,
    one kernel pair for both of g's operands); the cuBLAS path is predicted faster."""
    g = torch.empty(8, 64, dtype=torch.bfloat16)       # a CPU stand-in is taken as an H100
    assert cost.gw_gemm_kernel(HOTConfig(), g) == "hla_cublas"
    assert cost.gw_gemm_kernel(HOTConfig(gw_format="int8"), g) == "hla_int8"
    assert cost.gw_gemm_kernel(HOTConfig(), g, (768, 1000)) == "hla_int8"   # unaligned
    e4 = cost.site_kernels(True, True, 16, "hq_cublas", "hla_cublas")
    assert "hla_cublas" in e4 and "hla_int8" not in e4
    assert "transpose_xq" not in e4         # ABC writes the saved x K-major
    assert cost.site_kernels(True, True, 8, "hq_cublas", "hla_cublas")[0] == "hq_g_token"
    assert cost.site_kernels(True, True, 8, "hq_cublas", "hla_int8")[0] == "grad_out"
    dims = (8192, 4096, 11008, 16, 16, True, True, 1.0, True)
    _, hot_fp8 = cost.H100.predict(*dims, gw_gemm="hla_cublas")
    _, hot_int8 = cost.H100.predict(*dims, gw_gemm="hla_int8")
    assert hot_fp8 < hot_int8


@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_block_trains_with_e4m3_saved_activations(autocast):
    """A transformer block compiled with ``gw_format="e4m3"`` on CPU: the forward saves e4m3
    buffers, every g_W comes from them, and the gradients are close to the exact ones
    (as close as the int8 format's, within a factor covering e4m3's coarser step)."""
    reports = []

    def grads(config):
        torch.manual_seed(0)
        model = Block()
        x = torch.randn(2, 32, 64, requires_grad=True)
        if config:
            be = hotcompile.backend(config)
            reports.append(be.report)
        cm = torch.compile(model, backend=be) if config else model
        with capture_graphs() as graphs:
            ctx = (torch.autocast("cpu", dtype=autocast) if autocast
                   else torch.autocast("cpu", enabled=False))
            with ctx:
                out = cm(x)
            out.float().square().mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}, graphs

    exact, _ = grads(None)
    torch._dynamo.reset()
    e4m3, graphs = grads(HOTConfig(min_features=0, exclude=(), gw_format="e4m3"))
    torch._dynamo.reset()
    int8, _ = grads(HOTConfig(min_features=0, exclude=(), gw_format="int8"))
    e4_rows, i8_rows = (r.layers for r in reports)
    fp32 = " -> fp32" if autocast else ""    # fp32 parameters' g_W: the GEMM writes fp32
    assert e4_rows and all(r.gw_path == "HLA r=16/16 e4m3" + fp32 for r in e4_rows)  # the report
    assert all(r.gw_path == "HLA r=16/16 int8" + fp32 for r in i8_rows)
    fw = [g for g in graphs if not is_bw(g)]
    abc = [n for g in fw for n in g.nodes if n.target is HOT_OPS["abc"]]
    assert abc and all(n.args[-1] == "e4m3" for n in abc)
    assert all(n.meta["val"][0].dtype == torch.float8_e4m3fn for n in abc)
    weights = [n for n in exact if n.endswith("weight") and exact[n].dim() == 2]
    assert len(weights) == 4
    for n in weights:
        e, i = rel(e4m3[n], exact[n]), rel(int8[n], exact[n])
        assert torch.isfinite(e4m3[n]).all() and e < max(3 * i, 0.15), (n, e, i)
