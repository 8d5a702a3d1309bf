"""Every reason the passes give is true and specific: one test per reason, produced from a
real model (or, where no model can reach it, a real joint graph changed in one place), and
inference-only graphs reported apart from the training totals."""
import logging
import re

import torch
import torch.nn as nn
import torch.nn.functional as F

import hotcompile
from hotcompile import HOTConfig
from hotcompile.entry import INFERENCE
from helpers import Cross

ALL = dict(min_features=0, exclude=(), kernels="reference")


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))


# ------------------------------------------------------------------ inference graphs
def test_inference_graph_is_reported_apart(tmp_path, caplog):
    model = mlp()
    be = hotcompile.backend(HOTConfig(**ALL, dump_dir=str(tmp_path)))
    cm = torch.compile(model, backend=be)
    cm(torch.randn(8, 32)).sum().backward()
    model.eval()
    with caplog.at_level(logging.INFO, logger="hotcompile"), torch.no_grad():
        cm(torch.randn(8, 32))
    report = be.report
    assert len(report.layers) == 4
    assert len(report.training) == 2 and len(report.rewritten) == 2 and not report.exact
    assert [r.reason for r in report.inference] == [INFERENCE] * 2
    assert INFERENCE == "inference graph (compiled without grad): no backward to rewrite"
    text = str(report)
    assert "2/2 linear layers rewritten" in text, text
    assert re.search(r"inference graph \d+ \(compiled without grad\): 2 linear layers, not "
                     r"rewritten: no backward", text), text
    assert INFERENCE not in text                   # no table rows for it
    logged = [r for r in caplog.records if r.name == "hotcompile"]
    assert not [r for r in logged if r.levelno >= logging.WARNING], [r.message for r in logged]
    assert any("inference graph (compiled without grad): 2 linear layers, not rewritten: no "
               "backward" in r.message for r in logged), [r.message for r in logged]
    from hotcompile.debug.summary import load_dump, render_text
    data = load_dump(str(tmp_path))
    t = data["totals"]
    assert (t["graphs"], t["sites"], t["rewritten"]) == (1, 2, 2), t
    assert (t["inference_graphs"], t["inference_sites"]) == (1, 2), t
    assert not data["fallbacks"], data["fallbacks"]
    out = render_text(data)
    assert "2/2 linear sites rewritten in 1 training graph(s)" in out, out
    assert "1 inference graph(s) (compiled without grad): 2 linear sites, not rewritten" in out


def test_eval_only_model_gets_no_warning(caplog):
    model = mlp().eval()
    be = hotcompile.backend(HOTConfig(**ALL))
    with caplog.at_level(logging.INFO, logger="hotcompile"), torch.no_grad():
        torch.compile(model, backend=be)(torch.randn(8, 32))
    assert not be.report.training and len(be.report.inference) == 2
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "0/0 linear layers rewritten" in str(be.report)


# ------------------------------------------------------------------ helpers
def explain(model, *inputs, **cfg):
    """Records of one compile (forward only: that compiles forward and backward)."""
    torch._dynamo.reset()
    return {r.key: r for r in hotcompile.explain(model, *inputs,
                                                 config=HOTConfig(**dict(ALL, **cfg))).layers}


def why(model, *inputs, **cfg):
    return {k: r.reason for k, r in explain(model, *inputs, **cfg).items()}


def copy_graph(graph, params):
    """A copy of a joint graph (nodes, meta) and its ParamSet, to change in one place."""
    from hotcompile.passes.find import ParamSet
    g = torch.fx.Graph()
    env = {}
    g.output(g.graph_copy(graph, env))
    m = lambda nodes: {env[n] for n in nodes}                       # noqa: E731
    return g, ParamSet(m(params), {env[n]: v for n, v in params.names.items()}, params.naming,
                       {env[n]: v for n, v in params.buffers.items()},
                       None if params.frozen is None else m(params.frozen))


def joint_graph(model, *inputs, monkeypatch, dynamic=None):
    """The real joint graph the pass receives for ``model`` (before rewriting) and its
    ParamSet: an unchanged copy."""
    import hotcompile.entry as E
    got, real = {}, E.rewrite_joint_graph

    def grab(graph, config, params=None, plan=None):
        got.setdefault("graph", copy_graph(graph, params))
        return real(graph, config, params, plan)

    monkeypatch.setattr(E, "rewrite_joint_graph", grab)
    torch._dynamo.reset()
    torch.compile(model, backend=hotcompile.backend(HOTConfig(**ALL)), dynamic=dynamic)(*inputs)
    monkeypatch.setattr(E, "rewrite_joint_graph", real)
    return got["graph"]


