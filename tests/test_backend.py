"""The backend end to end on CPU: sites found, ops in the backward graph, saved bytes, fallbacks."""
import operator
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import hotcompile
from hotcompile import HOTConfig
from helpers import HOT_OPS, MLP, Block, capture_graphs, count_ops, is_bw, rel

ALL = HOTConfig(min_features=0, exclude=())


def run_step(model, x, config=ALL, autocast=None):
    be = hotcompile.backend(config)
    cm = torch.compile(model, backend=be)
    with capture_graphs() as graphs:
        ctx = torch.autocast("cpu", dtype=autocast) if autocast else torch.autocast("cpu", enabled=False)
        with ctx:
            out = cm(x)
        out.float().square().mean().backward()
    bw = [g for g in graphs if is_bw(g)]
    fw = [g for g in graphs if not is_bw(g)]
    return be.report, fw, bw


def test_entry_point_fresh_interpreter():
    code = ("import sys, torch; m = torch.compile(torch.nn.Linear(64, 64), backend='hot'); "
            "m(torch.randn(32, 64, requires_grad=True)).sum().backward(); "
            "assert 'hotcompile' in sys.modules; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("ok")


def test_mlp_every_linear_rewritten():
    torch.manual_seed(0)
    report, fw, bw = run_step(MLP(), torch.randn(64, 64))          # input needs no grad
    assert [r.name for r in report.rewritten] == ["fc1", "fc2"]
    assert report.layers[0].gx_path.startswith("-")                # no g_x for the first layer
    assert len(bw) == 1 and len(fw) == 1
    assert count_ops(bw[0], HOT_OPS["hla"]) == 2
    assert count_ops(bw[0], HOT_OPS["hq"]) == 1
    assert count_ops(fw[0], HOT_OPS["abc"]) == 2
    assert count_ops(bw[0], torch.ops.aten.mm.default) == 0        # no exact backward GEMM left


@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float16])
def test_transformer_block_every_linear_rewritten(dtype):
    torch.manual_seed(0)
    x = torch.randn(2, 24, 64, requires_grad=True)
    report, fw, bw = run_step(Block(), x, autocast=dtype)
    assert sorted(r.name for r in report.rewritten) == ["fc1", "fc2", "proj", "qkv"]
    assert all(r.gx_path.startswith("HQ") and r.gw_path.startswith("HLA") for r in report.layers)
    assert count_ops(bw[0], HOT_OPS["hq"]) == 4
    assert count_ops(bw[0], HOT_OPS["hla"]) == 4
    # proj's input (the attention output) is saved for SDPA's backward anyway: compressed in bwd
    where = {r.name: r.abc.split(" ")[0] for r in report.layers}
    assert where == {"qkv": "forward", "proj": "backward", "fc1": "forward", "fc2": "forward"}
    assert count_ops(fw[0], HOT_OPS["abc"]) == 3 and count_ops(bw[0], HOT_OPS["abc"]) == 1
    want = str(dtype or torch.float32).replace("torch.", "")
    assert {r.dtype for r in report.layers} == {want}
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("form", ["linear", "functional", "matmul_t"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(48, 32), (3, 16, 32)])
def test_linear_forms(form, bias, shape):
    torch.manual_seed(1)
    lin = torch.nn.Linear(32, 40, bias=bias)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            if form == "linear":
                return self.lin(x)
            if form == "functional":
                return F.linear(x, self.lin.weight, self.lin.bias)
            y = x @ self.lin.weight.t()
            return y + self.lin.bias if bias else y

    x = torch.randn(*shape, requires_grad=True)
    report, fw, bw = run_step(M(), x, HOTConfig(min_features=0, exclude=(), gx_bits=8, rank=16))
    assert len(report.rewritten) == 1, str(report)
    assert count_ops(bw[0], HOT_OPS["hq"]) == 1 and count_ops(bw[0], HOT_OPS["hla"]) == 1
    # 8-bit, full rank: close to the exact gradients
    gx, gw = x.grad.clone(), lin.weight.grad.clone()
    x.grad = None
    lin.weight.grad = None
    M()(x).float().square().mean().backward()
    assert rel(gx, x.grad) < 0.03 and rel(gw, lin.weight.grad) < 0.03


