"""On CUDA, HOTConfig(forward="fp8") runs the forward GEMMs on cuBLAS FP8 (issue 12).

Skipped without a GPU (or without FP8 tensor cores). Checks: every rewritten site's forward
is a ``_scaled_mm`` in the compiled forward; in fp32 the compiled output is the eager
reference twin (``kernels.fp8_forward``), and under bf16 autocast the twin on bf16 operands
(``e4m3_cast`` pins the operands to bf16 where Inductor fuses autocast's cast into the FP8
one); a cast Inductor fuses into the kernel producing its operand gives the eager twin's
levels bit for bit (``scale_reciprocal``: no approximate division); training gradients
stay as close to fp64 as the bf16-forward HOT run's.
"""
import pytest
import torch
import torch.nn.functional as F

import hotcompile
from hotcompile import HOTConfig
from hotcompile.kernels import fp8_forward as F8
from helpers import MLP, capture_graphs, rel, slow_hot_backward_table

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
    # the same levels and scales (``scale_reciprocal``); what is left is the GEMMs' own
    # rounding, should cuBLAS pick another algorithm for the compiled graph's layouts (the
    # bound was 1e-3 while the compiled reciprocal was Triton's approximate fp32 division)
    err = rel(y.reshape(-1, 512), _twin(m, x, torch.float32))
    assert err < 1e-6, err


def test_gpu_fp8_forward_under_autocast_trains_like_the_bf16_forward():
    torch.manual_seed(0)
    m = MLP(512, 2048, 512).cuda()
    x = torch.randn(8, 256, 512, device="cuda")
    be, y, graphs, g_fp8 = _run(m, x, HOTConfig(forward="fp8", **CFG))
    assert [r.forward for r in be.report.layers] == ["fp8", "fp8"]
    m64 = MLP(512, 2048, 512).cuda().double()
    m64.load_state_dict(m.state_dict())
    y64 = m64(x.double())
    # the twin on bf16 operands (bf16 outputs: a GEMM algorithm of cuBLAS's choice may round
    # an element differently); the twin on fp32 operands is ~1.4% away
    bf16, fp32 = _twin(m, x, torch.bfloat16), _twin(m, x, torch.float32, torch.bfloat16)
    err = rel(y.reshape(-1, 512), bf16)
    assert err < 1e-3 and err < rel(fp32, bf16) / 5, (err, rel(fp32, bf16))
    assert rel(y.double(), y64) < 0.06
    _, _, _, g_bf16 = _run(m, x, HOTConfig(forward="bf16", **CFG))
    (y64 * torch.linspace(-1, 1, 512, device="cuda", dtype=torch.float64)).sum().backward()
    for a, b, e in zip(g_fp8, g_bf16, [p.grad for p in m64.parameters() if p.dim() == 2]):
        assert torch.isfinite(a).all()
        assert rel(a, e) < 1.5 * rel(b, e) + 0.03, (rel(a, e), rel(b, e))


def test_gpu_a_site_with_an_exact_backward_takes_the_fp8_forward_alone(monkeypatch):
    """Under the default config, a table where HOT's backward never pays and FP8 forward
    GEMMs do: each site keeps Inductor's exact backward (no HOT op in any graph) and runs
    its forward on ``_scaled_mm`` (row-wise on Hopper). The gradients are the exact
    backward of that forward: against the twin (the eager row-wise FP8 forward, its backward
    in fp64 from the same bf16 operands) within the bf16 backward's rounding, far closer than
    to fp64's own forward (a ReLU mask the FP8 forward moves: ~0.1 here)."""
    from hotcompile.passes import cost
    if torch.cuda.get_device_capability()[0] != 9 or torch.version.hip:
        pytest.skip("the default FP8 forward is Hopper's")
    table = slow_hot_backward_table()
    monkeypatch.setattr(cost, "model_for", lambda device: table)
    torch.manual_seed(0)
    m = MLP(512, 2048, 512).cuda()
    x = torch.randn(8, 256, 512, device="cuda")
    be, y, graphs, (g1, g2) = _run(m, x, HOTConfig(min_features=0, exclude=()))
    assert all(r.reason.startswith("cost gate: predicted backward") for r in be.report.layers)
    assert [r.forward for r in be.report.layers] == ["fp8_rowwise"] * 2
    assert not any(str(n.target).startswith("hot.") for g in graphs for n in g.nodes)
    assert sum(n.target == torch.ops.aten._scaled_mm.default
               for g in graphs for n in g.nodes) == 2
    bf = lambda t: t.to(torch.bfloat16)  # noqa: E731
    xs, w1, w2 = bf(x.reshape(-1, 512)), bf(m.fc1.weight), bf(m.fc2.weight)
    with torch.no_grad():
        pre = F8.fp8_linear(xs, w1.t(), bf(m.fc1.bias), torch.bfloat16, rowwise=True)
        h = pre.relu()
        want = F8.fp8_linear(h, w2.t(), bf(m.fc2.bias), torch.bfloat16, rowwise=True)
    assert rel(y.reshape(-1, 512), want) < 1e-2
    gy = torch.linspace(-1, 1, 512, device="cuda", dtype=torch.float64).expand(xs.shape[0], -1)
    t2 = gy.t() @ h.double()
    t1 = ((gy @ w2.double()) * (pre > 0)).t() @ xs.double()
    m64 = MLP(512, 2048, 512).cuda().double()
    m64.load_state_dict(m.state_dict())
    (m64(x.double()) * gy[0]).sum().backward()
    # fc1's gradient goes through the mask (0.103 from fp64's, 0.0025 from the twin's on the
    # H200); fc2's sums h over the tokens, where the FP8 forward's errors average out
    # (0.0029 from fp64's, 0.0018 from the twin's)
    for got, twin, e, k in ((g1, t1, m64.fc1.weight.grad, 3), (g2, t2, m64.fc2.weight.grad, 1)):
        assert torch.isfinite(got).all()
        assert rel(got, twin) < 0.02 and rel(got, twin) < rel(got, e) / k, \
            (rel(got, twin), rel(got, e))


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


