"""FP8 forward (issue 12): HOTConfig(forward="fp8") puts a rewritten site's forward GEMM on
tensor-wise e4m3 operands (kernels/fp8_forward.py), recorded into the graph op for op."""
import math

import pytest
import torch
import torch.nn.functional as F

import hotcompile
from hotcompile import HOTConfig
from hotcompile.kernels import fp8_forward as F8
from hotcompile.passes import cost

from helpers import MLP, Block, capture_graphs, gelu_new, slow_hot_backward_table

aten = torch.ops.aten


def _cfg(**kw):
    return HOTConfig(**{"min_features": 0, "exclude": (), "kernels": "reference",
                        "forward": "fp8", **kw})


def _e4m3_grid_ok(q: torch.Tensor) -> bool:
    v = q.float()
    return bool(torch.equal(v.to(torch.float8_e4m3fn).float(), v) and v.abs().max() <= 448)


# --------------------------------------------------------------------------- reference twin
def test_config_field_is_validated():
    with pytest.raises(ValueError, match="HOTConfig.forward"):
        HOTConfig(forward="fp16")
    assert HOTConfig().forward == "auto"


def test_tensorwise_cast_scale_and_grid():
    torch.manual_seed(1)
    t = torch.randn(37, 48) * 3.0
    q, s = F8.e4m3_cast(t)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.dim() == 0
    assert torch.equal(s, t.abs().max() * (1 / 448))       # as Inductor computes it on a GPU
    assert _e4m3_grid_ok(q) and q.float().abs().max() == 448       # amax lands on 448
    rel = ((q.float() * s - t).abs() / t.abs().clamp_min(1e-3 * t.abs().max())).max()
    assert rel <= 2 ** -4 + 1e-6                                     # half an e4m3 step


def _scales(n: int = 1 << 16) -> torch.Tensor:
    """Random positive fp32 scales over every binade a cast can make (its floor 1e-12 / 448
    to fp32's largest / 448), random mantissas, and the ends themselves."""
    g = torch.Generator().manual_seed(3)
    e = torch.randint(-49, 119, (n,), generator=g).float()
    s = (1 + torch.rand(n, generator=g)) * torch.exp2(e)
    ends = torch.tensor([F8.AMAX_FLOOR, torch.finfo(torch.float32).max]) * (1 / 448)
    return torch.cat([s, ends])


def test_scale_reciprocal_is_the_correctly_rounded_fp32_reciprocal():
    """``scale_reciprocal`` (fp64 divide, fp32 round) equals fp32's IEEE reciprocal, eager and
    compiled by Inductor (on the GPU: ``test_gpu_fp8_forward``)."""
    s = _scales()
    want = torch.reciprocal(s)
    assert torch.equal(F8.scale_reciprocal(s), want)
    compiled = torch.compile(F8.scale_reciprocal, backend="inductor", fullgraph=True)
    assert torch.equal(compiled(s), want)


def test_tensorwise_cast_zeros_nan_and_layout():
    q, s = F8.e4m3_cast(torch.zeros(16, 16))
    assert torch.equal(q.float(), torch.zeros(16, 16)) and s > 0 and torch.isfinite(s)
    t = torch.randn(16, 32)
    t[3, 5] = float("nan")
    q, s = F8.e4m3_cast(t)
    assert torch.isnan(s)
    q, _ = F8.e4m3_cast(torch.randn(32, 16).t(), contiguous=True)
    assert q.is_contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_matches_dequantized_matmul(dtype, bias):
    torch.manual_seed(2)
    x = torch.randn(40, 64).to(dtype)
    w = torch.randn(48, 64).to(dtype) / 8
    b = torch.randn(48).to(dtype) if bias else None
    y = F8.fp8_linear(x, w.t(), b)
    assert y.dtype == dtype and y.shape == (40, 48)
    xq, sx = F8.e4m3_cast(x)
    wq, sw = F8.e4m3_cast(w)
    want = (xq.float() * sx) @ (wq.float() * sw).t() + (b.float() if bias else 0)
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    assert (y.float() - want).abs().max() <= tol * want.abs().max()
    exact = x.float() @ w.float().t() + (b.float() if bias else 0)
    assert (y.float() - exact).norm() / exact.norm() < 0.06          # e4m3: ~3% per operand


def test_forward_rule(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert F8.forward_rule("bf16", cpu, 64, 64) == ("bf16", "")
    assert F8.forward_rule("fp8", cpu, 64, 64) == ("fp8", "")
    fmt, why = F8.forward_rule("fp8", cpu, 64, 72)
    assert fmt == "bf16" and "out-features a multiple of 16 (got 72)" in why
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    assert F8.forward_rule("fp8", cuda, 64, 64)[0] == "bf16"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    assert F8.forward_rule("fp8", cuda, 64, 64) == ("fp8", "")
    with pytest.raises(ValueError, match="HOTConfig.forward"):
        F8.forward_rule("e5m2", cpu, 64, 64)


@pytest.mark.parametrize("capability, dtype, want", [
    ((9, 0), torch.bfloat16, ("fp8_rowwise", "")),      # Hopper, bf16 forward: row-wise FP8
    ((9, 0), torch.float32, ("bf16", "")),               # an fp32 forward: nothing asked
    ((9, 0), torch.float16, ("bf16", "")),
    ((8, 9), torch.bfloat16, ("bf16", "")),              # FP8 tensor cores, no cost table
    ((10, 0), torch.bfloat16, ("bf16", "")),             # not measured
    ((8, 0), torch.bfloat16, ("bf16", "")),
])
def test_auto_forward_is_rowwise_fp8_on_hopper_only(monkeypatch, capability, dtype, want):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: capability)
    assert F8.forward_rule("auto", torch.device("cuda"), 64, 64, dtype) == want
    # a shape cuBLAS refuses still says why, as an explicit request would
    if want[0] != "bf16":
        fmt, why = F8.forward_rule("auto", torch.device("cuda"), 64, 72, dtype)
        assert fmt == "bf16" and "out-features a multiple of 16 (got 72)" in why
    # CPU (where an explicit request runs the reference, for tests): bf16, nothing to say
    assert F8.forward_rule("auto", torch.device("cpu"), 64, 64, dtype) == ("bf16", "")
    # ROCm reports MI300 as 9.x too; its FP8 is another format: bf16
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert F8.forward_rule("auto", torch.device("cuda"), 64, 64, dtype) == ("bf16", "")


# --------------------------------------------------------------------------- the pass
def _run(model, cfg, *xs, dynamic=None):
    be = hotcompile.backend(cfg)
    with capture_graphs() as graphs:
        y = torch.compile(model, backend=be, dynamic=dynamic)(*xs)
        y.float().sum().backward()
    return be, y, graphs


def _count(graphs, target):
    return sum(1 for g in graphs for n in g.nodes if n.target == target)