def test_ineligible_sites_stay_exact_with_reasons():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.frozen = torch.nn.Linear(32, 32)
            self.frozen.weight.requires_grad_(False)
            self.small = torch.nn.Linear(32, 8)
            self.head = torch.nn.Linear(32, 32)
            self.ok = torch.nn.Linear(32, 32)

        def forward(self, x):
            h = self.ok(self.frozen(x))
            return self.small(h) .sum() + self.head(h).sum() + (h @ h.t()).sum()

    cfg = HOTConfig(min_features=16, exclude=("head",))
    report, fw, bw = run_step(M(), torch.randn(16, 32), cfg)
    why = {r.name: r.reason for r in report.layers}
    assert why["ok"] is None
    assert "frozen" in why["frozen"]
    assert "min_features" in why["small"]
    assert "excluded" in why["head"]
    assert any("activation product" in (r or "") for r in why.values()), why
    assert count_ops(bw[0], HOT_OPS["hla"]) == 1
    text = str(report)
    assert "frozen" in text and "min_features=16" in text


def _saved_activation_bytes(model, x, backend):
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved.append(t.numel() * t.element_size())
        return t

    cm = torch.compile(model, backend=backend)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = cm(x)
    out.sum().backward()
    return sum(saved)


def test_forward_saves_compressed_buffer():
    """Linear-only stack: every saved activation is a linear input (fp32 -> int8: ~4x)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 512),
                                torch.nn.Linear(512, 256))
    x = torch.randn(512, 256)
    base = _saved_activation_bytes(model, x, "inductor")
    torch._dynamo.reset()
    hot = _saved_activation_bytes(model, x, hotcompile.backend(HOTConfig(min_features=0)))
    assert base == 512 * (256 + 256 + 512) * 4
    assert base / hot >= 3.5, (base, hot)
    assert base / hot > 3.9       # rows of a 2-D batch are independent samples: full rank, int8 = 4x


def test_block_saved_bytes_drop():
    torch.manual_seed(0)
    x = torch.randn(4, 64, 64)
    base = _saved_activation_bytes(Block(), x, "inductor")
    torch._dynamo.reset()
    hot = _saved_activation_bytes(Block(), x, hotcompile.backend(ALL))
    assert hot < 0.75 * base, (base, hot)


def test_dynamic_shapes_and_no_graph_break():
    torch.manual_seed(0)
    model = Block()
    be = hotcompile.backend(ALL)
    cm = torch.compile(model, backend=be, dynamic=True)
    for t in (24, 40, 17):
        x = torch.randn(2, t, 64, requires_grad=True)
        cm(x).sum().backward()
        assert x.grad.shape == x.shape and torch.isfinite(x.grad).all()
    assert len(be.report.rewritten) == 4
    expl = torch._dynamo.explain(model)(torch.randn(2, 24, 64))
    assert expl.graph_break_count == 0


def test_pass_failure_falls_back(monkeypatch):
    import hotcompile.entry as B

    def boom(graph, config, *args):
        raise RuntimeError("synthetic failure")
    monkeypatch.setattr(B, "rewrite_joint_graph", boom)
    torch.manual_seed(0)
    report, fw, bw = run_step(MLP(), torch.randn(32, 64))
    assert report.layers == [] and "synthetic failure" in report.errors[0]
    assert count_ops(bw[0], HOT_OPS["hla"]) == 0


def test_explain_reports_without_side_effects():
    torch.manual_seed(0)
    model = Block()
    x = torch.randn(2, 16, 64)
    state = torch.get_rng_state()
    report = hotcompile.explain(model, x, config=ALL)
    assert torch.equal(state, torch.get_rng_state())
    assert all(p.grad is None for p in model.parameters())
    assert len(report.layers) == 4 and len(report.rewritten) == 4
    r = report.layers[0]
    assert (r.L, r.I) == (32, 64) and r.saved_before == 32 * 64 * 4
    default = hotcompile.explain(model, x)          # default min_features=256: all exact
    assert len(default.rewritten) == 0 and "min_features=256" in str(default)


class BNDrop(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(64, 64)
        self.bn = torch.nn.BatchNorm1d(64)
        self.drop = torch.nn.Dropout(0.3)
        self.fc2 = torch.nn.Linear(64, 64)

    def forward(self, x):
        return self.fc2(self.drop(self.bn(self.fc1(x))))


@pytest.mark.parametrize("context", ["plain", "no_grad", "inference_mode"])
def test_explain_leaves_buffers_params_rng_and_optimizer_alone(context):
    """BatchNorm in train mode and dropout: explain() must not move running statistics,
    ``num_batches_tracked``, parameters, RNG or optimizer state, under any grad context."""
    torch.manual_seed(0)
    model = BNDrop().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(32, 64)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt_before = {k: {n: t.clone() if torch.is_tensor(t) else t for n, t in st.items()}
                  for k, st in opt.state.items()}
    x = torch.randn(32, 64)
    rng = torch.get_rng_state()
    ctx = {"plain": torch.enable_grad, "no_grad": torch.no_grad,
           "inference_mode": torch.inference_mode}[context]
    with ctx():
        report = hotcompile.explain(model, x, config=ALL)
    assert len(report.rewritten) == 2, str(report)
    after = model.state_dict()
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k
    assert int(after["bn.num_batches_tracked"]) == 1
    assert torch.equal(rng, torch.get_rng_state())
    assert all(p.grad is None for p in model.parameters())
    for k, st in opt.state.items():
        for n, t in st.items():
            assert torch.equal(t, opt_before[k][n]) if torch.is_tensor(t) else t == opt_before[k][n]


def test_seeded_runs_reproduce():
    def grads():
        torch.manual_seed(0)
        model = MLP()
        torch.compile(model, backend=hotcompile.backend(ALL))(torch.randn(32, 64)).sum().backward()
        return [p.grad.clone() for p in model.parameters()]
    a = grads()
    torch._dynamo.reset()
    b = grads()
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_activation_checkpointing_composes():
    """Inside torch.utils.checkpoint regions the compression keeps the region's policy."""
    from torch.utils.checkpoint import checkpoint

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.b1, self.b2 = Block(), Block()

        def forward(self, x):
            return self.b2(checkpoint(self.b1, x, use_reentrant=False))

    torch.manual_seed(0)
    m, x = M(), torch.randn(2, 32, 64, requires_grad=True)
    report, fw, bw = run_step(m, x, HOTConfig(min_features=0, exclude=(), gx_bits=8, rank=16))
    assert len(report.rewritten) == 8
    assert sorted(r.name for r in report.layers)[:2] == ["b1.fc1", "b1.fc2"]
    grads = [p.grad.clone() for p in m.parameters()]
    gx = x.grad.clone()
    m.zero_grad()
    x.grad = None
    m(x).square().mean().backward()
    assert rel(gx, x.grad) < 0.03
    assert max(rel(a, p.grad) for a, p in zip(grads, m.parameters())) < 0.1


