"""On CUDA, backend="hot" runs the fused Triton kernels inside the compiled graph (issue 3, #3).

Skipped without a GPU. Checks: the fused entry points are what the hot:: ops call, no graph
break, and the gradient errors against an fp64 reference match the reference path's.
"""
import pytest
import torch

import hotcompile
from hotcompile import HOTConfig
from helpers import Block, rel

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _grads(model, x, backend, autocast=True):
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    fn = torch.compile(model, backend=backend) if backend else model
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        out = fn(x)
    (out.float() * torch.linspace(-1, 1, out.shape[-1], device=out.device)).sum().backward()
    return [x.grad.double()] + [p.grad.double() for p in model.parameters() if p.dim() == 2]


def test_fused_kernels_run_in_the_compiled_graph(monkeypatch):
    from hotcompile.kernels import fused
    calls = {"hq_grad_input": 0, "hla_grad_weight": 0, "abc_compress": 0}
    for name in calls:
        real = getattr(fused, name)

        def counted(*a, _real=real, _name=name, **k):
            calls[_name] += 1
            return _real(*a, **k)
        monkeypatch.setattr(fused, name, counted)

    torch.manual_seed(0)
    model = Block(d=256, heads=4).cuda()
    x = torch.randn(8, 256, 256, device="cuda")
    cfg = HOTConfig(min_features=0, exclude=())
    be = hotcompile.backend(cfg)
    hot = _grads(model, x, be)
    assert len(be.report.rewritten) == 4
    assert calls == {"hq_grad_input": 4, "hla_grad_weight": 4, "abc_compress": 4}, calls
    expl = torch._dynamo.explain(model)(x)
    assert expl.graph_break_count == 0

    torch._dynamo.reset()
    ref = _grads(model, x, hotcompile.backend(HOTConfig(min_features=0, exclude=(),
                                                         kernels="reference")))
    exact = _grads(model.double(), x.double(), None, autocast=False)
    model.float()
    for h, r, e in zip(hot, ref, exact):
        e_hot, e_ref = rel(h, e), rel(r, e)
        assert e_hot < 1.25 * e_ref + 0.02, (e_hot, e_ref)