def test_compiled_forward_is_the_reference_bit_for_bit():
    torch.manual_seed(3)
    m, x = MLP(64, 96, 48), torch.randn(4, 8, 64)
    be, y, graphs = _run(m, _cfg(), x)
    assert [r.forward for r in be.report.layers] == ["fp8", "fp8"]
    assert _count(graphs, aten._scaled_mm.default) == 2
    assert _count(graphs, aten.mm.default) == 0 or all(     # no bf16 forward GEMM left
        n.meta.get("partitioner_tag") != "is_forward" for g in graphs for n in g.nodes
        if n.target in (aten.mm.default, aten.addmm.default))
    h = F8.fp8_linear(x.reshape(-1, 64), m.fc1.weight.t(), m.fc1.bias).relu()
    want = F8.fp8_linear(h, m.fc2.weight.t(), m.fc2.bias)
    assert torch.equal(y.reshape(-1, 48).detach(), want.detach())
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())
    assert " fp8 " in str(be.report)


@pytest.mark.parametrize("forward,autocast", [("fp8", None), ("fp8_rowwise", torch.bfloat16)])
def test_two_linears_back_to_back_on_a_transposed_input(forward, autocast):
    """Two failures the GPU property suite found on 7f4c0b2 (fiftieth stop). (1) The second
    linear reads the first's GEMM with no op between: its x still named the GEMM the FP8
    forward had replaced, and the compile failed ("referenced nonexistent value addmm").
    (2) With x a transposed view, Inductor wrote x's e4m3 copy column-major and cuBLASLt
    refused it: every FP8 forward GEMM's operands now carry their layouts
    (``fp8_forward.gemm_layouts``: x row-major, W column-major), checked in the graph here;
    the output against the eager model."""
    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(32, 48), torch.nn.Linear(48, 16)

        def forward(self, x):
            return self.b(self.a(x))

    torch.manual_seed(11)
    m, x = Two(), torch.randn(32, 40).t()          # (40, 32), column-major
    ctx = torch.autocast("cpu", dtype=autocast) if autocast else torch.autocast("cpu",
                                                                              enabled=False)
    with ctx:
        be, y, graphs = _run(m, _cfg(forward=forward), x)
        ref = m(x)
    assert [r.forward for r in be.report.layers] == [forward] * 2
    mms = [n for g in graphs for n in g.nodes if n.target == aten._scaled_mm.default]
    assert len(mms) == 2
    force = torch.ops.prims.inductor_force_stride_order.default
    for mm in mms:
        xq, wq = mm.args[:2]
        assert xq.target == force and wq.target == force
        i = xq.args[1][0]
        assert list(xq.args[1]) == [i, 1] and list(wq.args[1]) == [1, i]
    assert (y.float() - ref.float()).norm() / ref.float().norm() < 0.08
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())