@pytest.mark.parametrize("forward", ["fp8", "fp8_rowwise"])
def test_gpu_saved_x_bound_from_the_cast_changes_no_bit(monkeypatch, forward):
    """The saved x's e4m3 bound handed over from the FP8 forward's cast (``passes/forward.py``,
    ``fp8_forward.max_bits``) in a compiled step: the forward's outputs and every gradient
    bit-equal to the same step with the compression's own reduction over x, and no more
    Inductor kernels (the reduction it drops is one when Inductor cannot fuse it into x's
    producer: Llama's down_proj)."""
    from torch._inductor.utils import run_and_get_code
    from hotcompile.debug.launches import launches
    from hotcompile.passes import forward as FW
    from helpers import Block

    def run():
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = Block(d=256, heads=4).cuda()
        x = torch.randn(8, 256, 256, device="cuda")
        be = hotcompile.backend(HOTConfig(forward=forward, **CFG))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = torch.compile(model, backend=be)(x)
        out.float().square().mean().backward()
        return out.detach(), [p.grad.clone() for p in model.parameters()]

    (y, ours), codes = run_and_get_code(run)
    n_ours = sum(launches(c)["inductor"] for c in codes)
    monkeypatch.setattr(FW, "_bound_reader", lambda s, buffers: None)
    (y_own, theirs), codes = run_and_get_code(run)
    n_theirs = sum(launches(c)["inductor"] for c in codes)
    assert torch.equal(y, y_own)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    assert n_ours <= n_theirs, (n_ours, n_theirs)


@pytest.mark.parametrize("gelu", ["none", "gelu_new"])
def test_gpu_gelu_and_its_cast_in_one_spliced_kernel_change_no_bit(monkeypatch, gelu):
    """Where a row-wise FP8 site's x is GELU's output (the block's fc2; exact GELU, or
    GPT-2's ``gelu_new``: tanh's in bf16 ops), the compiled forward launches
    ``hot::gelu_e4m3``'s kernel (spliced) and no Inductor kernel computing GELU, and the
    step's output and every gradient are bit-equal to the step with GELU and the cast left
    to Inductor (which fuses them into one looped reduction)."""
    import re
    from torch._inductor.utils import run_and_get_code
    from hotcompile.passes import forward as FW
    from helpers import Block

    def run():
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = Block(d=256, heads=4, gelu=gelu).cuda()
        x = torch.randn(8, 256, 256, device="cuda")
        be = hotcompile.backend(HOTConfig(forward="fp8_rowwise", **CFG))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = torch.compile(model, backend=be)(x)
        out.float().square().mean().backward()
        return out.detach(), [p.grad.clone() for p in model.parameters()], be

    (y, ours, be), codes = run_and_get_code(run)
    assert [r.x_cast for r in be.report.layers] == \
        ["GELU (Inductor)" if r.name.endswith("fc2") else "" for r in be.report.layers]
    def gelu_kernels(code):
        return re.findall(r"def (triton_\w*(?:gelu|tanh)\w*)\(", code)

    assert "_gelu_e4m3_kernel" in codes[0] and not gelu_kernels(codes[0])
    monkeypatch.setattr(FW, "_gelu_producer", lambda x: None)
    (y0, theirs, _), codes = run_and_get_code(run)
    assert "_gelu_e4m3_kernel" not in codes[0] and gelu_kernels(codes[0])
    assert torch.equal(y, y0)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


def _rms_norm(x, w):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w


