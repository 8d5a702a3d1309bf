"""Property-based tests of kept activations (``HOTConfig.saved_activations``) on small random
residual models (hypothesis).

Why a suite of its own: ``test_properties.py`` draws feature sizes of 8..48, under the
64-element rows a kept tensor needs to be narrowed (``passes/saved.MIN_ROW``), so it never
reaches this pass. Here the widths are 64 and 96 (one block a row), 1040 (over 1024 with no
block divisor: one looped row) and 2048 (two blocks of 1024 for e4m3 and for a bf16 row no
norm reduces; one mean a row for a bf16 row a norm reduces, ``saved.norm_reads_rows``), with
LayerNorm, RMSNorm or no norm before each block, GELU / ReLU / SiLU, a residual stream with
or without a large offset, 2-D and 3-D inputs (a linear's 2-D output viewed back), fp32 and
bf16 autocast, each mode. Every linear stays exact (``min_features``), so what differs from
eager is the kept tensors' round trip alone.

Checked for each example, against the same model compiled with ``"exact"`` (eager and
compiled autocast round differently by more than bf16 narrowing does on models this small):
1. compiling and running forward+backward never raises and the pass reports no error;
2. the loss is bit-identical (the forward is unchanged) and every gradient is within the
   round trip's error: bf16 narrowing (2^-9 of a row's spread) within 3%, e4m3 rows (2^-4
   of a block's spread) within 15%, each with a cosine over 0.99;
3. ``"exact"`` and ``"auto"`` in an fp32 graph narrow nothing, ``"bf16"`` / ``"fp8"`` in
   an fp32 graph narrow something; every kept tensor has a format or a reason.
"""
import pytest
import torch
import torch.nn.functional as F

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import hotcompile  # noqa: E402
from hotcompile import HOTConfig  # noqa: E402

from helpers import bench_common, rel  # noqa: E402

SETTINGS = dict(deadline=None, derandomize=True, database=None, print_blob=False,
                phases=(Phase.explicit, Phase.generate),
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


class Residual(torch.nn.Module):
    """x (tokens..., 32) -> an fp32 residual stream of ``width`` -> blocks of norm, linear
    (width -> 64), activation, linear (64 -> width) -> norm -> 8 outputs."""

    def __init__(self, width, norm, act, offset, layers):
        super().__init__()
        make = {"layer": lambda: torch.nn.LayerNorm(width), "rms": lambda: bench_common().RMSNorm(width),
                "none": torch.nn.Identity}[norm]
        self.inp = torch.nn.Linear(32, width)
        with torch.no_grad():
            self.inp.bias += offset
        self.norms = torch.nn.ModuleList(make() for _ in range(layers + 1))
        self.up = torch.nn.ModuleList(torch.nn.Linear(width, 64) for _ in range(layers))
        self.down = torch.nn.ModuleList(torch.nn.Linear(64, width) for _ in range(layers))
        self.out = torch.nn.Linear(width, 8)
        self.act = {"gelu": F.gelu, "relu": F.relu, "silu": F.silu}[act]

    def forward(self, x):
        h = self.inp(x).float()              # an fp32 residual stream under autocast too
        for norm, up, down in zip(self.norms, self.up, self.down):
            h = h + down(self.act(up(norm(h))))
        return self.out(self.norms[-1](h)).float().pow(2).mean()


@st.composite
def cases(draw):
    return dict(width=draw(st.sampled_from([64, 96, 1040, 2048])),
                tokens=draw(st.sampled_from([(12,), (2, 6), (3, 5)])),
                norm=draw(st.sampled_from(["layer", "rms", "none"])),
                act=draw(st.sampled_from(["gelu", "relu", "silu"])),
                offset=draw(st.sampled_from([0.0, 8.0])),
                layers=draw(st.integers(1, 2)),
                mode=draw(st.sampled_from(["auto", "bf16", "fp8", "exact"])),
                amp=draw(st.sampled_from([None, torch.bfloat16])),
                seed=draw(st.integers(0, 2 ** 16)))


def _grads(model, x, fn, amp):
    model.zero_grad(set_to_none=True)
    x.grad = None
    with torch.autocast("cpu", dtype=amp, enabled=amp is not None):
        loss = fn(x)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, x.grad.clone()


@pytest.mark.slow     # 12 examples: ~4 min on 2 cores
@settings(max_examples=12, **SETTINGS)
@given(case=cases())
def test_kept_activations_round_trip_within_their_error(case):
    def compiled(mode):
        torch._dynamo.reset()
        torch.manual_seed(case["seed"])
        model = Residual(case["width"], case["norm"], case["act"], case["offset"],
                         case["layers"])
        x = torch.randn(*case["tokens"], 32, requires_grad=True)
        be = hotcompile.backend(HOTConfig(min_features=10 ** 6, saved_activations=mode))
        return be, _grads(model, x, torch.compile(model, backend=be), case["amp"])

    _, (loss0, g0, gx0) = compiled("exact")
    be, (loss1, g1, gx1) = compiled(case["mode"])
    assert not be.report.errors, (case, be.report.errors)
    assert torch.equal(loss1, loss0), case                     # the forward is unchanged
    fp8 = case["mode"] == "fp8" and case["amp"] is not None     # e4m3 only for bf16 tensors
    bound = 0.15 if fp8 else 0.03
    for name, g in [*g0.items(), ("x", gx0)]:
        got = gx1 if name == "x" else g1[name]
        assert rel(got, g) < bound, (case, name, rel(got, g))
        cos = F.cosine_similarity(got.flatten().double(), g.flatten().double(), dim=0)
        assert cos > 0.99, (case, name, float(cos))

    reports = list(be.report.saved.values())             # one per graph; none for "exact"
    for r in reports:
        assert all(t[3] for t in r["tensors"]), r["tensors"]
    narrows = case["mode"] in ("bf16", "fp8") or (case["mode"] == "auto" and case["amp"])
    if not narrows:
        assert all(r["compressed"] == 0 for r in reports), (case, reports)
    elif case["amp"] is None:
        # an fp32 graph keeps the up-projection's fp32 output for the activation's backward
        assert any(r["compressed"] for r in reports), (case, reports)
