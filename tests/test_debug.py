"""Graph dumps (HOT_DUMP / dump_dir), report.json/.md, the .dot, and ``python -m hotcompile.debug``.

Compiles are slow on CPU: one dump of a two-graph model (a transformer block, a graph break,
a frozen output layer) is made once per module and every check reads it.
"""
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

import hotcompile
from hotcompile import HOTConfig
from hotcompile.debug import dump
from helpers import Block, capture_graphs

ALL = dict(min_features=0, exclude=("out",), rank=8)   # the frozen out layer stays exact
NODE = re.compile(r'^\s*"([^"]+)" \[(.*)\];$')
EDGE = re.compile(r'^\s*"([^"]+)" -> "([^"]+)";$')
ATTR = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


class TwoGraphs(torch.nn.Module):
    """A block, a graph break, then a frozen linear: two graphs, one exact site."""

    def __init__(self):
        super().__init__()
        self.block = Block()
        self.out = torch.nn.Linear(64, 64)
        self.out.weight.requires_grad_(False)

    def forward(self, x):
        h = self.block(x)
        torch._dynamo.graph_break()
        return self.out(h)


@pytest.fixture(scope="module")
def dumped(tmp_path_factory):
    root = tmp_path_factory.mktemp("dump")
    torch._dynamo.reset()
    torch.manual_seed(0)
    be = hotcompile.backend(HOTConfig(**ALL, dump_dir=str(root)))
    cm = torch.compile(TwoGraphs(), backend=be)
    with capture_graphs() as user_graphs:            # a user's post-grad hook must keep working
        x = torch.randn(2, 24, 64, requires_grad=True)
        cm(x).square().mean().backward()
    torch._dynamo.reset()
    report = json.loads((root / "report.json").read_text())
    return root, report, user_graphs


def leaf(site):
    return site["name"].split(".")[-1]


def parse_dot(text):
    nodes, edges = {}, []
    for line in text.splitlines():
        m = NODE.match(line)
        if m:
            nodes[m.group(1)] = dict(ATTR.findall(m.group(2)))
        m = EDGE.match(line)
        if m:
            edges.append(m.groups())
    return nodes, edges


def count_calls(text, op):
    """hot:: calls in a str(fx.Graph) dump or a print_readable dump."""
    return len(re.findall(rf"torch\.ops\.hot\.{op}\.default[\](]", text))


def test_files_per_graph_and_no_overwrite(dumped):
    root, report, _ = dumped
    assert (root / "report.json").exists() and (root / "report.md").exists()
    folders = [g["folder"] for g in report["graphs"]]
    assert len(folders) == 2 and len(set(folders)) == 2
    for f in folders:
        assert re.fullmatch(rf"graph\d{{3}}_p{os.getpid()}", f)
        names = set(os.listdir(root / f))
        assert {"joint_before.txt", "joint_after.txt", "sites.dot", "graph.json",
                "forward.txt", "backward.txt"} <= names, names
    by = {g["folder"]: {leaf(s) for s in g["sites"]} for g in report["graphs"]}
    assert sorted(by.values(), key=len) == [{"out"}, {"qkv", "proj", "fc1", "fc2"}]


