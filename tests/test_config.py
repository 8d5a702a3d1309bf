"""HOTConfig validation: bad values fail at construction with the field's name."""
import pytest

from hotcompile import HOTConfig


@pytest.mark.parametrize("kw,field", [
    ({"block": 12}, "block"), ({"block": 1}, "block"), ({"rank": 0}, "rank"),
    ({"rank": 17}, "rank"), ({"gx_bits": 2}, "gx_bits"), ({"gw_bits": 16}, "gw_bits"),
    ({"gx_scale": "row"}, "gx_scale"), ({"gx_w_bits": 6}, "gx_w_bits"),
    ({"rank": "full"}, "rank"), ({"rank_tolerance": 0}, "rank_tolerance"),
    ({"rank_calibration_steps": 0}, "rank_calibration_steps"),
    ({"kernels": "cuda"}, "kernels"), ({"exclude": "head"}, "exclude"),
    ({"include": [1]}, "include"), ({"min_features": -1}, "min_features"),
    ({"lqs_ratio": 0}, "lqs_ratio"), ({"lqs_calibration_steps": 0}, "lqs_calibration_steps"),
    ({"rank": 4.0}, "rank"), ({"abc": 1}, "abc"), ({"recompute_operands": "yes"}, "recompute_operands"), ({"exclude": None}, "exclude"),
    ({"exclude": 3}, "exclude"), ({"dump_dir": 123}, "dump_dir"), ({"lqs_file": 3}, "lqs_file"),
    ({"dump_dir": ""}, "dump_dir"), ({"gw_format": "fp8"}, "gw_format"),
    ({"exact_gx": "head"}, "exact_gx"), ({"exact_gx": None}, "exact_gx"),
])
def test_bad_values_name_the_field(kw, field):
    with pytest.raises(ValueError, match=rf"HOTConfig\.{field}\b"):
        HOTConfig(**kw)


def test_defaults_and_frozen():
    c = HOTConfig()
    assert (c.rank, c.block, c.gx_bits, c.gx_w_bits, c.gw_bits, c.kernels) == \
        (16, 16, 4, 8, 8, "auto")
    p = HOTConfig.paper()
    assert (p.rank, p.gx_bits, p.gx_w_bits, p.gx_scale) == (8, 4, 4, "lqs")
    assert c.forward == "auto" and p.forward == "bf16"     # the paper leaves the forward
    with pytest.raises(Exception):
        c.rank = 4
    assert HOTConfig(exclude=["a", "b"]).exclude == ("a", "b")
    # the output head: its g_W under HOT, its g_x exact (the LM gates: docs/BENCHMARKS.md)
    assert c.exclude == () and c.exact_gx == ("head", "lm_head")
    assert HOTConfig(exact_gx=["out"]).exact_gx == ("out",)
    assert HOTConfig(exact_gx=()).digest() != c.digest()
    assert c.digest() == HOTConfig().digest() != HOTConfig(rank=4).digest()


def test_hot_dump_env(monkeypatch, tmp_path):
    monkeypatch.setenv("HOT_DUMP", str(tmp_path))
    assert HOTConfig().dump_dir == str(tmp_path)
    assert HOTConfig(dump_dir="x").dump_dir == "x"


@pytest.mark.parametrize("value", [-1, float("inf"), "1", True, None])
def test_min_speedup_is_validated(value):
    with pytest.raises(ValueError, match="min_speedup"):
        HOTConfig(min_speedup=value)


def test_paths_accept_pathlike(tmp_path):
    c = HOTConfig(dump_dir=tmp_path, lqs_file=tmp_path / "lqs.json")
    assert c.dump_dir == str(tmp_path) and c.lqs_file == str(tmp_path / "lqs.json")


def test_triton_without_cuda_fails_at_construction(monkeypatch):
    import torch
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"HOTConfig\.kernels: 'triton' needs a CUDA device"):
        HOTConfig(kernels="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert HOTConfig(kernels="triton").kernels == "triton"