def sites_of(graph, params, **cfg):
    from hotcompile.passes.find import find_linear_sites
    return find_linear_sites(graph, HOTConfig(**dict(ALL, **cfg)), params)


def node(graph, target, k=0):
    return [n for n in graph.nodes if n.op == "call_function" and n.target == target][k]


aten = torch.ops.aten


class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 48), nn.Linear(48, 32)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


# ------------------------------------------------------------------ roles (passes/find.py)
class WAtX(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(40, 32) / 6)

    def forward(self, x):
        return (self.w @ x.t()).t()


def test_parameter_on_the_left():
    r = why(WAtX(), torch.randn(16, 32, requires_grad=True))
    assert list(r.values()) == ["the parameter (`w`) is the left operand (W @ x): not a linear "
                                "layer's layout"], r


class BufferWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("proj", torch.randn(48, 32))
        self.fc = nn.Linear(32, 32)

    def forward(self, x):
        return F.linear(self.fc(x), self.proj)


def test_buffer_as_weight_is_called_a_buffer():
    r = why(BufferWeight(), torch.randn(16, 32))
    assert r["fc"] is None
    other = [v for k, v in r.items() if k != "fc"]
    assert other == ["weight operand is a buffer (`proj`), not a parameter: only parameters "
                     "are taken for a linear layer's weight"], r


class InputWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, x, b):
        return torch.tanh(self.fc(x)) @ b


class AfterBreak(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x):
        q, k = self.q(x), self.k(x)
        torch._dynamo.graph_break()
        return q @ k.t()


INPUT = ("weight operand is an input of this graph, not a parameter (a model input, or an "
         "activation passed across a graph break): an activation product")


def test_model_input_as_weight_is_not_called_a_parameter():
    r = why(InputWeight(), torch.randn(16, 32), torch.randn(32, 24, requires_grad=True))
    assert r.pop("fc") is None and list(r.values()) == [INPUT], r


def test_activation_across_a_graph_break_is_a_graph_input():
    r = why(AfterBreak(), torch.randn(16, 32, requires_grad=True))
    assert r.pop("q") is None and r.pop("k") is None and list(r.values()) == [INPUT], r


class ParamProduct(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w2 = nn.Parameter(torch.randn(24, 32)), nn.Parameter(torch.randn(24, 40))

    def forward(self, x):
        return x @ (self.w1.t() @ self.w2)


def test_weight_computed_from_parameters():
    r = why(ParamProduct(), torch.randn(16, 32, requires_grad=True))
    assert ("weight operand is computed in the graph from parameters only (a merged or "
            "normalised weight, W1 @ W2), not a parameter itself") in r.values(), r


class Scores(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x):
        return self.q(x) @ self.k(x).t()


def test_activation_product_in_the_graph():
    r = why(Scores(), torch.randn(16, 32, requires_grad=True))
    assert r.pop("q") is None and r.pop("k") is None
    assert list(r.values()) == ["weight operand is an activation computed in the graph, not "
                                "a parameter: an activation product (e.g. q @ k^T)"], r


class LearnedQueries(nn.Module):
    def __init__(self):
        super().__init__()
        self.queries = nn.Parameter(torch.randn(8, 32))
        self.proj = nn.Linear(32, 32)

    def forward(self, x):
        return self.proj(self.queries).sum() + x.sum()


def test_input_that_is_a_parameter():
    r = why(LearnedQueries(), torch.randn(4, 32, requires_grad=True))
    assert r == {"proj": "the input x is itself a parameter (`queries`)"}, r


class FrozenAndArgmax(nn.Module):
    def __init__(self):
        super().__init__()
        self.frozen, self.used, self.argmax_only = (nn.Linear(32, 32) for _ in range(3))
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.used(x), self.frozen(x), self.argmax_only(x).argmax(-1)


def test_no_gradient_says_which_way():
    model = FrozenAndArgmax()
    be = hotcompile.backend(HOTConfig(**ALL))
    out = torch.compile(model, backend=be)(torch.randn(8, 32))
    out[0].sum().backward()
    r = {x.key: x.reason for x in be.report.layers}
    assert r["used"] is None
    assert r["frozen"] == ("no gradient flows through this GEMM: frozen weight "
                           "(requires_grad=False) and x needs no grad"), r
    assert r["argmax_only"] == ("no gradient flows through this GEMM: its output is used by "
                                "nothing differentiated (e.g. only argmax); the weight is "
                                "trainable"), r
    assert model.argmax_only.weight.requires_grad


def test_float64_dtype():
    r = why(Two().double(), torch.randn(16, 32, dtype=torch.float64))
    assert set(r.values()) == {"dtype float64 is not supported (HOT's kernels take float32, "
                               "bfloat16 and float16)"}, r


def test_excluded_by_name_says_which_pattern():
    r = why(Two(), torch.randn(16, 32), exclude=("b",))
    assert r == {"a": None, "b": "excluded by name: matches exclude pattern 'b'"}, r
    r = why(Two(), torch.randn(16, 32), include=("a", "c*"))
    assert r == {"a": None, "b": "excluded by name: matches no include pattern "
                                 "(include=('a', 'c*'))"}, r


def test_min_features_names_both_sizes():
    r = why(Two(), torch.randn(16, 32), min_features=40)
    assert r == {"a": "features 32 < min_features=40 (in 32, out 48)",
                 "b": "features 32 < min_features=40 (in 48, out 32)"}, r


def test_misleading_reasons_of_the_issue_are_gone():
    """Cross-attention's q and kv projections are row slices of in_proj_weight (not an
    activation product); F.linear(x, w.t()) with w stored (in, out) is a trainable linear
    (not frozen): both are rewritten."""
    class T(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(32, 48) / 6)

        def forward(self, x):
            return F.linear(x, self.w.t())

    for model, inputs in ((Cross(), (torch.randn(2, 16, 32, requires_grad=True),
                                     torch.randn(2, 8, 32))),
                          (T(), (torch.randn(16, 32, requires_grad=True),))):
        for ac in (False, True):
            torch._dynamo.reset()
            be = hotcompile.backend(HOTConfig(**ALL))
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=ac):
                out = torch.compile(model, backend=be)(*inputs)
            out.float().sum().backward()
            assert be.report.layers and not be.report.exact, str(be.report)