def test_counts_agree_across_joint_bw_report_and_dot(dumped):
    root, report, _ = dumped
    for g in report["graphs"]:
        d = root / g["folder"]
        rewritten = [s for s in g["sites"] if s["rewritten"]]
        with_hq = [s for s in rewritten if s["gx_path"].startswith("HQ")]
        before, after = (d / "joint_before.txt").read_text(), (d / "joint_after.txt").read_text()
        bw, fw = (d / "backward.txt").read_text(), (d / "forward.txt").read_text()
        nodes, edges = parse_dot((d / "sites.dot").read_text())
        hot = [a["hot"] for a in nodes.values() if "hot" in a]
        # a site with both gradients is one linear_backward op; HQ or HLA alone otherwise
        units = len(with_hq)
        unit = "hq+hla (linear_backward)"
        assert count_calls(before, "hla_grad_weight") == count_calls(before, "linear_backward") == 0
        for text in (after, bw):
            assert count_calls(text, "linear_backward") == units
            assert count_calls(text, "hla_grad_weight") == len(rewritten) - units
            assert count_calls(text, "hq_grad_input") == 0
        assert hot.count(unit) == units and hot.count("hla") == len(rewritten) - units
        assert hot.count("hq") == 0
        n_abc = count_calls(after, "abc_compress")
        assert n_abc == hot.count("abc") == count_calls(fw, "abc_compress") + \
            count_calls(bw, "abc_compress")
        ops = g["compiled"]["backward"]["hot_ops"]
        assert ops["hla"] + ops["unit"] == len(rewritten) and ops["unit"] == units
        assert all(a in nodes and b in nodes for a, b in edges)
        # every exact site shows up, greyed, with its reason
        for s in g["sites"]:
            if not s["rewritten"]:
                assert any(a.get("exact") == s["reason"] for a in nodes.values())
        # buffers made in the forward are what the compiled backward receives
        saved = [n for n, a in nodes.items() if a.get("saved") == "true"]
        bw_inputs = {x["name"] for x in g["compiled"]["backward"]["saved"] if x["hot"]}
        assert set(saved) == bw_inputs
        assert len(saved) == 2 * count_calls(fw, "abc_compress")
        for s in rewritten:
            assert s["nodes"]["hla"] in nodes and nodes[s["nodes"]["hla"]]["site"] == s["key"]


def test_block_graph_details(dumped):
    root, report, user_graphs = dumped
    block = next(g for g in report["graphs"] if len(g["sites"]) == 4)
    assert all(s["rewritten"] for s in block["sites"])
    where = {leaf(s): s["abc"].split(" ")[0] for s in block["sites"]}
    assert where == {"qkv": "forward", "proj": "backward", "fc1": "forward", "fc2": "forward"}
    comp = block["compiled"]["backward"]
    assert 0 < comp["saved_hot_bytes"] < comp["saved_activation_bytes"]
    out = next(g for g in report["graphs"] if len(g["sites"]) == 1)["sites"][0]
    assert not out["rewritten"] and "excluded" in out["reason"]
    # the user's hook saw exactly the graphs that were dumped
    dumped_files = sum(len(g["compiled"]) for g in report["graphs"])
    assert len(user_graphs) == dumped_files == 4


