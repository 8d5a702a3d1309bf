"""Dynamic token counts on the GPU (issue 11, acceptance 6): three sequence lengths, under
``dynamic=True`` and under CUDA graphs (``mode="reduce-overhead"``): no tuning inside
backward (nothing may time kernels once the step runs), no error, gradients close to exact.
"""
import pytest
import torch

import hotcompile
from hotcompile import HOTConfig
from helpers import Block, rel

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

LENGTHS = (128, 200, 320)     # 200: a padded 16-token block per sequence


def _step(fn, model, x):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = fn(x)
    (out.float() * torch.linspace(-1, 1, out.shape[-1], device="cuda")).sum().backward()
    return [p.grad.double().clone() for p in model.parameters() if p.dim() == 2]


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_three_lengths_no_tuning_no_error(monkeypatch, mode):
    import triton.testing
    torch.manual_seed(0)
    model = Block(d=256, heads=4).cuda()
    xs = {t: torch.randn(4, t, 256, device="cuda") for t in LENGTHS}
    exact = {t: _step(model.double(), model, xs[t].double()) for t in LENGTHS}
    model.float()

    def no_timing(*a, **k):
        raise AssertionError("a kernel was timed (tuned) during a training step")
    monkeypatch.setattr(triton.testing, "do_bench", no_timing)
    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", no_timing)

    torch._dynamo.reset()
    cfg = HOTConfig(min_features=0, min_speedup=0, exclude=())
    be = hotcompile.backend(cfg)
    fn = torch.compile(model, backend=be, dynamic=True, mode=mode)
    for rep in range(3):                 # CUDA graphs: warm-up, record, replay per length
        for t in LENGTHS:
            grads = _step(fn, model, xs[t])
            for g, e in zip(grads, exact[t]):
                assert torch.isfinite(g).all()
                assert rel(g, e) < 0.5, (mode, rep, t, rel(g, e))   # gross errors (~1)
    assert len(be.report.rewritten) >= 4
