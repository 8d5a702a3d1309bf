"""Every reason the passes give is true and specific: one test per reason, produced from a
real model (or, where no model can reach it, a real joint graph changed in one place), and
inference-only graphs reported apart from the training totals."""
import logging
import re

import torch
import torch.nn as nn

import hotcompile
from hotcompile import HOTConfig
from hotcompile.entry import INFERENCE

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