def test_sites_reading_one_input_share_its_cast():
    """Block: qkv and fc1 read different inputs; the MLP's fc1 and a second projection of the
    same LayerNorm output would share. Here: three projections of one x, one x cast."""
    class QKV(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = (torch.nn.Linear(64, 64) for _ in range(3))

        def forward(self, x):
            return self.q(x) * self.k(x) + self.v(x)

    torch.manual_seed(4)
    m, x = QKV(), torch.randn(2, 16, 64)
    be, y, graphs = _run(m, _cfg(), x)
    assert [r.forward for r in be.report.layers] == ["fp8"] * 3
    assert _count(graphs, aten._scaled_mm.default) == 3
    # one amax per weight + one for the shared x (the backward has none: HQ/HLA are hot ops)
    assert _count(graphs, aten.amax.default) == 4


@pytest.mark.parametrize("forward", ["fp8", "fp8_rowwise"])
def test_bf16_autocast_block_and_dynamic_lengths(forward):
    torch.manual_seed(5)
    m = Block(64)
    be = hotcompile.backend(_cfg(forward=forward))
    f = torch.compile(m, backend=be, dynamic=True)
    for t in (16, 24, 40):
        x = torch.randn(2, t, 64)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = f(x)
        y.float().sum().backward()
        assert torch.isfinite(y.float()).all()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref = m(x)
        assert (y.float() - ref.float()).norm() / ref.float().norm() < 0.05
    assert [r.forward for r in be.report.training] == [forward] * 4


def test_auto_forward_on_cpu_compiles_the_bf16_forward():
    """The default ``forward="auto"`` on CPU (no FP8 GPU): the same graph as an explicit
    ``"bf16"``, under bf16 autocast too, and no forward reason in the report."""
    torch.manual_seed(6)
    m, x = Block(64), torch.randn(2, 16, 64)
    counts = {}
    for forward in ("auto", "bf16"):
        be = hotcompile.backend(_cfg(forward=forward))
        with capture_graphs() as graphs:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = torch.compile(m, backend=be)(x)
            y.float().sum().backward()
        assert [(r.forward, r.forward_reason) for r in be.report.training] == [("bf16", "")] * 4
        assert "forward bf16" not in str(be.report)
        counts[forward] = sorted(str(n.target) for g in graphs for n in g.nodes
                                 if n.op == "call_function")
    assert counts["auto"] == counts["bf16"]
    assert "aten._scaled_mm.default" not in counts["auto"]


def test_unaligned_features_keep_bf16_with_the_reason():
    m, x = MLP(64, 72, 48), torch.randn(2, 8, 64)
    be, y, graphs = _run(m, _cfg(), x)
    fwd = {r.name: (r.forward, r.forward_reason) for r in be.report.layers}
    assert fwd["fc1"][0] == "bf16"
    assert fwd["fc1"][1].startswith("FP8 forward needs out-features a multiple of 16")
    assert fwd["fc2"][0] == "bf16" and fwd["fc2"][1].startswith("FP8 forward needs in-features")
    assert "forward bf16: FP8 forward needs" in str(be.report)
    assert _count(graphs, aten._scaled_mm.default) == 0


def test_forward_cost_gate(monkeypatch):
    """With a cost model, a site keeps its bf16 forward where FP8 is predicted slower, and
    the report carries both predictions; the backward's gate is independent of it."""
    slow_fp8 = cost.CostModel(name="slow fp8", host_hot_ms=0.0, host_exact_ms=0.0, kernels={
        k: (0.0, 1e-15 if "bf16" not in k else 1e-9) for k in cost.KERNELS})
    slow_fp8.kernels["fwd_cast_x"] = (1.0, 0.0)
    monkeypatch.setattr(cost, "model_for", lambda device: slow_fp8)
    be, y, graphs = _run(MLP(64, 96, 48), _cfg(), torch.randn(2, 8, 64))
    for r in be.report.layers:
        assert r.reason is None, r                          # the backward is rewritten
        assert r.forward == "bf16", r.forward
        assert r.forward_reason.startswith("cost gate: predicted forward"), r.forward_reason
        assert r.forward_ms[1] > r.forward_ms[0]
    assert _count(graphs, aten._scaled_mm.default) == 0
    fast_fp8 = cost.CostModel(name="fast fp8", host_hot_ms=0.0, host_exact_ms=0.0, kernels={
        k: (0.0, 1e-15 if "bf16" not in k else 1e-9) for k in cost.KERNELS})
    monkeypatch.setattr(cost, "model_for", lambda device: fast_fp8)
    be, y, graphs = _run(MLP(64, 96, 48), _cfg(), torch.randn(2, 8, 64))
    assert [r.forward for r in be.report.layers] == ["fp8", "fp8"]


def test_exact_sites_keep_their_forward():
    """A site the backward leaves exact (min_features) is not touched by the forward pass."""
    be, y, graphs = _run(MLP(64, 96, 48), _cfg(min_features=80), torch.randn(2, 8, 64))
    assert [r.forward for r in be.report.layers] == ["bf16", "bf16"]
    assert all(r.reason for r in be.report.layers)
    assert _count(graphs, aten._scaled_mm.default) == 0


class _FP8ForwardExactBackward(torch.autograd.Function):
    """The eager twin of a site whose forward alone is rewritten: y = F8.fp8_linear(x, W^T,
    b); the gradients autograd's own linear gives from x and W (exact)."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        return F8.fp8_linear(x, w.t(), b)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, g.t() @ x, g.sum(0)


def test_a_site_the_backward_gate_keeps_exact_still_gets_an_fp8_forward(monkeypatch, caplog):
    """The two gates are independent: a site whose HOT backward is predicted slower keeps
    its exact backward (no HOT op, the partitioner's x and W) but takes the FP8 forward
    where that is predicted faster (ViT-L/16 bs128's qkv: backward 0.83x, forward 1.26x by
    the H200 table). Output and every gradient equal the eager twin: FP8 forward GEMMs,
    autograd's exact backward of each linear."""
    import logging
    caplog.set_level(logging.INFO, logger="hotcompile")
    slow_hot = slow_hot_backward_table()
    monkeypatch.setattr(cost, "model_for", lambda device: slow_hot)
    torch.manual_seed(11)
    m, x = MLP(64, 96, 48), torch.randn(4, 8, 64)
    be, y, graphs = _run(m, _cfg(), x)
    for r in be.report.layers:
        assert r.reason.startswith("cost gate: predicted backward"), r
        assert r.gx_path in ("exact", "-") and r.gw_path == "exact", r
        assert r.forward == "fp8" and r.forward_ms[0] > r.forward_ms[1], r
    assert _count(graphs, aten._scaled_mm.default) == 2
    assert not any(str(n.target).startswith("hot.") for g in graphs for n in g.nodes)
    assert "0/2 linear layers rewritten" in str(be.report)
    assert "2 more with an FP8 forward and an exact backward" in str(be.report)
    line = [r for r in caplog.records if "linear layers rewritten" in r.getMessage()]
    assert len(line) == 1 and line[0].levelno == logging.INFO, caplog.text   # not "nothing"
    assert "2 of the exact with the FP8 forward alone" in line[0].getMessage()
    twin = MLP(64, 96, 48)
    twin.load_state_dict(m.state_dict())
    xs = x.reshape(-1, 64)
    h = _FP8ForwardExactBackward.apply(xs, twin.fc1.weight, twin.fc1.bias).relu()
    want = _FP8ForwardExactBackward.apply(h, twin.fc2.weight, twin.fc2.bias)
    want.float().sum().backward()
    assert torch.equal(y.reshape(-1, 48).detach(), want.detach())
    for (name, p), q in zip(m.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5, msg=name)
    # and where FP8 would not pay either, the site is left exactly as it was
    slow_hot.kernels["fwd_cast_x"] = (1.0, 0.0)
    be, y, graphs = _run(MLP(64, 96, 48), _cfg(), x)
    assert [r.forward for r in be.report.layers] == ["bf16", "bf16"]
    assert all(r.forward_reason.startswith("cost gate: predicted forward")
               for r in be.report.layers)
    assert _count(graphs, aten._scaled_mm.default) == 0


def test_checkpointed_block_recomputes_the_fp8_forward():
    torch.manual_seed(6)
    m = MLP(64, 96, 48)

    def f(x):
        return torch.utils.checkpoint.checkpoint(m, x, use_reentrant=False)

    x = torch.randn(2, 8, 64)
    be = hotcompile.backend(_cfg())
    y = torch.compile(f, backend=be)(x)
    y.sum().backward()
    h = F8.fp8_linear(x.reshape(-1, 64), m.fc1.weight.t(), m.fc1.bias).relu()
    want = F8.fp8_linear(h, m.fc2.weight.t(), m.fc2.bias)
    assert torch.equal(y.reshape(-1, 48).detach(), want.detach())
    assert all(torch.isfinite(p.grad).all() for p in m.parameters())


def test_rowwise_cast_and_twin():
    torch.manual_seed(7)
    t = torch.randn(24, 64) * torch.logspace(-3, 3, 24)[:, None]    # rows 6 decades apart
    q, s = F8.e4m3_cast(t, rowwise=True)
    assert s.shape == (24, 1) and torch.equal(s, t.abs().amax(1, keepdim=True) * (1 / 448))
    assert _e4m3_grid_ok(q) and torch.equal(q.float().abs().amax(1), torch.full((24,), 448.0))
    w = torch.randn(48, 64).bfloat16()
    y = F8.fp8_linear(t.bfloat16(), w.t(), rowwise=True)
    xq, sx = F8.e4m3_cast(t.bfloat16(), rowwise=True)
    wq, sw = F8.e4m3_cast(w, rowwise=True)
    want = (xq.float() * sx) @ (wq.float() * sw).t()
    assert ((y.float() - want).abs() / want.abs().amax(1, keepdim=True)).max() < 1e-2
    # per-row scales keep every row's relative error; a tensor-wise scale loses the small rows
    exact = t.bfloat16().float() @ w.float().t()
    row_err = lambda a: ((a.float() - exact).norm(dim=1) / exact.norm(dim=1)).max()  # noqa: E731
    assert row_err(y) < 0.08 < row_err(F8.fp8_linear(t.bfloat16(), w.t()))


def test_rowwise_needs_a_bf16_forward():
    fmt, why = F8.forward_rule("fp8_rowwise", torch.device("cpu"), 64, 64, torch.float32)
    assert fmt == "bf16" and "row-wise FP8 needs a bf16 forward (got float32)" in why
    assert F8.forward_rule("fp8_rowwise", torch.device("cpu"), 64, 64) == ("fp8_rowwise", "")


def test_compiled_rowwise_forward_is_the_reference_bit_for_bit():
    torch.manual_seed(8)
    m, x = MLP(64, 96, 48).bfloat16(), torch.randn(4, 8, 64).bfloat16()
    be, y, graphs = _run(m, _cfg(forward="fp8_rowwise"), x)
    assert [r.forward for r in be.report.layers] == ["fp8_rowwise"] * 2
    scaled = [n for g in graphs for n in g.nodes if n.target == aten._scaled_mm.default]
    assert len(scaled) == 2 and all(n.args[2].meta["val"].shape == (32, 1) for n in scaled)
    h = F8.fp8_linear(x.reshape(-1, 64), m.fc1.weight.t(), m.fc1.bias, rowwise=True).relu()
    want = F8.fp8_linear(h, m.fc2.weight.t(), m.fc2.bias, rowwise=True)
    assert torch.equal(y.reshape(-1, 48).detach(), want.detach())
    fp32 = _run(MLP(64, 96, 48), _cfg(forward="fp8_rowwise"), torch.randn(4, 8, 64))[0]
    assert all(r.forward == "bf16"
               and r.forward_reason.startswith("row-wise FP8 needs a bf16 forward")
               for r in fp32.report.layers)


@pytest.mark.parametrize("forward", ["fp8", "fp8_rowwise"])
def test_saved_x_takes_its_bound_from_the_forward_cast(forward):
    """Where the saved x is e4m3 (its scale from the bound max |x|) and x goes to the FP8
    forward, the compression takes that bound from the cast's maxima (``F8.max_bits``):
    the same maxima the cast's scale comes from, so no reduction over x of its own
    (``test_abc_bound_from_the_forward_cast_is_its_own`` checks the buffers are equal).
    int8 levels take their scale from the projection: nothing handed over there."""
    torch.manual_seed(12)
    m, x = MLP(64, 96, 48).bfloat16(), torch.randn(4, 8, 64).bfloat16()
    abc = torch.ops.hot.abc_compress.default
    for fmt in ("e4m3", "int8"):
        be, y, graphs = _run(m, _cfg(forward=forward, gw_format=fmt), x)
        assert [r.forward for r in be.report.layers] == [forward] * 2
        # fc1's x (the input) is compressed in the forward; fc2's, ReLU's output, is needed
        # in backward anyway (ReLU's gradient reads it), so the pass compresses it there
        # (where the partitioner puts the op is its own choice): it keeps its own reduction
        assert [r.abc.split(" (")[0] for r in be.report.layers] == ["forward", "backward"]
        comps = [n for g in graphs for n in g.nodes if n.target == abc]
        bound = [n for n in comps if len(n.args) == 9]
        assert len(comps) == 2 and len(bound) == (1 if fmt == "e4m3" else 0)
        for comp in bound:
            assert len(comp.args) == 9
            bits = comp.args[8]
            assert bits.target == aten.view.dtype and bits.args[1] == torch.int32
            m_ = bits.args[0].args[0]
            if forward == "fp8_rowwise":        # the max of the cast's row maxima
                assert m_.target == aten.amax.default and list(m_.args[1]) == [0]
                m_ = m_.args[0]
            assert m_.target == aten.amax.default
            assert any(u.target == aten.clamp_min.default for u in m_.users)  # the scale's
            src = m_.args[0].args[0]            # |t32|, t32 the pinned x as fp32
            assert src.target == torch.ops.prims.convert_element_type.default
        assert torch.isfinite(y.float()).all()


def test_emit_records_the_function_with_metadata():
    """graph_utils.emit: every op the function calls becomes a node, in order, before the
    anchor, with a fake value, the partitioner tag, provenance copied from ``like`` and the
    extra meta; node arguments come back as nodes."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from hotcompile.passes.graph_utils import emit
    mode = FakeTensorMode()
    g = torch.fx.Graph()
    x = g.placeholder("x")
    with mode:
        x.meta["val"] = torch.empty(8, 32)
    out = g.call_function(aten.relu.default, (x,))
    out.meta.update(val=x.meta["val"], stack_trace="here")
    g.output(out)
    q, s = emit(g, lambda t: F8.e4m3_cast(t, rowwise=True), (x,), out, "is_forward", out, mode,
                {"recompute": "policy"})
    nodes = list(g.nodes)
    assert nodes.index(q) < nodes.index(out) and nodes.index(s) < nodes.index(out)
    new = nodes[1:nodes.index(out)]
    assert [n.target for n in new][:3] == [torch.ops.prims.convert_element_type.default,
                                          aten.abs.default, aten.amax.default]
    assert all(n.meta["partitioner_tag"] == "is_forward" and n.meta["recompute"] == "policy"
               and n.meta["stack_trace"] == "here" for n in new)
    assert q.meta["val"].dtype == torch.float8_e4m3fn and tuple(q.meta["val"].shape) == (8, 32)
    assert tuple(s.meta["val"].shape) == (8, 1) and s.meta["val"].stride() == (1, 1)


def test_fp8_forward_with_recompute_operands():
    """``recompute_operands`` beside the FP8 forward: every input rebuilt in backward, W read
    from the parameter, the forward still FP8, and the output and gradients the very same
    as without it (which also needs ``e4m3_cast``'s pinning: the two compiles fuse
    autocast's casts differently)."""
    out = {}
    for rc in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        m = Block(d=64, heads=4)
        be = hotcompile.backend(_cfg(forward="fp8_rowwise", recompute_operands=rc))
        x = torch.randn(2, 32, 64, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = torch.compile(m, backend=be)(x)
        y.float().square().mean().backward()
        recs = {r.name: r for r in be.report.layers}
        assert not be.report.errors and all(r.forward == "fp8_rowwise" for r in recs.values())
        out[rc] = [y.detach()] + [p.grad for p in m.parameters()] + [x.grad]
    assert all(recs[n].abc.startswith("rebuilt in backward") for n in ("qkv", "fc1", "fc2"))
    assert all(r.w_operand == "fp32 parameter" for r in recs.values())
    for a, b in zip(out[False], out[True]):
        assert torch.equal(a, b)


class NormLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = torch.nn.LayerNorm(64)
        self.fc = torch.nn.Linear(64, 128)

    def forward(self, x):
        return self.fc(self.ln(x))


@pytest.mark.parametrize("forward", ["fp8", "fp8_rowwise"])
def test_autocast_forward_is_the_twin_on_bf16_operands(forward):
    """Under bf16 autocast Inductor fuses LayerNorm, autocast's bf16 cast and the FP8 cast
    into one kernel, and would quantize the unrounded fp32 value; ``e4m3_cast`` pins x and
    W to bf16 first, so the compiled forward is the twin on the bf16 operands, bit for bit."""
    torch.manual_seed(3)
    m, x = NormLinear(), torch.randn(2, 32, 64)
    be = hotcompile.backend(_cfg(forward=forward))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = torch.compile(m, backend=be)(x)
    assert be.report.layers[0].forward == forward
    with torch.no_grad():
        h = m.ln(x).bfloat16().reshape(-1, 64)
        want = F8.fp8_linear(h, m.fc.weight.bfloat16().t(), m.fc.bias.bfloat16(),
                             rowwise=forward == "fp8_rowwise")
        unpinned = F8.fp8_linear(m.ln(x).reshape(-1, 64), m.fc.weight.t(), m.fc.bias,
                                 torch.bfloat16, rowwise=forward == "fp8_rowwise")
    assert torch.equal(y.reshape(-1, 128), want)
    assert not torch.equal(unpinned, want)     # the fp32 operands would give other levels


def _owned_casts_step(monkeypatch, make_model, forward, operands=False):
    """One bf16-autocast step of ``make_model()`` with an FP8 forward, with the weight casts
    owned (``passes/weight_cast.py``; CPU sites stand in for spliced CUDA ones, as in
    test_backend): (backend, graphs). ``operands``: the sites' g_x taken as on an H100 (W
    as scaled e4m3), so ``hot::weight_operands`` writes W's operands. Checks that the
    output and every gradient are bit-equal to the same step with autocast's casts left
    to the graph."""
    import hotcompile.passes.rewrite as RW
    import hotcompile.passes.weight_cast as WC
    monkeypatch.setattr(RW, "will_splice", lambda op, config: True)
    monkeypatch.setattr(WC, "unit_w_is_e4m3", lambda *a: operands)

    def step():
        torch._dynamo.reset()
        torch.manual_seed(0)
        m = make_model()
        be = hotcompile.backend(_cfg(forward=forward))
        x = torch.randn(2, 32, 64, requires_grad=True)
        with capture_graphs() as graphs:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = torch.compile(m, backend=be)(x)
            y.float().square().mean().backward()
        assert not be.report.errors and all(r.forward == forward for r in be.report.layers)
        return be, graphs, [y.detach()] + [p.grad for p in m.parameters()] + [x.grad]

    be, graphs, ours = step()
    monkeypatch.setattr(RW, "own_weight_casts", lambda *a, **k: [])
    _, _, theirs = step()
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    return be, graphs


def _weight_casts(graphs):
    return [n for g in graphs for n in g.nodes if n.target is torch.ops.hot.weight_cast.default]


def _nodes_of(graphs, op):
    return [n for g in graphs for n in g.nodes if n.target is op]


@pytest.mark.parametrize("operands", [False, True], ids=["maxima", "operands"])
@pytest.mark.parametrize("forward", ["fp8", "fp8_rowwise"])
def test_fp8_weight_scale_comes_from_the_weight_casts_maxima(monkeypatch, forward, operands):
    """Under bf16 autocast with an FP8 forward, ``hot::weight_cast`` owns each site's W cast
    as in bf16 mode (``passes/weight_cast.py``), and W's FP8 scale is read from the maxima it
    wrote (row-wise: its row maxima, asked for with ``row_max``; tensor-wise: the column
    maxima's max): no reduction over a weight is left in the forward, only x's. Where the
    g_x takes W as scaled e4m3 (``operands``), ``hot::weight_operands`` writes both HQ's W
    and the forward's W operand from the copy, and no FP8 cast of a weight is left in the
    graph. The forward output and every gradient are bit-equal to the same step with
    autocast's casts left to the graph."""
    be, graphs = _owned_casts_step(monkeypatch, lambda: Block(d=64, heads=4), forward, operands)
    casts = _weight_casts(graphs)
    assert len(casts) == len(be.report.layers) and all(
        n.args[3] == (forward == "fp8_rowwise") for n in casts)
    assert all(r.w_operand == "hot::weight_cast copy" for r in be.report.layers)
    amaxes = [n for g in graphs for n in g.nodes if n.target == aten.amax.default]
    weights = [n for n in amaxes if n.args[0].target is not aten.abs.default]  # of maxima bits
    # qkv, proj, fc1, fc2: 4 distinct inputs; row-wise, fc2's (GELU's output) has its maxima
    # from hot::gelu_e4m3, not an amax
    inputs = {r.name for r in be.report.layers if not r.x_cast}
    assert len(inputs) == (3 if forward == "fp8_rowwise" else 4)
    assert len(amaxes) - len(weights) == len(inputs)
    assert len(weights) == (0 if forward == "fp8_rowwise" or operands else len(casts))
    ops = _nodes_of(graphs, torch.ops.hot.weight_operands.default)
    units = _nodes_of(graphs, torch.ops.hot.linear_backward.default)
    e4m3_casts = [n for g in graphs for n in g.nodes
                  if n.target is torch.ops.prims.convert_element_type.default
                  and n.args[1] == torch.float8_e4m3fn]
    if operands:
        assert len(ops) == len(casts) and all(n.args[3] == forward and n.args[4] for n in ops)
        assert all(u.kwargs.get("w_q") is not None for u in units)
        assert len(e4m3_casts) == len(inputs)                  # x's casts only
    else:
        assert not ops and not any(u.kwargs.get("w_q") is not None for u in units)
        assert len(e4m3_casts) == len(inputs) + len(casts)


class _Tied(torch.nn.Module):
    """Two sites reading one weight (tied projections), on different inputs."""

    def __init__(self, d=64):
        super().__init__()
        self.a, self.b = torch.nn.Linear(d, d), torch.nn.Linear(d, d)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


@pytest.mark.parametrize("operands", [False, True], ids=["maxima", "operands"])
@pytest.mark.parametrize("forward", ["fp8", "fp8_rowwise"])
def test_a_weight_two_fp8_sites_share_gets_one_cast_with_its_maxima(monkeypatch, forward,
                                                                     operands):
    """A weight read by two sites gets one ``hot::weight_cast`` (with row maxima
    for a row-wise forward) whose maxima both sites' FP8 scales read, or (``operands``) one
    ``hot::weight_operands`` whose operands both sites' GEMMs read, and the step's output
    and gradients are bit-equal to the one with autocast's casts left to the graph."""
    be, graphs = _owned_casts_step(monkeypatch, _Tied, forward, operands)
    casts = _weight_casts(graphs)
    assert len(casts) == 1 and casts[0].args[3] == (forward == "fp8_rowwise")
    assert len(_nodes_of(graphs, torch.ops.hot.weight_operands.default)) == int(operands)
    assert len(be.report.layers) == 2
    assert all(r.w_operand == "hot::weight_cast copy" for r in be.report.layers)


GELU_CAST = torch.ops.hot.gelu_e4m3.default


class _GeluMLP(torch.nn.Module):
    """fc1 -> GELU -> Dropout(p=0) -> fc2, as timm's Mlp: fc2's x is GELU's output (through
    the clone the dropout leaves in a training graph). GELU: F.gelu's ``approximate``
    ("none", "tanh"), or "gelu_new" (``helpers.gelu_new``), "gelu_new_fp32_pow" (as CUDA
    autocast runs it), or "root0.8" (``gelu_new`` with 0.8 for sqrt(2/pi))."""

    def __init__(self, approximate="none", d=64):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)
        self.drop = torch.nn.Dropout(0.0)
        self.approximate = approximate

    def forward(self, x):
        h = self.fc1(x)
        if self.approximate.startswith("gelu_new"):
            h = gelu_new(h, fp32_pow=self.approximate.endswith("fp32_pow"))
        elif self.approximate == "root0.8":
            h = gelu_new(h, 0.8)
        else:
            h = torch.nn.functional.gelu(h, approximate=self.approximate)
        return self.fc2(self.drop(h))


class _GeluShared(torch.nn.Module):
    """GELU's output read by two sites (one ABC group, one cast of x) and by a slice of the
    residual path."""

    def __init__(self, d=64):
        super().__init__()
        self.fc1 = torch.nn.Linear(d, 4 * d)
        self.a, self.b = torch.nn.Linear(4 * d, d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        g = torch.nn.functional.gelu(self.fc1(x))
        return self.a(g) + self.b(g) + g[..., : x.shape[-1]] * 2


def _gelu_steps(monkeypatch, model, cfg, x, dynamic=None, autocast=False):
    """One compiled step of ``model()`` (seeded inside), then the same step with GELU left to
    the graph (``_gelu_producer`` finding none); asserts the outputs and every parameter's
    gradient bit-equal between the two. Returns (backend, graphs, graphs without the op)."""
    from hotcompile.passes import forward as FW
    runs = []
    for fuse in (True, False):
        torch._dynamo.reset()
        m = model()
        if not fuse:
            monkeypatch.setattr(FW, "_gelu_producer", lambda x: None)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            be, y, graphs = _run(m, cfg, x, dynamic=dynamic)
        runs.append((be, y, [p.grad for p in m.parameters()], graphs))
    (be, y, grads, graphs), (_, y0, grads0, graphs0) = runs
    assert _bits_equal(y, y0) and all(_bits_equal(a, b) for a, b in zip(grads, grads0))
    return be, graphs, graphs0


def _bits_equal(a, b) -> bool:
    return torch.equal(a.float().nan_to_num(), b.float().nan_to_num())


def _seeded(cls, seed: int, *args):
    """A builder of ``cls(*args)`` with its parameters drawn after ``manual_seed(seed)``."""
    def build():
        torch.manual_seed(seed)
        return cls(*args)
    return build


def _x_casts(be) -> list:
    return [r.x_cast.split(" (")[0] for r in be.report.layers]


def _source(n):
    """``n`` through views."""
    while n.target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default,
                       aten.view.dtype):
        n = n.args[0]
    return n


def test_gelu_output_and_its_fp8_cast_in_one_op(monkeypatch):
    """A row-wise FP8 site fed by exact GELU (ViT's fc2): GELU and the cast of its output
    become one ``hot::gelu_e4m3`` (no erf left in the forward graph), the saved x's e4m3
    bound comes from its row maxima, and the step's output and gradients are bit-equal to
    the step with GELU and the cast left to the graph."""
    torch.manual_seed(21)
    x = torch.randn(2, 8, 64).bfloat16()
    be, graphs, graphs0 = _gelu_steps(monkeypatch, lambda: _seeded(Block, 22, 64)().bfloat16(),
                                      _cfg(forward="fp8_rowwise", gw_format="e4m3"), x)
    assert [r.forward for r in be.report.layers] == ["fp8_rowwise"] * 4
    assert _x_casts(be) == ["", "", "", "GELU"]  # fc2
    assert str(be.report).count("fp8_rowwise (x from GELU's kernel)") == 1
    ops = _nodes_of(graphs, GELU_CAST)
    assert len(ops) == 1 and ops[0].meta["partitioner_tag"] == "is_forward"
    fwd = next(g for g in graphs if any(n in ops for n in g.nodes))
    assert not any(n.target == aten.erf.default for n in fwd.nodes)
    assert any(n.target == aten.erf.default for n in graphs0[0].nodes)
    assert not _nodes_of(graphs0, GELU_CAST)
    comp = [n for n in fwd.nodes if n.target == torch.ops.hot.abc_compress.default
            and _source(n.args[0]).args == (ops[0], 0)]
    assert len(comp) == 1 and len(comp[0].args) == 9
    total = _source(comp[0].args[8])                 # max_bits: amax over the row maxima
    assert total.target is aten.amax.default and total.args[0].args == (ops[0], 3)


@pytest.mark.parametrize("form,autocast", [
    ("tanh", False), ("tanh", True), ("gelu_new_fp32_pow", False), ("gelu_new_fp32_pow", True)])
def test_tanh_gelu_output_and_its_fp8_cast_in_one_op(monkeypatch, form, autocast):
    """tanh's GELU, as ``F.gelu(approximate="tanh")`` (fp32 ops between two casts) or as
    Hugging Face's ``gelu_new`` runs under CUDA autocast (GPT-2: its ``pow`` in fp32, so
    the ops after it, the result cast down), in a bf16 model or under autocast: GELU and
    the row-wise cast of fc2's x become one ``hot::gelu_e4m3``
    asked for tanh's formula, no tanh is left in the forward graph, and the step's output
    and gradients are bit-equal to the step with GELU and the cast left to the graph."""
    torch.manual_seed(29)
    build = _seeded(_GeluMLP, 30, form)
    x = torch.randn(2, 8, 64)
    be, graphs, graphs0 = _gelu_steps(monkeypatch, build if autocast else
                                      lambda: build().bfloat16(), _cfg(forward="fp8_rowwise"),
                                      x if autocast else x.bfloat16(), autocast=autocast)
    assert _x_casts(be) == ["", "GELU"]
    ops = _nodes_of(graphs, GELU_CAST)
    assert len(ops) == 1 and ops[0].args[1:] == ("reference", "tanh")
    fwd = next(g for g in graphs if any(n in ops for n in g.nodes))
    assert not any(n.target == aten.tanh.default for n in fwd.nodes)
    assert any(n.target == aten.tanh.default for n in graphs0[0].nodes)


class _GeluNewSharedTanh(torch.nn.Module):
    """``gelu_new`` with its tanh also read by the model's output: an op inside GELU's
    formula with a forward reader of its own, which Inductor stores. ``fp32_pow``: as CUDA
    autocast runs it (the tanh in fp32), else in bf16 ops (the tanh stored in bf16,
    rounded: where Inductor computes GELU's output from the stored value, it differs from
    the one-pass op's)."""

    def __init__(self, fp32_pow, d=64):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)
        self.fp32_pow = fp32_pow

    def forward(self, x):
        h = self.fc1(x)
        cube = torch.pow(h.float() if self.fp32_pow else h, 3.0)
        t = torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * cube))
        y = (0.5 * h * (1.0 + t)).to(h.dtype)
        return self.fc2(y) + t[..., : x.shape[-1]].to(h.dtype)