def test_cost_model(dumped):
    _, report, _ = dumped
    s = next(s for g in report["graphs"] for s in g["sites"] if leaf(s) == "fc1")
    L, I, O, e = s["L"], s["I"], s["O"], 4                     # fp32, default n=16, r=8
    c, lg, Lc = s["cost"], math.log2(16), -(-s["L"] // 16) * 8
    assert c["flops_before"] == 4 * L * I * O
    extra = (2 * L * O * lg + 2 * I * O * lg + 2 * L * O + 2 * I * O
             + 2 * L * I * lg + 2 * L * O * lg + 2 * I * Lc + 2 * O * Lc + 2 * I * O + 2 * L * I)
    assert c["flops_after"] == int(2 * L * O * I + 2 * Lc * O * I + extra)
    assert c["bytes_before"] == 2 * (L * O + O * I + L * I) * e
    assert c["bytes_after"] == sum(c["bytes_detail"].values())
    assert c["bytes_detail"]["abc_x"] == L * I * e + Lc * I
    out = next(s for g in report["graphs"] for s in g["sites"] if leaf(s) == "out")
    assert out["cost"]["flops_before"] == out["cost"]["flops_after"] == \
        2 * out["L"] * out["I"] * out["O"]                    # frozen: only the g_x GEMM
    assert report["totals"]["rewritten"] == 4 and report["totals"]["sites"] == 5


def test_report_md_and_cli(dumped):
    root, report, _ = dumped
    md = (root / "report.md").read_text()
    assert "| block.qkv |" in md and "excluded" in md
    res = subprocess.run([sys.executable, "-m", "hotcompile.debug", str(root)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    out = res.stdout
    for g in report["graphs"]:
        assert f"[{g['folder']}]" in out
    assert "4/5 linear sites rewritten in 2 training graph(s)" in out
    assert re.search(r"1x excluded by name.*: out \(graph \d+\)", out)
    assert "HQ g4/w8" in out and "HLA r=8/16 int8" in out and "linear inputs saved" in out
    assert "LQS" in out


def test_hot_dump_env_and_recompile(tmp_path, monkeypatch):
    monkeypatch.setenv("HOT_DUMP", str(tmp_path))
    cfg = HOTConfig(**ALL)
    assert cfg.dump_dir == str(tmp_path)
    cm = torch.compile(torch.nn.Linear(32, 32), backend=hotcompile.backend(cfg), dynamic=False)
    for rows in (16, 24):                                      # second shape: a recompile
        cm(torch.randn(rows, 32, requires_grad=True)).sum().backward()
    data = json.loads((tmp_path / "report.json").read_text())
    assert len(data["graphs"]) == 2
    assert len({g["folder"] for g in data["graphs"]}) == 2
    assert sorted(g["sites"][0]["L"] for g in data["graphs"]) == [16, 24]


def test_folder_names_never_collide(tmp_path):
    cfg = HOTConfig(**ALL, dump_dir=str(tmp_path))
    taken = tmp_path / f"graph999_p{os.getpid()}"             # e.g. a dead process, same pid
    taken.mkdir()
    st = dump._state(cfg, 999)
    assert st.folder == f"{taken.name}.2" and os.path.isdir(st.path)
    assert dump._state(cfg, 999) is st


def test_summary_from_files_alone(dumped, tmp_path, capsys):
    """A copied report.json alone, and a folder written by another process, both summarise."""
    import shutil
    from hotcompile.debug.__main__ import main
    root, report, _ = dumped
    shutil.copy(root / "report.json", tmp_path / "report.json")
    assert main([str(tmp_path / "report.json")]) == 0
    assert "4/5 linear sites rewritten in 2 training graph(s) from 1 process(es)" in capsys.readouterr().out
    # another process (a DDP rank) wrote into the same directory
    other = report["graphs"][0]
    shutil.copytree(root / other["folder"], tmp_path / "graph000_r1_p1")
    g = json.loads((tmp_path / "graph000_r1_p1" / "graph.json").read_text())
    g.update(folder="graph000_r1_p1", process=dict(g["process"], pid=1, rank="1"))
    (tmp_path / "graph000_r1_p1" / "graph.json").write_text(json.dumps(g))
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "from 2 process(es)" in out and "pid 1 rank 1" in out and "[graph000_r1_p1]" in out


# ------------------------------------------------------------------- kept for backward
def test_kept_tensors_named_by_producer_and_use(dumped):
    """Every tensor the block's forward keeps is named by what made it and what backward
    reads it for; HOT's buffers are its own op's, read by its backward ops; the bytes add up
    to the backward graph's own count; the CLI prints the grouped table."""
    from hotcompile.debug.summary import saved_by_producer, saved_tensors
    root, report, _ = dumped
    block = next(g for g in report["graphs"] if len(g["sites"]) == 4)
    kept = saved_tensors(block)
    assert kept and all(t["producer"] != "?" and t["use"] and "unused" not in t["use"]
                        for t in kept)
    hot = [t for t in kept if t["hot"]]
    assert hot and all(t["producer"] == "HOT abc_compress" for t in hot)
    assert all(any(u.startswith("HOT ") for u in t["use"]) for t in hot)
    by = {t["producer"] for t in kept}
    assert {"LayerNorm", "Linear", "graph input"} <= by
    # fc1's output is GELU's input: kept for GELU's backward, under fc1's module name
    gelu_in = [t for t in kept if t["producer"] == "Linear" and "gelu backward" in t["use"]]
    assert len(gelu_in) == 1 and gelu_in[0]["module"].endswith("fc1")
    comp = block["compiled"]["backward"]
    assert sum(t["bytes"] for t in kept if t["producer"] != "graph input") == \
        comp["saved_activation_bytes"]
    rows = saved_by_producer(report["graphs"])
    assert [r["bytes"] for r in rows] == sorted((r["bytes"] for r in rows), reverse=True)
    assert sum(r["count"] for r in rows) == sum(len(saved_tensors(g)) for g in report["graphs"])
    res = subprocess.run([sys.executable, "-m", "hotcompile.debug", str(root)],
                         capture_output=True, text=True, timeout=120)
    assert "kept for backward, by producer and use" in res.stdout
    assert re.search(r"HOT abc_compress\s+HOT ", res.stdout)


def test_kept_bytes_match_autograd_under_autocast(tmp_path):
    """Under bf16 autocast the forward also keeps autocast's bf16 weight copies ("copy of a
    graph input"); the kept activation bytes equal what autograd's saved-tensor hooks see
    (distinct non-parameter storages), exact sites and HOT sites alike. With
    ``recompute_operands`` backward rebuilds the copies and the rebuildable inputs (LayerNorm
    and GELU outputs): no copy and no compressed buffer is kept for them."""
    from hotcompile.debug.summary import load_dump
    kept_by = {}
    for name, cfg in (("exact", dict(include=("-nothing-",), saved_activations="exact")), ("hot", ALL),
                      ("recompute", dict(ALL, recompute_operands=True))):
        torch._dynamo.reset()
        torch.manual_seed(0)
        root = tmp_path / name
        model = Block()
        cm = torch.compile(model, backend=hotcompile.backend(HOTConfig(**cfg, dump_dir=str(root))))
        x = torch.randn(2, 24, 64, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            cm(x).float().square().mean().backward()            # compiles forward and backward
        params = {p.untyped_storage().data_ptr() for p in model.parameters()} | \
            {x.untyped_storage().data_ptr()}
        seen = {}

        def pack(t):
            st = t.untyped_storage()
            if st.data_ptr() not in params:
                seen[st.data_ptr()] = st.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = cm(x)
        y.float().sum().backward()
        data = load_dump(str(root))
        kept = sum(r["bytes"] for r in data["saved"] if r["activation"])
        assert kept == sum(seen.values()), name
        kept_by[name] = kept
        copies = [r for r in data["saved"] if r["producer"] == "copy of a graph input"]
        buffers = sum(r["count"] for r in data["saved"] if r["producer"] == "HOT abc_compress")
        if name == "recompute":
            assert not copies and buffers == 0, data["saved"]
            continue
        assert sum(r["count"] for r in copies) == 4, name       # one bf16 W per linear
        use = "HOT linear_backward" if name == "hot" else "Linear backward"
        assert all(r["use"] == use for r in copies), name
    assert kept_by["recompute"] < kept_by["hot"] < kept_by["exact"]
    torch._dynamo.reset()


def test_a_spliced_sites_ops_are_named_not_followed():
    """Splicing (on CUDA) erases a site's hot:: ops from the joint graph and clears their
    arguments; the dump followed them to the ABC op and failed on every spliced graph
    ("'NoneType' object has no attribute 'args'", H100, 2026-11-27). Now the site's entry
    names them as spliced, and the .dot marks what is still in the graph."""
    from hotcompile.passes.find import LinearSite
    g = torch.fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    y = g.call_function(torch.ops.aten.mm.default, (x, w))
    comp = g.call_function(torch.ops.aten.relu.default, (x,))     # stands in for ABC
    op = g.call_function(torch.ops.aten.add.Tensor, (y, comp))    # for the site's unit op
    g.output((y, comp))
    g.erase_node(op)
    assert op.args == (None, None)
    site = LinearSite(index=0, name="l", fwd=y, x=x, wt=w, weight=w, key="k",
                      rewritten_gx=op, rewritten_gw=op)
    assert dump._site_nodes(site, set(g.nodes)) == {
        "fwd": y.name, "x": "x", "hla": op.name, "hq": op.name, "spliced": True}
    nodes, edges = parse_dot(dump.sites_dot(g, [site], "g"))
    assert nodes[y.name]["role"] == "forward_gemm" and nodes["x"]["role"] == "x"
    assert op.name not in nodes and ("x", y.name) in edges
