"""On CUDA, HOTConfig(forward="fp8") runs the forward GEMMs on cuBLAS FP8 (issue 12).

Skipped without a GPU (or without FP8 tensor cores). Checks: every rewritten site's forward
is a ``_scaled_mm`` in the compiled forward, the compiled output equals the eager reference
twin (``kernels.fp8_forward``) up to the GEMM's summation order, and training gradients stay
as close to fp64 as the bf16-forward HOT run's.
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


def _run(model, x, cfg):
    model.zero_grad(set_to_none=True)
    be = hotcompile.backend(cfg)
    with capture_graphs() as graphs, torch.autocast("cuda", dtype=torch.bfloat16):
        y = torch.compile(model, backend=be)(x)
    (y.float() * torch.linspace(-1, 1, y.shape[-1], device=y.device)).sum().backward()
    grads = [p.grad.double() for p in model.parameters() if p.dim() == 2]
    return be, y, graphs, grads


def test_gpu_fp8_forward_matches_its_twin_and_trains():
    torch.manual_seed(0)
    m = MLP(512, 2048, 512).cuda()
    x = torch.randn(8, 256, 512, device="cuda")
    cfg = dict(min_features=0, min_speedup=0, exclude=())
    be, y, graphs, g_fp8 = _run(m, x, HOTConfig(forward="fp8", **cfg))
    assert [r.forward for r in be.report.layers] == ["fp8", "fp8"]
    fwd = [n for g in graphs for n in g.nodes if n.target == torch.ops.aten._scaled_mm.default]
    assert len(fwd) == 2
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        h = F8.fp8_linear(x.reshape(-1, 512).bfloat16(), m.fc1.weight.bfloat16().t(),
                          m.fc1.bias.bfloat16()).relu()
        want = F8.fp8_linear(h, m.fc2.weight.bfloat16().t(), m.fc2.bias.bfloat16())
    err = rel(y.reshape(-1, 512).double(), want.double())
    assert err < 2e-3, err
    torch._dynamo.reset()
    _, _, _, g_bf16 = _run(m, x, HOTConfig(**cfg))
    m64 = MLP(512, 2048, 512).cuda().double()
    m64.load_state_dict(m.state_dict())
    y64 = m64(x.double())
    (y64 * torch.linspace(-1, 1, 512, device="cuda", dtype=torch.float64)).sum().backward()
    for a, b, e in zip(g_fp8, g_bf16, [p.grad for p in m64.parameters() if p.dim() == 2]):
        assert torch.isfinite(a).all()
        assert rel(a, e) < 1.5 * rel(b, e) + 0.03, (rel(a, e), rel(b, e))