@pytest.mark.parametrize("fp32_pow", [False, True], ids=["bf16_ops", "fp32_pow"])
def test_gelu_kernel_left_out_where_an_op_of_the_formula_has_another_reader(monkeypatch,
                                                                            fp32_pow):
    """An op inside GELU's formula (its tanh) read in the forward outside it: GELU and the
    cast stay Inductor's (``_rounds_inside``), and the step is the same either way. In bf16
    ops the sixty-third stop's first matcher took this case and the step's output differed
    from Inductor's (the tanh Inductor stores is rounded to bf16, the op's is not); in fp32
    the stored value is exact, and the case is left out all the same: what Inductor fuses
    around a stored value is its choice, not proven here."""
    torch.manual_seed(31)
    be, graphs, _ = _gelu_steps(monkeypatch,
                                lambda: _seeded(_GeluNewSharedTanh, 32, fp32_pow)().bfloat16(),
                                _cfg(forward="fp8_rowwise"), torch.randn(2, 8, 64).bfloat16())
    assert [r.forward for r in be.report.layers] == ["fp8_rowwise"] * 2
    assert _x_casts(be) == ["", ""] and not _nodes_of(graphs, GELU_CAST)


@pytest.mark.parametrize("case", ["root0.8", "gelu_new_bf16", "emulate_precision_casts",
                                  "tensorwise", "fp32", "dynamic", "recompute_operands"])
