"""Layer-wise quantizer selection inside the compiled run (issue 4, acceptance 1 and 2)."""
import json

import torch

import hotcompile
from hotcompile import HOTConfig
from hotcompile.runtime.lqs import TABLE


class TwoHeads(torch.nn.Module):
    """Two independent linears; the loss decides each one's output-gradient pattern."""

    def __init__(self, d=64):
        super().__init__()
        self.spiky = torch.nn.Linear(d, d)
        self.flat = torch.nn.Linear(d, d)

    def forward(self, x, m_spiky, m_flat):
        return (self.spiky(x) * m_spiky).sum() + (self.flat(x) * m_flat).sum()


def batch(seed, tokens=128, d=64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, d, generator=g, requires_grad=True)
    # token-wise outliers in g_y: token norms spread log-normally (as in attention projections)
    m_spiky = torch.randn(tokens, d, generator=g) * torch.exp(torch.randn(tokens, 1, generator=g))
    m_flat = torch.randn(tokens, d, generator=g)  # no outliers
    return x, m_spiky, m_flat


class CountingBackend(hotcompile.HotBackend):
    calls = 0

    def __call__(self, gm, example_inputs, **kw):
        CountingBackend.calls += 1
        return super().__call__(gm, example_inputs, **kw)


def train(model, be, steps, seed0=0):
    cm = torch.compile(model, backend=be)
    for s in range(steps):
        cm(*batch(seed0 + s)).backward()


def test_lqs_picks_per_token_only_for_outlier_gradients():
    cfg = HOTConfig(min_features=0, gx_scale="lqs", lqs_calibration_steps=3)
    be = hotcompile.backend(cfg)
    train(TwoHeads(), be, steps=4)
    spiky, flat = TABLE.by_name("spiky"), TABLE.by_name("flat")
    assert spiky.choice == "token" and flat.choice == "tensor"
    assert spiky.window == 3 and spiky.steps == 4 and spiky.source == "calibrated"
    e_tok, e_ten = spiky.errors()
    assert e_tok < 0.5 * e_ten                      # the rule, on the measured errors
    f_tok, f_ten = flat.errors()
    assert f_tok >= 0.5 * f_ten and f_tok < f_ten * 1.01
    text = str(be.report)
    assert "token (e_tok" in text and "tensor (e_tok" in text
    rec = {r.name: r for r in be.report.layers}
    assert rec["spiky"].lqs_choice == "token" and abs(rec["spiky"].lqs_err_token - e_tok) < 1e-12


def test_changing_choices_never_recompiles():
    CountingBackend.calls = 0
    be = CountingBackend(HOTConfig(min_features=0, gx_scale="lqs", lqs_calibration_steps=2,
                                   lqs_recalibrate_every=3))
    model = TwoHeads()
    cm = torch.compile(model, backend=be)
    seen = []
    for s in range(8):
        cm(*batch(s)).backward()
        seen.append(TABLE.by_name("spiky").choice)
        if s == 4:
            TABLE.set("spiky", False)              # by hand
    TABLE.recalibrate("flat")
    cm(*batch(9)).backward()
    assert CountingBackend.calls == 1               # one compile, whatever the table did
    # calibrated after 2 passes, re-opened at step 4 (every 3), then forced at step 4
    assert seen[:4] == ["calibrating", "token", "token", "calibrating"]
    assert seen[5:] == ["tensor"] * 3 and TABLE.by_name("spiky").source == "forced"
    assert TABLE.by_name("flat").choice == "calibrating"


def test_choices_saved_and_reused_by_a_restarted_run(tmp_path):
    path = tmp_path / "lqs.json"
    cfg = HOTConfig(min_features=0, gx_scale="lqs", lqs_calibration_steps=2, lqs_file=str(path))
    train(TwoHeads(), hotcompile.backend(cfg), steps=2)
    data = json.loads(path.read_text())
    assert data["spiky"]["choice"] == "token" and data["flat"]["choice"] == "tensor"
    assert data["spiky"]["err_token"] < 0.5 * data["spiky"]["err_tensor"]
    # "restart": empty table, fresh compile; the file decides before any calibration
    TABLE.clear()
    torch._dynamo.reset()
    train(TwoHeads(), hotcompile.backend(cfg), steps=1, seed0=100)
    assert TABLE.by_name("spiky").source == "file" and TABLE.by_name("spiky").choice == "token"
    assert TABLE.by_name("flat").choice == "tensor"


def test_forced_scale_skips_calibration():
    train(TwoHeads(), hotcompile.backend(HOTConfig(min_features=0, gx_scale="tensor")), steps=1)
    assert TABLE.by_name("spiky").choice == "tensor" and TABLE.by_name("spiky").window == 0


def test_cuda_graph_capture_decides_from_warmup_windows(monkeypatch):
    """Under CUDA-graph capture nothing may be read back to the host: a site with at least
    one measured window decides from it, one with none stays per-token, and neither
    measures (quantization_errors would sync)."""
    from hotcompile.runtime import lqs
    g_out = torch.randn(64, 32) * torch.logspace(-3, 3, 64)[:, None]   # outlier tokens
    TABLE.register("warm", calibration_steps=3)
    TABLE.register("cold", calibration_steps=3)
    assert TABLE.per_token("warm", g_out, 4, 16) is True        # eager warm-up: 1 window
    assert TABLE.by_name("warm").per_token is None
    monkeypatch.setattr(lqs, "capturing", lambda g: True)
    monkeypatch.setattr(lqs, "quantization_errors",
                        lambda *a: (_ for _ in ()).throw(AssertionError("measured in capture")))
    assert TABLE.per_token("warm", g_out, 4, 16) is True
    assert TABLE.by_name("warm").source == "calibrated" and TABLE.by_name("warm").window == 1
    assert TABLE.per_token("cold", g_out, 4, 16) is True
    assert TABLE.by_name("cold").per_token is None