def test_weight_stored_in_by_out_is_rewritten():
    """transformers' Conv1D: y = addmm(b, x, W) with W of shape (in, out)."""
    class Conv1D(torch.nn.Module):
        def __init__(self, nin, nout):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(nin, nout) * nin ** -0.5)
            self.bias = torch.nn.Parameter(torch.zeros(nout))

        def forward(self, x):
            return torch.addmm(self.bias, x.view(-1, x.shape[-1]), self.weight).view(
                *x.shape[:-1], -1)

    torch.manual_seed(0)
    m = torch.nn.Sequential(Conv1D(32, 48), torch.nn.GELU(), Conv1D(48, 40))
    x = torch.randn(2, 24, 32, requires_grad=True)
    report, fw, bw = run_step(m, x, HOTConfig(min_features=0, exclude=(), gx_bits=8, rank=16))
    assert [(r.I, r.O) for r in report.rewritten] == [(32, 48), (48, 40)]
    assert count_ops(bw[0], HOT_OPS["hla"]) == 2 and count_ops(bw[0], HOT_OPS["hq"]) == 2
    grads = [p.grad.clone() for p in m.parameters()]
    gx = x.grad.clone()
    m.zero_grad()
    x.grad = None
    m(x).float().square().mean().backward()
    assert rel(gx, x.grad) < 0.03
    assert all(rel(a, p.grad) < 0.05 for a, p in zip(grads, m.parameters()) if p.dim() == 2)