def test_gelu_cast_stays_in_the_graph_where_the_op_does_not_apply(monkeypatch, case):
    """A formula like tanh's GELU with another constant (not GELU), ``gelu_new`` in bf16 ops
    (a bf16 model: Inductor's bits would hang on which ops it stores and rounds), the same
    where Inductor emulates eager's rounding after every op, a tensor-wise FP8 forward (one
    scale: a whole-tensor max first), an fp32 GELU, dynamic sizes and a GELU output the
    backward rebuilds (``recompute_operands``: the op would run whole again there, a copy
    of it in the backward graph) keep GELU and the cast in aten ops; the step is the same
    either way."""
    from torch._inductor import config as inductor_config
    torch.manual_seed(23)
    x = torch.randn(2, 8, 64)
    forward = "fp8" if case in ("tensorwise", "fp32") else "fp8_rowwise"
    x = x if case == "fp32" else x.bfloat16()
    form = {"root0.8": "root0.8", "gelu_new_bf16": "gelu_new",
            "emulate_precision_casts": "gelu_new"}.get(case, "none")
    build = _seeded(_GeluMLP, 24, form)
    cfg = _cfg(forward=forward, recompute_operands=case == "recompute_operands")
    with inductor_config.patch(emulate_precision_casts=case == "emulate_precision_casts"):
        be, graphs, _ = _gelu_steps(monkeypatch, build if case == "fp32" else
                                    lambda: build().bfloat16(), cfg, x,
                                    dynamic=case == "dynamic" or None)
    assert [r.forward for r in be.report.layers] == [forward] * 2
    assert not _nodes_of(graphs, GELU_CAST)