_PRODUCERS = {
    "layernorm": lambda x, w: F.layer_norm(x, (x.shape[-1],), w, -w, 1e-6),
    "rmsnorm": _rms_norm,
    "gelu": lambda x, w: F.gelu(x * w),
}


@pytest.mark.parametrize("rowwise", [True, False])
@pytest.mark.parametrize("producer", sorted(_PRODUCERS))
def test_gpu_a_cast_fused_into_its_producer_is_the_eager_twin(producer, rowwise):
    """``e4m3_cast`` compiled beside the bf16 output of the kernel that makes its operand
    (Inductor fuses them into one) gives the levels and scale of the eager twin applied to
    that output, bit for bit: the fused cast rounds from the pinned bf16 value and divides
    exactly (``scale_reciprocal``). With Inductor's own fp32 reciprocal about 1e-7 of
    GELU's levels differed at ViT-B's shapes (forty-seventh stop, bench/producer_casts.py):
    too rare to fail here reliably, which is what the reciprocal's own test below is for."""
    torch.manual_seed(0)
    x = torch.randn(4096, 768, device="cuda").bfloat16() * 3
    w = (torch.rand(768, device="cuda") + 0.5).bfloat16()
    fn = _PRODUCERS[producer]

    def with_cast(x, w):
        y = fn(x, w)
        return (y, *F8.e4m3_cast(y, rowwise=rowwise))
    y, q, s = torch.compile(with_cast, backend="inductor", fullgraph=True)(x, w)
    q_ref, s_ref = F8.e4m3_cast(y, rowwise=rowwise)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def test_gpu_compiled_scale_reciprocal_is_ieee():
    """Inductor's code for ``scale_reciprocal`` (a ``div.rn.f64``) against eager CUDA's fp32
    reciprocal (IEEE) over every binade a cast's scale can take."""
    g = torch.Generator().manual_seed(3)
    e = torch.randint(-49, 119, (1 << 20,), generator=g).float()
    s = ((1 + torch.rand(1 << 20, generator=g)) * torch.exp2(e)).cuda()
    got = torch.compile(F8.scale_reciprocal, backend="inductor", fullgraph=True)(s)
    assert torch.equal(got, torch.reciprocal(s))


@pytest.mark.parametrize("O", [1001, 50257])
def test_gpu_unaligned_head_takes_the_fp8_forward_on_padded_w(monkeypatch, O):
    """A head whose out-features are not a multiple of 16 (GPT-2's 50257), its backward kept
    exact: the row-wise FP8 forward on cuBLAS with W padded to the next multiple of 16, the
    logits the first O columns of the GEMM's output. Against the eager twin
    (``F8.fp8_linear`` pads the same way) on the same bf16 operands: the logits bit for
    bit; the gradients the exact backward's of that forward."""
    from hotcompile.passes import cost
    table = slow_hot_backward_table()
    monkeypatch.setattr(cost, "model_for", lambda device: table)
    torch.manual_seed(0)
    head = torch.nn.Linear(256, O, bias=O == 1001).cuda()
    x = torch.randn(4, 128, 256, device="cuda", requires_grad=True)
    t = torch.randint(0, O, (4, 128), device="cuda")

    def loss_and_logits(x, t):
        y = head(x)
        return F.cross_entropy(y.flatten(0, 1).float(), t.flatten()), y.clone()

    be = hotcompile.backend(HOTConfig(min_features=0, exclude=(), forward="fp8_rowwise"))
    with capture_graphs() as graphs, torch.autocast("cuda", dtype=torch.bfloat16):
        loss, logits = torch.compile(loss_and_logits, backend=be)(x, t)
    loss.backward()
    rec = be.report.layers[0]
    pad = -O % 16
    assert (rec.forward, rec.forward_pad, rec.reason is not None) == ("fp8_rowwise", pad, True)
    assert [n.meta["val"].shape[1] for g in graphs for n in g.nodes
            if n.target == torch.ops.aten._scaled_mm.default] == [O + pad]
    bf = lambda v: v.detach().to(torch.bfloat16)  # noqa: E731
    xs, w = bf(x).reshape(-1, 256), bf(head.weight)
    b = bf(head.bias) if head.bias is not None else None
    want = F8.fp8_linear(xs, w.t(), b, torch.bfloat16, rowwise=True)
    assert torch.equal(logits.reshape(-1, O), want)
    # the exact backward of that forward: g_y from the loss on the twin's logits
    y = want.float().requires_grad_()
    F.cross_entropy(y, t.flatten()).backward()
    g = y.grad.to(torch.bfloat16).double()
    assert rel(x.grad.reshape(-1, 256).double(), g @ w.double()) < 1e-2
    assert rel(head.weight.grad.double(), g.t() @ xs.double()) < 1e-2