def test_the_lazy_backward_compiles_inside_the_launch_analysis_memo(monkeypatch):
    """AOTAutograd compiles the backward on its first call, after the backend returned: its
    Inductor compile must still run inside the memo of Triton's mutation analysis
    (``passes/kernel_access``), which the spliced launches of a backward lean on."""
    from hotcompile import entry as E
    from hotcompile.passes import kernel_access as KA
    depths = []
    real = E.compile_fx_inner

    def spy(*a, **k):
        depths.append(KA._DEPTH)
        return real(*a, **k)

    monkeypatch.setattr(E, "compile_fx_inner", spy)
    torch._dynamo.reset()
    with torch._functorch.config.patch(enable_autograd_cache=False), \
            torch._inductor.config.patch(fx_graph_cache=False):
        report, fw, bw = run_step(MLP(), torch.randn(64, 64))
    assert len(report.rewritten) == 2
    assert len(depths) == 2 and all(d >= 1 for d in depths), depths     # forward, backward
    assert KA._DEPTH == 0


@pytest.mark.parametrize("env", [None, "1"])
def test_graphs_compile_without_dynamic_rblock_scaling_unless_the_environment_asks(
        monkeypatch, env):
    """Forward and backward compile with ``dynamic_scale_rblock`` off (``inductor_settings.graph_patches``:
    a warm-cache process otherwise recompiles HOT's heavier reductions on its first step),
    and an explicit ``TORCHINDUCTOR_DYNAMIC_SCALE_RBLOCK`` in the environment still decides."""
    from hotcompile import entry as E
    seen = []
    real = E.compile_fx_inner

    def spy(*a, **k):
        seen.append(torch._inductor.config.dynamic_scale_rblock)
        return real(*a, **k)

    monkeypatch.setattr(E, "compile_fx_inner", spy)
    if env is None:
        monkeypatch.delenv("TORCHINDUCTOR_DYNAMIC_SCALE_RBLOCK", raising=False)
    else:
        monkeypatch.setenv("TORCHINDUCTOR_DYNAMIC_SCALE_RBLOCK", env)
    torch._dynamo.reset()
    with torch._functorch.config.patch(enable_autograd_cache=False), \
            torch._inductor.config.patch(fx_graph_cache=False, dynamic_scale_rblock=True):
        report, _, _ = run_step(MLP(), torch.randn(64, 64))
    assert len(report.rewritten) == 2
    assert seen == ([False, False] if env is None else [True, True]), seen   # forward, backward