@pytest.mark.parametrize("case", ["dropout", "shared"])
def test_gelu_cast_under_autocast(monkeypatch, case):
    """Under bf16 autocast (fp32 parameters): timm's Mlp, a Dropout(p=0) between GELU and fc2
    (the H200's ViT-B graph, where the op first found nothing); GELU's output read by two
    sites (one ABC group, one cast of x: one op) and a slice. The op makes the sites' x,
    once, in the forward, and the step is bit-equal to the one without it."""
    torch.manual_seed(25)
    x = torch.randn(2, 8, 64)
    build = _seeded(_GeluShared if case == "shared" else _GeluMLP, 26)
    be, graphs, _ = _gelu_steps(monkeypatch, build, _cfg(forward="fp8_rowwise"), x,
                                autocast=True)
    assert _x_casts(be) == ["", "GELU"] + ["GELU"] * (case == "shared")
    ops = _nodes_of(graphs, GELU_CAST)
    assert len(ops) == 1 and ops[0].meta["partitioner_tag"] == "is_forward"


def test_gelu_cast_at_a_site_whose_backward_stays_exact(monkeypatch):
    """A GELU-fed site the backward's gate keeps exact and the forward's lets through (ViT-L
    bs128's qkv is the same decision without GELU) still gets x from GELU's kernel: the op
    is the graph's one HOT op, and the step is bit-equal to the one with GELU and the cast
    left to the graph."""
    monkeypatch.setattr(cost, "model_for", lambda device: slow_hot_backward_table())
    be, graphs, _ = _gelu_steps(monkeypatch, _seeded(_GeluMLP, 28),
                                _cfg(forward="fp8_rowwise"), torch.randn(2, 8, 64),
                                autocast=True)
    assert all(r.reason.startswith("cost gate: predicted backward") for r in be.report.layers)
    assert [r.forward for r in be.report.layers] == ["fp8_rowwise"] * 2
    assert _x_casts(be) == ["", "GELU"]
    hot = [n for g in graphs for n in g.nodes if str(n.target).startswith("hot.")]
    assert [n.target for n in hot] == [GELU_CAST], hot


