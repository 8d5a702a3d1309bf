"""On CUDA, HOTConfig(forward="fp8") runs the forward GEMMs on cuBLAS FP8 (issue 12).

Skipped without a GPU (or without FP8 tensor cores). Checks: every rewritten site's forward
is a ``_scaled_mm`` in the compiled forward; in fp32 the compiled output is the eager
reference twin (``kernels.fp8_forward``) up to boundary levels, and under bf16 autocast it is
the twin on bf16 operands up to boundary levels too (``e4m3_cast`` pins the operands to bf16
where Inductor fuses autocast's cast into the FP8 one); training gradients stay as close to
fp64 as the bf16-forward HOT run's.
"""
import pytest
import torch

import hotcompile
from hotcompile import HOTConfig
from hotcompile.kernels import fp8_forward as F8
from helpers import MLP, capture_graphs, rel

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available()
                                 or torch.cuda.get_device_capability() < (8, 9),
                                 reason="needs CUDA with FP8 tensor cores")]

CFG = dict(min_features=0, min_speedup=0, exclude=())


def _run(model, x, cfg, autocast=True):
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    be = hotcompile.backend(cfg)
    with capture_graphs() as graphs, torch.autocast("cuda", dtype=torch.bfloat16,
                                                    enabled=autocast):
        y = torch.compile(model, backend=be)(x)
    (y.float() * torch.linspace(-1, 1, y.shape[-1], device=y.device)).sum().backward()
    grads = [p.grad.double() for p in model.parameters() if p.dim() == 2]
    return be, y, graphs, grads


def _twin(m, x, dtype, out=None):
    """The MLP through the reference twin, its operands cast to ``dtype`` first (``out``:
    the GEMMs' output dtype, default ``dtype``)."""
    out = out or dtype
    with torch.no_grad():
        h = F8.fp8_linear(x.reshape(-1, x.shape[-1]).to(dtype), m.fc1.weight.to(dtype).t(),
                          m.fc1.bias.to(out), out).relu()
        return F8.fp8_linear(h, m.fc2.weight.to(dtype).t(), m.fc2.bias.to(out), out)


def test_gpu_fp8_forward_is_its_twin_in_fp32():
    torch.manual_seed(0)
    m = MLP(512, 2048, 512).cuda()
    x = torch.randn(8, 256, 512, device="cuda")
    be, y, graphs, _ = _run(m, x, HOTConfig(forward="fp8", **CFG), autocast=False)
    assert [r.forward for r in be.report.layers] == ["fp8", "fp8"]
    assert sum(n.target == torch.ops.aten._scaled_mm.default
               for g in graphs for n in g.nodes) == 2
    # not bit-equal: Inductor's reciprocal is Triton's fp32 division (not IEEE-rounded), so
    # a level sitting on a rounding boundary may flip
    err = rel(y.reshape(-1, 512), _twin(m, x, torch.float32))
    assert err < 1e-3, err


def test_gpu_fp8_forward_under_autocast_trains_like_the_bf16_forward():
    torch.manual_seed(0)
    m = MLP(512, 2048, 512).cuda()
    x = torch.randn(8, 256, 512, device="cuda")
    be, y, graphs, g_fp8 = _run(m, x, HOTConfig(forward="fp8", **CFG))
    assert [r.forward for r in be.report.layers] == ["fp8", "fp8"]
    m64 = MLP(512, 2048, 512).cuda().double()
    m64.load_state_dict(m.state_dict())
    y64 = m64(x.double())
    # the twin on bf16 operands, as in fp32 up to levels on a rounding boundary (Triton's
    # fp32 division in Inductor's reciprocal); the twin on fp32 operands is ~1.4% away
    bf16, fp32 = _twin(m, x, torch.bfloat16), _twin(m, x, torch.float32, torch.bfloat16)
    err = rel(y.reshape(-1, 512), bf16)
    assert err < 1e-3 and err < rel(fp32, bf16) / 5, (err, rel(fp32, bf16))
    assert rel(y.double(), y64) < 0.06
    _, _, _, g_bf16 = _run(m, x, HOTConfig(forward="bf16", **CFG))
    (y64 * torch.linspace(-1, 1, 512, device="cuda", dtype=torch.float64)).sum().backward()
    for a, b, e in zip(g_fp8, g_bf16, [p.grad for p in m64.parameters() if p.dim() == 2]):
        assert torch.isfinite(a).all()
        assert rel(a, e) < 1.5 * rel(b, e) + 0.03, (rel(a, e), rel(b, e))


def test_gpu_default_forward_is_rowwise_fp8_on_hopper():
    """The default ``forward="auto"``: the row-wise FP8 forward on a Hopper GPU under bf16
    autocast (a ``_scaled_mm`` per site), bf16 in an fp32 graph; elsewhere bf16."""
    torch.manual_seed(0)
    m = MLP(512, 2048, 512).cuda()
    x = torch.randn(8, 256, 512, device="cuda")
    hopper = torch.cuda.get_device_capability()[0] == 9 and not torch.version.hip
    want = "fp8_rowwise" if hopper else "bf16"
    be, y, graphs, grads = _run(m, x, HOTConfig(**CFG))
    assert [r.forward for r in be.report.layers] == [want, want]
    assert all(torch.isfinite(g).all() for g in grads)
    _, _, graphs_bf16, _ = _run(m, x, HOTConfig(forward="bf16", **CFG))

    def scaled_mms(gs):     # whatever else holds one (the backward), the same in both runs
        return sum(n.target == torch.ops.aten._scaled_mm.default for g in gs for n in g.nodes)
    if want == "bf16":
        assert scaled_mms(graphs) == scaled_mms(graphs_bf16)
    else:
        assert scaled_mms(graphs) > scaled_mms(graphs_bf16)
    be, *_ = _run(m, x, HOTConfig(**CFG), autocast=False)
    assert [(r.forward, r.forward_reason) for r in be.report.layers] == [("bf16", "")] * 2