def _autocast_step(model: str):
    """One compiled bf16-autocast training step of the MLP or the block under ``ALL`` (fp32
    parameters): (parameter grads, captured graphs, report)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = MLP() if model == "mlp" else Block(d=64, heads=4)
    x = torch.randn(64, 64) if model == "mlp" else torch.randn(2, 32, 64)
    be = hotcompile.backend(ALL)
    cm = torch.compile(m, backend=be)
    with capture_graphs() as graphs:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = cm(x)
        torch.manual_seed(1)
        out.float().square().mean().backward()
    return {k: p.grad for k, p in m.named_parameters()}, graphs, be.report


@pytest.mark.parametrize("model", ["mlp", "block"])
def test_fp32_parameter_grads_come_from_the_gemm_without_a_cast(monkeypatch, model):
    """Under bf16 autocast a rewritten g_W is only cast to its fp32 parameter's gradient:
    the op writes fp32 itself (``passes/grad_cast.py``) and no cast of it is left in the
    backward. The gradient is the unrounded GEMM result: rounded to bf16 it is bit-equal
    to the graph's without the fold, and every other gradient is bit-equal."""
    import hotcompile.passes.rewrite as RW

    def step(fold):
        if not fold:
            monkeypatch.setattr(RW, "fold_gw_cast", lambda *a, **k: False)
        grads, graphs, report = _autocast_step(model)
        bw = [g for g in graphs if is_bw(g)]
        paths = [r.gw_path for r in report.layers]
        assert paths and all(p.startswith("HLA") and p.endswith(" -> fp32") == fold
                             for p in paths), paths          # the report says which write fp32
        return grads, bw

    folded, bw = step(True)
    plain, bw_plain = step(False)
    gw_ops = (HOT_OPS["hla"], HOT_OPS["unit"])
    ops = [n for g in bw for n in g.nodes if n.target in gw_ops]
    assert ops and all(n.kwargs.get("gw_fp32") for n in ops), [n.kwargs for n in ops]
    assert not any(n.kwargs.get("gw_fp32") for g in bw_plain for n in g.nodes
                   if n.target in gw_ops)

    def casts(graphs):   # fp32 casts whose input is (a view of) a HOT op's g_W
        out = 0
        for g in graphs:
            for n in g.nodes:
                if n.target is torch.ops.prims.convert_element_type.default and \
                        n.args[1] == torch.float32:
                    src = n.args[0]
                    while src.op == "call_function" and src.target in (
                            torch.ops.aten.permute.default, torch.ops.aten.view.default,
                            torch.ops.aten.reshape.default):
                        src = src.args[0]
                    if src.target is operator.getitem and src.args[1] == 1:
                        src = src.args[0]
                    out += src.target in gw_ops
        return out
    assert casts(bw) == 0 and casts(bw_plain) == len(ops)
    for k in folded:
        a, b = folded[k], plain[k]
        assert a.dtype == b.dtype == torch.float32, k
        if k.endswith("weight") and a.dim() == 2:
            assert torch.equal(a.bfloat16().float(), b), k
            assert not torch.equal(a, b), k        # the unrounded result
        else:
            assert torch.equal(a, b), k


@pytest.mark.parametrize("model", ["mlp", "block"])
def test_autocast_weight_copies_come_with_their_column_maxima(monkeypatch, model):
    """Under bf16 autocast each rewritten site's W is autocast's copy of an fp32 parameter:
    the pass puts ``hot::weight_cast`` in the cast's place (the copy and its column maxima
    in one kernel on the GPU, ``passes/weight_cast.py``), no cast of a weight is left in the
    forward, and each site's backward op gets the maxima. The copy is the cast's bit for
    bit, so every gradient is bit-equal to the graph's without it. (Only where the site's op
    will be spliced, i.e. on CUDA: the CPU sites stand in for those here.)"""
    import hotcompile.passes.rewrite as RW
    import hotcompile.passes.weight_cast as WC
    monkeypatch.setattr(RW, "will_splice", lambda op, config: True)
    # as on an H100: the sites' g_x takes W as scaled e4m3, which the forward then writes
    monkeypatch.setattr(WC, "unit_w_is_e4m3", lambda *a: True)

    def step(own):
        if not own:
            monkeypatch.setattr(RW, "own_weight_casts", lambda *a, **k: [])
        return _autocast_step(model)

    owned, graphs, report = step(True)
    plain, graphs_plain, _ = step(False)
    fw = [g for g in graphs if not is_bw(g)]
    casts = [n for g in fw for n in g.nodes if n.target is torch.ops.hot.weight_cast.default]
    operands = [n for g in graphs for n in g.nodes      # the partitioner may run it in either
                if n.target is torch.ops.hot.weight_operands.default]
    n_sites = len(report.rewritten)
    assert n_sites and 0 < len(casts) <= n_sites and len(operands) == len(casts)
    assert all(n.args[3] == "bf16" and n.args[4] for n in operands)   # HQ's W, no FP8 forward
    units = [n for g in graphs for n in g.nodes if n.target is HOT_OPS["unit"]]
    assert units and all(n.kwargs.get("w_q") is not None for n in units)
    hq = [r for r in report.rewritten if r.gx_path.startswith("HQ")]      # one op per site
    assert hq and all(r.w_operand == "hot::weight_cast copy" for r in hq)

    def weight_casts(gs):     # autocast casts of an fp32 2-D placeholder to bf16
        return sum(1 for g in gs for n in g.nodes
                   if n.target is torch.ops.prims.convert_element_type.default
                   and n.args[1] == torch.bfloat16 and n.args[0].op == "placeholder"
                   and n.args[0].meta["val"].dim() == 2
                   and n.args[0].meta["val"].dtype == torch.float32)
    assert weight_casts(fw) + len(casts) == weight_casts(
        [g for g in graphs_plain if not is_bw(g)])
    assert not any(n.target is torch.ops.hot.weight_cast.default for g in graphs_plain
                   for n in g.nodes)
    for k in owned:
        assert torch.equal(owned[k], plain[k]), k