@pytest.mark.parametrize("case", ["gelu", "tanh", "root0.8", "recompute_operands"])
def test_gate_prices_the_cast_of_x_where_gelus_kernel_writes_it(monkeypatch, case):
    """The forward's gate prices a GELU-fed site's cast of x as ``hot::gelu_e4m3`` writes it
    (``cost.predict_forward(gelu=True)``) exactly where the rewrite then uses the op (the
    report's ``x_cast``), in both of its asks (the backward's gate and the forward's), for
    exact and tanh's GELU; a formula that is not GELU's and ``recompute_operands`` keep the
    op out, and the price of a cast reading x."""
    seen = {}
    real = cost.CostModel.predict_forward

    owned = {}

    def spy(self, L, I, O, *a, **k):
        seen.setdefault(I, set()).add(k.get("gelu"))
        owned[I] = k.get("w_owned")
        return real(self, L, I, O, *a, **k)
    monkeypatch.setattr(cost.CostModel, "predict_forward", spy)
    monkeypatch.setattr(cost, "model_for", lambda device: cost.H200)
    build = _seeded(_GeluMLP, 27, "none" if case in ("gelu", "recompute_operands") else case)
    cfg = _cfg(forward="fp8_rowwise", min_speedup=0,
               recompute_operands=case == "recompute_operands")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        be, y, graphs = _run(build(), cfg, torch.randn(2, 8, 64))
    fused = case in ("gelu", "tanh")
    assert _x_casts(be) == ["", "GELU" if fused else ""]
    assert seen == {64: {False}, 256: {fused}}, seen
    fc2 = be.report.layers[1]
    assert fc2.forward_ms == pytest.approx(
        list(real(cost.H200, 16, 256, 64, 1.0, w_owned=owned[256], gelu=fused)), abs=6e-5)
    if fused:               # the op's line: below the price of a cast reading x
        assert fc2.forward_ms[1] < real(cost.H200, 16, 256, 64, 1.0, w_owned=owned[256])[1]


# ------------------------------------------------ out-features not a multiple of 16 (heads)
@torch.library.custom_op("hot_test::row_sums", mutates_args=())
def _row_sums(y: torch.Tensor) -> torch.Tensor:
    return y.sum(-1)


@_row_sums.register_fake
def _(y):
    return y.new_empty(y.shape[:-1])


class _Head(torch.nn.Module):
    """A layer, then an LM head of 77 out-features (GPT-2's 50257, BERT's 30522: cuBLAS's FP8
    GEMM takes multiples of 16) whose logits meet the loss inside the graph, returned with a
    copy of the logits; ``tail`` what else reads them: "returned" the caller (the logits
    themselves), "flat" a flattening view (which the padded GEMM's strided output cannot
    give), "custom_op" an op outside aten (which may assume its input contiguous)."""

    def __init__(self, tail="", bias=True):
        super().__init__()
        self.tail = tail
        self.fc, self.head = torch.nn.Linear(64, 64), torch.nn.Linear(64, 77, bias=bias)

    def forward(self, x, t):
        y = self.head(torch.relu(self.fc(x)))
        if self.tail == "flat":
            y = y.reshape(-1).view(y.shape)
        loss = F.cross_entropy(y.flatten(0, 1).float(), t.flatten())
        if self.tail == "custom_op":
            loss = loss + 0 * _row_sums(y.detach()).sum()
        return loss, (y if self.tail == "returned" else y.clone())


@pytest.mark.parametrize("forward,autocast,bias", [("fp8", None, True),
                                                   ("fp8_rowwise", torch.bfloat16, True),
                                                   ("fp8_rowwise", torch.bfloat16, False)])