def test_reused_graph_reason_names_the_module_it_was_compiled_for():
    from test_names import Root
    torch.manual_seed(0)
    be = hotcompile.backend(HOTConfig(**dict(ALL, include=("blocks.1.fc",))))
    torch.compile(Root(), backend=be)(torch.randn(2, 8, 32)).sum().backward()
    r = {x.key: x.reason for x in be.report.layers}
    assert r["blocks.1.fc"] == ("reuses the graph compiled for blocks.0.fc: excluded by name: "
                                "matches no include pattern (include=('blocks.1.fc',))"), r


# ------------------------------------------------------------------ pairing (passes/find.py)
class FrozenSibling(nn.Module):
    """A frozen linear reading the same x as a trainable one of the same shape: it makes no
    autograd node, so its forward GEMM carries the trainable one's seq_nr."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 24, bias=False), nn.Linear(16, 24, bias=False)
        self.b.requires_grad_(False)

    def forward(self, x):
        return torch.cat([self.a(x), self.b(x)], -1)


def test_shared_seq_nr_resolved_by_the_frozen_weight():
    torch.manual_seed(0)
    model, x = FrozenSibling(), torch.randn(13, 16)
    ref = FrozenSibling()
    ref.load_state_dict(model.state_dict())
    ref(x).square().mean().backward()
    cfg = HOTConfig(**dict(ALL, rank=16, gx_bits=8, gw_bits=8))
    be = hotcompile.backend(cfg)
    torch.compile(model, backend=be)(x).square().mean().backward()
    r = {x.key: x for x in be.report.layers}
    assert r["a"].reason is None and r["a"].gw_path.startswith("HLA"), str(be.report)
    assert r["b"].reason.startswith("no gradient flows through this GEMM: frozen weight")
    assert model.b.weight.grad is None
    err = (model.a.weight.grad - ref.a.weight.grad).norm() / ref.a.weight.grad.norm()
    assert err < 0.05, float(err)


def test_shared_seq_nr_without_frozen_information(monkeypatch):
    graph, params = joint_graph(FrozenSibling(), torch.randn(13, 16), monkeypatch=monkeypatch)
    params.frozen = None                          # a caller that does not know (direct API)
    reasons = {s.name: s.reason for s in sites_of(graph, params)}
    mm = next(n.name for n in graph.nodes if n.target == aten.mm.default
              and n.meta.get("partitioner_tag") == "is_backward")
    seq = node(graph, aten.mm.default).meta["seq_nr"]
    want = (f"cannot tell which of 2 layers (a, b) owns the g_W GEMM {mm}: they share seq_nr "
            f"{seq} (a layer that made no autograd node carries its neighbour's)")
    assert reasons == {"a": want, "b": want}, reasons


def test_pairing_reasons_on_a_changed_graph(monkeypatch):
    graph, params = joint_graph(Two(), torch.randn(16, 32, requires_grad=True),
                                monkeypatch=monkeypatch)
    assert [s.reason for s in sites_of(graph, params)] == [None, None]

    g, p = copy_graph(graph, params)                      # no seq_nr on the forward GEMM
    del node(g, aten.addmm.default, 1).meta["seq_nr"]
    assert sites_of(g, p)[1].reason == ("cannot confirm which g_x GEMM belongs to this layer "
                                        "(no seq_nr)")

    g, p = copy_graph(graph, params)                      # two g_W candidates, one seq_nr
    s = sites_of(g, p)[1]
    with g.inserting_after(s.gw):
        twin = g.node_copy(s.gw)
    twin.meta = dict(s.gw.meta)
    assert sites_of(g, p)[1].reason == ("cannot tell which of several g_W GEMMs belongs to "
                                        "this layer")

    g, p = copy_graph(graph, params)                      # g_W reads another gradient
    s = sites_of(g, p)[1]
    grad = s.gw.args[0].args[0]
    with g.inserting_after(grad):
        other = g.call_function(aten.clone.default, (grad,))
    other.meta = dict(grad.meta)
    s.gw.args[0].replace_input_with(grad, other)
    assert sites_of(g, p)[1].reason == "g_x and g_W consume different output gradients"


def test_metadata_reasons_on_a_changed_graph(monkeypatch):
    graph, params = joint_graph(Two(), torch.randn(16, 32, requires_grad=True),
                                monkeypatch=monkeypatch)
    assert sites_of(graph, None)[0].reason == ("parameters of the compiled module unknown "
                                               "(cannot prove the weight's role)")

    g, p = copy_graph(graph, params)
    del sites_of(g, p)[1].x.meta["val"]
    assert sites_of(g, p)[1].reason == "operands are not 2-D tensors with known metadata"

    g, p = copy_graph(graph, params)
    s = sites_of(g, p)[1]
    s.grad.meta["val"] = s.grad.meta["val"].to(torch.bfloat16)
    assert sites_of(g, p)[1].reason == ("x and its output gradient differ in dtype "
                                        "(torch.float32 vs torch.bfloat16)")

    g, p = copy_graph(graph, params)
    s = sites_of(g, p)[1]
    v = s.x.meta["val"]
    with v.fake_mode:
        s.x.meta["val"] = torch.empty(v.shape, device="meta")
    assert sites_of(g, p)[1].reason == "device meta is not supported (HOT runs on cpu and cuda)"


# ------------------------------------------------------------------ passes/rewrite.py
def test_shape_check_failure_is_reported_and_the_site_stays_exact(monkeypatch):
    import hotcompile.passes.rewrite as rewrite

    def refuse(op, args, fake_mode):
        raise RuntimeError("planned op refused these shapes")

    monkeypatch.setattr(rewrite, "fake_run", refuse)
    be = hotcompile.backend(HOTConfig(**ALL))
    x = torch.randn(16, 32)
    torch.compile(Two(), backend=be)(x).sum().backward()
    assert {r.key: r.reason for r in be.report.layers} == {
        k: "shape check failed: RuntimeError: planned op refused these shapes" for k in "ab"}


def test_graph_without_fake_tensors(monkeypatch):
    import hotcompile.passes.rewrite as rewrite
    monkeypatch.setattr(rewrite, "fake_mode_of", lambda graph: None)
    be = hotcompile.backend(HOTConfig(**ALL))
    torch.compile(Two(), backend=be)(torch.randn(16, 32)).sum().backward()
    assert {r.reason for r in be.report.layers} == {
        "graph has no fake tensors to check shapes against"}


def test_cost_gate_reason(monkeypatch):
    from hotcompile.passes import cost
    monkeypatch.setattr(cost, "model_for", lambda device: cost.H100)
    be = hotcompile.backend(HOTConfig(min_features=0, exclude=(), kernels="reference"))
    torch.compile(Two(), backend=be)(torch.randn(16, 32)).sum().backward()
    for r in be.report.layers:
        exact, hot = r.predicted_ms
        assert re.fullmatch(
            r"cost gate: predicted backward (\d+\.\d{3}) ms with HOT vs (\d+\.\d{3}) ms exact "
            r"\((\d+\.\d\d)x < min_speedup 1; default mode, host time included\)", r.reason), r
        assert f"{hot:.3f} ms with HOT vs {exact:.3f} ms exact" in r.reason and exact < hot


# ------------------------------------------------------------------ token layouts (tokens.py)
def layout(model, *inputs, key):
    rec = explain(model, *inputs, rank=4)[key]
    assert rec.reason is None, rec
    return rec.layout, rec.rank


class Tokens(nn.Module):
    """(B, S, D) tokens; ``mix`` decides which op mixes rows before the probed linear."""

    def __init__(self, mix):
        super().__init__()
        self.mix, self.fc, self.out = mix, nn.Linear(32, 32), nn.Linear(32, 32)
        self.halves = nn.Linear(16, 32)

    def forward(self, x):                    # x: (B, S, 32), or (A, S, B, 32) for "between"
        h = self.fc(x)
        if self.mix == "attention":
            h = F.scaled_dot_product_attention(h[:, None], h[:, None], h[:, None])[:, 0]
        elif self.mix == "windows":          # softmax within windows of 4 tokens
            b, s, d = h.shape
            return self.out(h) + h.view(b, s // 4, 4, d).softmax(2).view(b, s, d)
        elif self.mix == "axial":            # (B, H, W, D): one op over H, another over W
            h = h.softmax(1) + h.softmax(2)
        elif self.mix == "between":          # (A, S, B, D): tokens on the middle row axis
            h = h.softmax(1)
        elif self.mix == "interleave":       # rows that are halves of the feature axis
            b, s, d = h.shape
            return self.halves(h.reshape(b * s * 2, d // 2))
        return self.out(h)


def test_layout_known_and_each_unknown_reason():
    torch.manual_seed(0)
    lay, rank = layout(Tokens("attention"), torch.randn(2, 32, 32), key="out")
    assert lay == "batch-first, 32 tokens/sequence" and rank == 4
    cases = {
        "none": ((2, 32, 32), "unknown (no op mixes tokens within a sequence (no attention "
                              "or pooling over a row axis in this graph))"),
        "windows": ((2, 32, 32), "unknown (tokens are mixed in windows smaller than the "
                                 "sequence)"),
        "axial": ((2, 8, 8, 32), "unknown (different ops mix different row axes)"),
        "between": ((2, 16, 3, 32), "unknown (the sequence axes sit between batch axes)"),
        "interleave": ((2, 16, 32), "unknown (rows interleave parts of one axis)"),
    }
    for mix, (shape, want) in cases.items():
        lay, rank = layout(Tokens(mix), torch.randn(*shape),
                           key="halves" if mix == "interleave" else "out")
        assert (lay, rank) == (want, 16), (mix, lay, rank)
    lay, rank = layout(Two(), torch.randn(16, 32), key="b")
    assert (lay, rank) == ("unknown (rows are independent samples (no sequence axis))", 16)


def test_layout_reasons_out_of_reach_of_a_model(monkeypatch):
    """Axes that could not be traced, a sequence length the graph does not give and a
    symbolic one with no axis to read it from: the labels of a real graph, changed."""
    from hotcompile.passes.find import is_forward
    from hotcompile.passes.tokens import AxisLabels
    graph, params = joint_graph(Tokens("attention"), torch.randn(2, 32, 32),
                                monkeypatch=monkeypatch)
    x = sites_of(graph, params)[1].x
    labels = AxisLabels(graph, is_forward)
    assert labels.layout(x).known
    labels.axes[x] = None
    assert labels.layout(x).describe() == "unknown (the input's axes could not be traced)"
    labels = AxisLabels(graph, is_forward)
    labels.sizes.clear()
    assert labels.layout(x).describe() == "unknown (sequence length unknown)"
    # dynamic shapes: the sequence length is symbolic and read from an axis of the graph
    graph, params = joint_graph(Tokens("attention"), torch.randn(2, 32, 32),
                                monkeypatch=monkeypatch, dynamic=True)
    x = sites_of(graph, params)[1].x
    assert not all(isinstance(d, int) for d in x.meta["val"].shape)
    labels = AxisLabels(graph, is_forward)
    lay = labels.layout(x)
    assert lay.known and lay.source is not None, lay
    labels._axis_source = lambda x, target: (None, None)
    assert labels.layout(x).describe() == ("unknown (dynamic sequence length with no axis to "
                                           "read it from)")