def test_weight_casts_stay_autocasts_where_the_op_is_not_spliced():
    """A site whose op stays opaque (here: CPU) keeps autocast's cast: the opaque op reads
    the copy in backward, where the partitioner recomputes a cast but would keep our op's
    2-byte copy."""
    torch._dynamo.reset()
    m = Block(d=64, heads=4)
    be = hotcompile.backend(ALL)
    cm = torch.compile(m, backend=be)
    with capture_graphs() as graphs:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = cm(torch.randn(2, 32, 64))
        out.float().square().mean().backward()
    assert be.report.rewritten
    assert not any(n.target is torch.ops.hot.weight_cast.default for g in graphs for n in g.nodes)
    assert all(r.w_operand == "" for r in be.report.rewritten)


def _mlp_grads(x, config):
    """(report, backward graphs, (x's, fc1's and fc2's weight gradients)) of one compiled
    MLP step from the same initial weights."""
    torch._dynamo.reset()
    torch.manual_seed(1)
    m = MLP()
    report, fw, bw = run_step(m, x, config)
    g = (x.grad.clone(), m.fc1.weight.grad.clone(), m.fc2.weight.grad.clone())
    x.grad = None
    return report, bw, g


def test_exact_gx_keeps_a_layers_input_gradient_and_rewrites_its_weight_gradient():
    """``exact_gx``: the named layer's g_x GEMM stays in the graph as Inductor would compile
    it (so every gradient below it is the exact one), while its g_W is HLA's and its x is
    saved compressed; the report says why its g_x is exact."""
    torch.manual_seed(0)
    x = torch.randn(4, 32, 64, requires_grad=True)
    grads = lambda config: _mlp_grads(x, config)  # noqa: E731

    cfg = dict(min_features=0, exclude=(), include=("fc2",))
    report, bw, (gx, gw1, gw2) = grads(HOTConfig(**cfg, exact_gx=("fc2",)))
    _, _, (gx_e, gw1_e, gw2_e) = grads(HOTConfig(min_features=0, exclude=("fc1", "fc2")))
    _, _, (gx_h, _, gw2_h) = grads(HOTConfig(**cfg))
    rec = {r.name: r for r in report.layers}
    assert rec["fc2"].rewritten and rec["fc2"].gx_path == "exact (exact_gx pattern 'fc2')"
    assert rec["fc2"].gw_path.startswith("HLA") and rec["fc2"].abc != "-"
    assert count_ops(bw[0], HOT_OPS["hla"]) == 1 and count_ops(bw[0], HOT_OPS["hq"]) == 0
    # g_x of fc2 exact: fc1's weight gradient and x's gradient are the exact ones
    assert torch.equal(gx, gx_e) and torch.equal(gw1, gw1_e)
    assert not torch.equal(gx_h, gx_e)         # (with HQ on fc2 they are not)
    # fc2's g_W is HLA's (its own Philox key, so not bit-equal to the whole site's), not
    # the exact one, and as close to it as the whole site's
    assert not torch.equal(gw2, gw2_e) and rel(gw2, gw2_e) < 2 * rel(gw2_h, gw2_e) + 1e-3
    with pytest.raises(ValueError, match="exact_gx"):
        HOTConfig(exact_gx="head")