def test_head_with_unaligned_out_features_takes_the_fp8_forward_on_padded_w(
        monkeypatch, forward, autocast, bias):
    """A head of 77 out-features whose backward stays exact takes the FP8 forward on W padded
    with 3 zero rows (and its bias with 3 zeros), its output the first 77 columns of the
    GEMM's: the logits are the eager twin's (``F8.fp8_linear`` pads the same way) bit for
    bit, every gradient the exact backward's of that forward; the report says the padding."""
    monkeypatch.setattr(cost, "model_for", lambda device: slow_hot_backward_table())
    torch.manual_seed(31)
    m, x, t = _Head(bias=bias), torch.randn(2, 8, 64), torch.randint(0, 77, (2, 8))
    twin = _Head(bias=bias)
    twin.load_state_dict(m.state_dict())
    ctx = (torch.autocast("cpu", dtype=autocast) if autocast
           else torch.autocast("cpu", enabled=False))
    with ctx:
        be = hotcompile.backend(_cfg(forward=forward))
        with capture_graphs() as graphs:
            loss, logits = torch.compile(m, backend=be)(x, t)
        loss.backward()
    head = {r.name: r for r in be.report.layers}["head"]
    assert (head.forward, head.forward_pad, head.forward_reason) == (forward, 3, ""), head
    # its g_x is exact (exact_gx names it) and computed: the report said "-" (no g_x) before
    assert (head.gx_path, head.gw_path) == ("exact", "exact"), head
    assert "fwd" in str(be.report) and f"{forward} (W padded to 80 rows)" in str(be.report)
    gemms = [n for g in graphs for n in g.nodes if n.target == aten._scaled_mm.default]
    assert sorted(n.meta["val"].shape[1] for n in gemms) == [64, 80]
    # the eager twin: the same FP8 forward on the operands' dtype, autograd's exact backward
    dt = autocast or torch.float32
    xs = x.reshape(-1, 64).to(dt)
    b = lambda lin: lin.bias.to(dt) if lin.bias is not None else None  # noqa: E731
    h = _FP8ForwardExactBackwardAny.apply(xs, twin.fc.weight, b(twin.fc), forward).relu()
    y = _FP8ForwardExactBackwardAny.apply(h, twin.head.weight, b(twin.head), forward)
    want = F.cross_entropy(y.float(), t.flatten())
    want.backward()
    assert torch.equal(logits.reshape(-1, 77).detach(), y.detach())
    # the loss's sum: Inductor's order under autocast is not eager's (1 ulp seen)
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=0)
    for (name, p), q in zip(m.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=2e-2 if autocast else 1e-5,
                                   atol=1e-4 if autocast else 1e-6, msg=name)


class _FP8ForwardExactBackwardAny(torch.autograd.Function):
    """As ``_FP8ForwardExactBackward`` with the format (tensor-wise or row-wise) and the
    operands' dtype (W cast to x's, as autocast does)."""

    @staticmethod
    def forward(ctx, x, w, b, forward):
        w = w.to(x.dtype)
        ctx.save_for_backward(x, w)
        ctx.bias = b is not None
        return F8.fp8_linear(x, w.t(), b, rowwise=forward == "fp8_rowwise")

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, (g.t() @ x).float(), g.sum(0).float() if ctx.bias else None, None


@pytest.mark.parametrize("tail,why", [
    ("returned", "the GEMM's output is returned from the graph"),
    ("flat", "a view of the GEMM's output fails on its strides"),
    ("custom_op", "the GEMM's output is read by hot_test.row_sums.default, not an aten op")])
def test_unaligned_head_keeps_bf16_where_a_strided_output_is_not_proven_safe(
        monkeypatch, tail, why):
    """Where the padded GEMM's output (a strided view) would reach the caller, a view that
    cannot be taken of it, or an op outside aten, the head keeps Inductor's bf16 forward
    and the report says which; the logits are those of the model's exact head on the FP8
    forward of the layer below."""
    monkeypatch.setattr(cost, "model_for", lambda device: slow_hot_backward_table())
    torch.manual_seed(32)
    m, x, t = _Head(tail), torch.randn(2, 8, 64), torch.randint(0, 77, (2, 8))
    be = hotcompile.backend(_cfg())
    with capture_graphs() as graphs:
        loss, logits = torch.compile(m, backend=be)(x, t)
    loss.backward()
    head = {r.name: r for r in be.report.layers}["head"]
    assert (head.forward, head.forward_pad) == ("bf16", 0)
    assert head.forward_reason.startswith(
        "FP8 forward needs out-features a multiple of 16 (got 77); W not padded: " + why), head
    assert [n.meta["val"].shape[1] for g in graphs for n in g.nodes
            if n.target == aten._scaled_mm.default] == [64]
    assert logits.is_contiguous() and logits.shape == (2, 8, 77)
    h = F8.fp8_linear(x.reshape(-1, 64), m.fc.weight.t(), m.fc.bias).relu()
    torch.testing.assert_close(logits.reshape(-1, 77), m.head(h), rtol=1e-5, atol=1e-6)


def test_unaligned_rewritten_site_is_not_padded():
    """A site HOT rewrites keeps the bf16 forward at 72 out-features: its W operand can come
    from HOT's weight kernels, which write O rows."""
    be, y, graphs = _run(MLP(64, 72, 48), _cfg(), torch.randn(2, 8, 64))
    fc1 = {r.name: r for r in be.report.layers}["fc1"]
    assert fc1.rewritten and fc1.forward == "bf16"
    assert fc1.forward_reason == ("FP8 forward needs out-features a multiple of 16 (got 72); "
                                  "W not padded: only where the backward stays exact")


def test_padded_head_under_dynamic_token_counts(monkeypatch):
    """Token counts as symbols: the padded GEMM's view and the views after it are re-run on
    symbolic sizes; three lengths, each one's logits the twin's."""
    monkeypatch.setattr(cost, "model_for", lambda device: slow_hot_backward_table())
    torch.manual_seed(33)
    m = _Head()
    be = hotcompile.backend(_cfg())
    f = torch.compile(m, backend=be, dynamic=True)
    for n in (8, 12, 20):
        x, t = torch.randn(2, n, 64), torch.randint(0, 77, (2, n))
        loss, logits = f(x, t)
        loss.backward()
        h = F8.fp8_linear(x.reshape(-1, 64), m.fc.weight.t(), m.fc.bias).relu()
        want = F8.fp8_linear(h, m.head.weight.t(), m.head.bias)
        assert torch.equal(logits.reshape(-1, 77).detach(), want.detach()), n
        torch.testing.assert_close(loss, F.cross_entropy(want, t.flatten()), rtol=1e-6, atol=0)
    assert {r.forward_pad for r in be.report.layers if r.name == "head"} == {3}


@pytest.mark.parametrize("rowwise", [False, True])
def test_padding_w_leaves_the_first_columns_as_an_fp8_gemm_of_any_wider_w(rowwise):
    """The twin at O = 77 (W padded with 3 zero rows inside) gives the first 77 columns of
    the FP8 GEMM of W with 3 more rows: zero rows with tensor-wise scales (W's amax is
    unchanged), any rows row-wise (each output feature has its own scale; x's is per token).
    So padding changes no logit: the numerics are the unpadded FP8 forward's, which the
    word-level LM gate passed on a 32000-token head (37th stop)."""
    torch.manual_seed(41)
    x, wt, b = torch.randn(24, 64), torch.randn(64, 77), torch.randn(77)
    got = F8.fp8_linear(x, wt, b, rowwise=rowwise)
    extra = torch.randn(64, 3) if rowwise else torch.zeros(64, 3)
    wide = F8.fp8_linear(x, torch.cat([wt, extra], 1), torch.cat([b, torch.randn(3)]),
                         rowwise=rowwise)
    assert got.shape == (24, 77) and got.stride() == (80, 1)
    assert torch.equal(got, wide[:, :77])
    assert torch.isfinite(got).all()
