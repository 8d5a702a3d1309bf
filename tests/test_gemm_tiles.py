"""gemm.tile_config (tiles chosen from the shape, no run-time tuning) against the H100 sweep
it was fitted on: it must pick a tile within 15% of the fastest on every GEMM of the sweep,
and the fastest on most of them."""
import json
import os

from hotcompile.kernels import gemm as G

SWEEP = os.path.join(os.path.dirname(__file__), "..", "bench", "results",
                     "gemm_tiles_2026-11-23T220410_nvidia-h100-80gb-hbm3.json")


def test_tile_rule_tracks_the_h100_sweep():
    data = json.load(open(SWEEP))
    hits = 0
    for r in data["rows"]:
        pick = G.tile_config(r["M"], r["N"], r["K"], data["sms"])
        loss = r["ms"][pick] / min(r["ms"].values()) - 1
        assert loss < 0.15, (r["what"], pick, r["ms"])
        hits += loss == 0
    assert hits >= 0.75 * len(data["rows"])


def test_tile_rule_is_a_pure_function_of_the_shape():
    assert G.tile_config(8192, 4096, 14336, 132) == "wide"       # many waves: widest tile
    assert G.tile_config(768, 768, 12608, 132) == "narrow"       # 18 wide tiles: an SM in 7
    assert all(G.tile_config(m, 768, 2304, 132) in G.CONFIGS for m in range(16, 20000, 997))