def test_exact_gx_gemm_e4m3_puts_the_kept_g_x_on_fp8():
    """``exact_gx_gemm="e4m3"``: the exact_gx layer's g_x mm and its g_W become one
    ``hot::e4m3_gx_backward`` (on CPU its reference twin: g and W rounded to e4m3, no
    Hadamard); g_x within FP8's error of the exact one, g_W HLA's as before; the report
    says so; a bad value names the field."""
    torch.manual_seed(0)
    x = torch.randn(4, 32, 64, requires_grad=True)
    grads = lambda config: _mlp_grads(x, config)  # noqa: E731

    cfg = dict(min_features=0, exclude=(), include=("fc2",), exact_gx=("fc2",))
    report, bw, (gx, gw1, gw2) = grads(HOTConfig(**cfg, exact_gx_gemm="e4m3"))
    _, bw_e, (gx_e, gw1_e, gw2_e) = grads(HOTConfig(**cfg))
    rec = {r.name: r for r in report.layers}
    assert rec["fc2"].gx_path == "FP8 e4m3 g/W, no Hadamard (exact_gx pattern 'fc2')"
    assert count_ops(bw[0], torch.ops.hot.e4m3_gx_backward.default) == 1
    assert count_ops(bw[0], HOT_OPS["hla"]) == 0 and count_ops(bw[0], HOT_OPS["hq"]) == 0
    mms = lambda g: sum(n.target is torch.ops.aten.mm.default for n in g.nodes)  # noqa: E731
    assert mms(bw[0]) == mms(bw_e[0]) - 1            # fc2's g_x mm is gone
    assert not torch.equal(gx, gx_e) and rel(gx, gx_e) < 0.06
    assert rel(gw1, gw1_e) < 0.06 and rel(gw2, gw2_e) < 0.06
    with pytest.raises(ValueError, match="exact_gx_gemm"):
        HOTConfig(exact_gx_gemm="fp8")


def test_e4m3_gx_refusal_gives_the_true_reason(monkeypatch):
    """The pass asks ``_e4m3_gx_refusal`` before it puts an exact_gx site's g_x on FP8, and
    the report carries its answer: no reason on a CPU (the reference twin) or where
    ``formats.e4m3_gx_fused`` holds; otherwise the option, the block, dynamic sizes or the
    rule's conditions, each named."""
    from types import SimpleNamespace
    from torch._subclasses.fake_tensor import FakeTensorMode
    from hotcompile.passes import rewrite

    def site(device, O=64, I=32, exact=True):
        with FakeTensorMode(allow_non_fake_inputs=True):
            g = torch.empty(16, O, device=device, dtype=torch.bfloat16)
        return SimpleNamespace(gx_exact=object() if exact else None, O=O, I=I,
                               grad=SimpleNamespace(meta={"val": g}), gx_e4m3_refusal=None)

    asked = []
    monkeypatch.setattr(rewrite, "e4m3_gx_fused",
                        lambda dev, dt, O, I: asked.append((O, I)) or (O % 16 == 0))
    on = HOTConfig(exact_gx_gemm="e4m3")
    assert "bf16" in rewrite._e4m3_gx_refusal(site("cuda"), HOTConfig())
    assert "not an exact_gx site" in rewrite._e4m3_gx_refusal(site("cuda", exact=False), on)
    assert rewrite._e4m3_gx_refusal(site("cpu"), on) is None and not asked
    assert "block=8" in rewrite._e4m3_gx_refusal(
        site("cuda"), HOTConfig(exact_gx_gemm="e4m3", block=8, rank=8))
    assert rewrite._e4m3_gx_refusal(site("cuda"), on) is None and asked == [(64, 32)]
    assert "multiples of 16" in rewrite._e4m3_gx_refusal(site("cuda", O=40), on)
