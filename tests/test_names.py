"""Layer names: the FQNs of the user's own module (``named_modules()``), whatever the graph
breaks; the same names in include/exclude, the report, dumps and the LQS file."""
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

import hotcompile
from hotcompile import HOTConfig
from hotcompile.entry import JointPass
from hotcompile.passes.find import Naming
from hotcompile.debug.report import Report
from helpers import Cross

ALL = dict(min_features=0, exclude=(), exact_gx=(), kernels="reference")


class Attn(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        return self.proj(F.scaled_dot_product_attention(q, k, v))


class Child(nn.Module):
    """A block with a graph break in its own forward: Dynamo compiles the part after the
    break in the child's frame (``L['self']`` is the child) and reuses it for its siblings."""

    def __init__(self, d=32):
        super().__init__()
        self.attn, self.fc = Attn(d), nn.Linear(d, d)

    def forward(self, x):
        x = x + self.attn(x)
        torch._dynamo.graph_break()
        return x + self.fc(x)


class Root(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.blocks = nn.ModuleList([Child(d), Child(d)])
        self.head = nn.Linear(d, d)

    def forward(self, x):
        x = self.blocks[0](x)       # unrolled: a graph break inside a loop would leave the
        x = self.blocks[1](x)       # whole root frame to eager, head included
        return self.head(x)


def linears(model):
    return {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}


def step(model, x, config, compile_=None):
    be = hotcompile.backend(config)
    cm = compile_(model, be) if compile_ else torch.compile(model, backend=be)
    cm(x).float().square().mean().backward()
    return be.report


def test_graph_break_inside_a_child_keeps_the_root_fqns():
    torch.manual_seed(0)
    model = Root()
    # x needs no grad: blocks.0's attention graph (no g_x for qkv) is not blocks.1's
    report = step(model, torch.randn(2, 8, 32), HOTConfig(**ALL))
    keys = [r.key for r in report.layers]
    assert len(keys) == len(set(keys)), keys                 # unique rows
    assert set(keys) == linears(model), str(report)           # every layer, by its own FQN
    assert {r.name for r in report.layers} == linears(model)
    # blocks.1's code after the break is the graph compiled in blocks.0's frame: said so
    shared = {r.key: r.compiled_for for r in report.layers if r.compiled_for}
    assert shared == {"blocks.1.fc": "blocks.0.fc"}, str(report)
    assert "blocks.1.fc runs the code compiled for blocks.0.fc" in str(report)


def test_include_copied_from_named_modules_matches():
    torch.manual_seed(0)
    model = Root()
    want = ("blocks.0.fc", "blocks.1.attn.proj")
    assert set(want) <= {n for n, _ in model.named_modules()}
    report = step(model, torch.randn(2, 8, 32), HOTConfig(**dict(ALL, include=want)))
    rewritten = {r.key for r in report.rewritten}
    # blocks.1.fc runs blocks.0.fc's graph: rewritten with it, and the report says so
    assert rewritten == set(want) | {"blocks.1.fc"}, str(report)
    note = [n for n in report.notes if n.startswith("blocks.1.fc runs rewritten")]
    assert note and "graph compiled for blocks.0.fc" in note[0], report.notes
    for r in report.exact:
        if r.key != "blocks.1.fc":
            assert r.reason.startswith("excluded by name"), (r.key, r.reason)


def test_exclude_glob_with_root_prefix():
    torch.manual_seed(0)
    report = step(Root(), torch.randn(2, 8, 32),
                  HOTConfig(**dict(ALL, exclude=("blocks.*.attn.*",))))
    for r in report.layers:
        assert (r.reason is not None) == (".attn." in r.key), (r.key, r.reason)


def test_module_compile_and_explain_find_the_root():
    torch.manual_seed(0)
    model = Root()
    report = step(model, torch.randn(2, 8, 32), HOTConfig(**ALL),
                  compile_=lambda m, be: (m.compile(backend=be), m)[1])
    assert {r.key for r in report.layers} == linears(model), str(report)
    torch._dynamo.reset()
    rep = hotcompile.explain(model, torch.randn(2, 8, 32), config=HOTConfig(**ALL))
    assert {r.key for r in rep.layers} == linears(model), str(rep)


def test_multihead_attention_projections_have_distinct_names():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    report = step(layer, torch.randn(2, 16, 32, requires_grad=True), HOTConfig(**ALL))
    assert [r.key for r in report.layers] == ["self_attn.in_proj", "self_attn.out_proj",
                                              "linear1", "linear2"], str(report)
    assert {"self_attn.in_proj_weight", "self_attn.out_proj.weight"} <= \
        {n for n, _ in layer.named_parameters()}


def test_cross_attention_slices_of_in_proj_are_named_by_rows():
    torch.manual_seed(0)
    be = hotcompile.backend(HOTConfig(**dict(ALL, exclude=("attn.out_proj",))))
    cm = torch.compile(Cross(), backend=be)
    cm(torch.randn(2, 16, 32, requires_grad=True), torch.randn(2, 8, 32)).sum().backward()
    why = {r.key: r.reason for r in be.report.layers}
    assert set(why) == {"attn.in_proj[0:32]", "attn.in_proj[32:96]", "attn.out_proj"}, why
    assert why["attn.in_proj[0:32]"] is None and why["attn.in_proj[32:96]"] is None, why
    assert why["attn.out_proj"].startswith("excluded by name"), why
    torch._dynamo.reset()
    be = hotcompile.backend(HOTConfig(**dict(ALL, include=("attn.in_proj",))))
    torch.compile(Cross(), backend=be)(torch.randn(2, 16, 32, requires_grad=True),
                                       torch.randn(2, 8, 32)).sum().backward()
    assert {r.key for r in be.report.rewritten} == {"attn.in_proj[0:32]", "attn.in_proj[32:96]"}


class TiedLM(nn.Module):
    def __init__(self, vocab=64, d=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.fc = nn.Linear(d, d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.emb.weight

    def forward(self, idx):
        return self.lm_head(self.fc(self.emb(idx)))


def test_tied_head_is_named_after_the_calling_module_and_keeps_its_gx_by_default():
    """A head tied to the embedding is named ``lm_head`` (not after the weight's first
    alias), so the default ``exact_gx`` finds it: its g_W under HOT, its g_x exact."""
    torch.manual_seed(0)
    model = TiedLM()
    assert [n for n, _ in model.named_parameters()][0] == "emb.weight"   # the first alias
    be = hotcompile.backend(HOTConfig(min_features=0, kernels="reference"))
    torch.compile(model, backend=be)(torch.randint(0, 64, (2, 16))).sum().backward()
    rec = {r.key: r for r in be.report.layers}
    assert set(rec) == {"fc", "lm_head"}, rec
    assert rec["lm_head"].reason is None and rec["fc"].reason is None, str(be.report)
    assert "exact_gx pattern 'lm_head'" in rec["lm_head"].gx_path, rec["lm_head"].gx_path
    assert "HLA" in rec["lm_head"].gw_path and "HQ" in rec["fc"].gx_path, str(be.report)


def test_compiled_function_keeps_dynamo_names():
    """No module was compiled: names are relative to the compiled frame's locals."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    w = nn.Parameter(torch.randn(32, 32))

    def fn(x, w):
        return F.linear(mlp(x), w)

    be = hotcompile.backend(HOTConfig(**ALL))
    torch.compile(fn, backend=be)(torch.randn(8, 32), w).sum().backward()
    assert [r.key for r in be.report.layers] == ["0", "2", "w"], str(be.report)


def test_lqs_file_and_dump_use_the_fqns(tmp_path):
    torch.manual_seed(0)
    path, dump = tmp_path / "lqs.json", tmp_path / "dump"
    cfg = HOTConfig(**dict(ALL, gx_scale="lqs", lqs_calibration_steps=1, lqs_file=str(path),
                           dump_dir=str(dump)))
    model = Root()
    cm = torch.compile(model, backend=hotcompile.backend(cfg))
    for _ in range(2):
        cm(torch.randn(2, 8, 32)).square().mean().backward()
    # every HQ site (blocks.0's qkv gets no g_x: its input needs no grad) by its FQN;
    # blocks.1.fc shares blocks.0.fc's compiled graph and its entry
    assert set(json.loads(path.read_text())) == linears(model) - {"blocks.0.attn.qkv",
                                                                "blocks.1.fc"}
    from hotcompile.debug import dump as dumps
    from hotcompile.debug.summary import load_dump
    dumps.flush()                                  # LQS choices made while training
    sites = [s for g in load_dump(str(dump))["graphs"] for s in g["sites"]]
    assert {s["key"] for s in sites} == linears(model)
    # the dump finds each site's LQS entry by its run-time key
    hq = {s["key"]: s["lqs_source"] for s in sites if s["gx_path"].startswith("HQ")}
    assert set(hq) == set(json.loads(path.read_text())) | {"blocks.1.fc"}, hq
    assert set(hq.values()) == {"calibrated"}, hq


def test_names_are_part_of_the_pass_uuid():
    a = JointPass(HOTConfig(), Report(), 0, {0}, naming=Naming("M", (("L:self", "blocks.0"),)))
    b = JointPass(HOTConfig(), Report(), 0, {0}, naming=Naming("M", (("L:self", "blocks.1"),)))
    assert a.uuid() != b.uuid()
