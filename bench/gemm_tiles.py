"""Tile sweep of the INT8 GEMM (gemm.scaled_mm) at HOT's backward shapes: the data behind
``gemm.tile_config``'s rule.

Why: tiles are chosen from the shape at run time (no autotuning: a new token count must not
tune inside backward or under CUDA-graph capture). This times every tile of ``gemm.CONFIGS``
at the g_x (L x I x O_pad) and g_W (O x I x L') GEMMs of ViT-B/16 bs64 and of GPT/Llama
layers at several token counts, and reports the rule's pick against the fastest tile.
``triton.testing.do_bench`` medians on random int8 levels, bf16 output, vector scales.

    python bench/gemm_tiles.py --out bench/results
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

# (what, L tokens, I, O): the layers of bench/layers.py at their token counts, plus
# other token counts of the same layers (dynamic lengths)
LAYERS = [("ViT qkv", 12608, 768, 2304), ("ViT proj", 12608, 768, 768),
          ("ViT fc1", 12608, 768, 3072), ("ViT fc2", 12608, 3072, 768),
          ("d2048 qkv", 16384, 2048, 6144), ("d2048 fc2", 16384, 8192, 2048),
          ("d4096 qkv", 8192, 4096, 12288), ("d4096 proj", 8192, 4096, 4096),
          ("d4096 up", 8192, 4096, 14336), ("d4096 down", 8192, 14336, 4096),
          ("d4096 qkv", 2048, 4096, 12288), ("d4096 proj", 1024, 4096, 4096),
          ("d768 fc1", 4096, 768, 3072), ("d768 fc2", 1024, 3072, 768)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--rank", type=int, default=16)
    a = p.parse_args(argv)
    from triton.testing import do_bench
    from hotcompile.kernels import gemm as G
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    print(f"{'GEMM':<22}{'M':>7}{'N':>7}{'K':>7}  " + "".join(f"{c:>9}" for c in G.CONFIGS)
          + "   rule    loss")
    for what, L, I, O in LAYERS:
        lr = -(-L // 16) * a.rank
        for kind, M, N, K in (("g_x", L, I, -(-O // 16) * 16), ("g_W", O, I, lr)):
            A = torch.randint(-7, 8, (M, -(-K // 16) * 16), dtype=torch.int8, device="cuda")
            B = torch.randint(-7, 8, (N, -(-K // 16) * 16), dtype=torch.int8, device="cuda")
            rs, cs = torch.rand(M, device="cuda"), torch.rand(N, device="cuda")
            t = {}
            for c in G.CONFIGS:
                fn = lambda c=c: G.scaled_mm(A, B, rs, cs, 1 / 16, torch.bfloat16, k=K, config=c)
                fn()
                t[c] = do_bench(fn, warmup=5, rep=30, return_mode="median")
            rule = G.tile_config(M, N, K, sms)
            best = min(t, key=t.get)
            loss = t[rule] / t[best] - 1
            rows.append(dict(what=f"{what} {kind}", M=M, N=N, K=K, ms=t, rule=rule, best=best,
                             rule_loss=loss))
            print(f"{what + ' ' + kind:<22}{M:>7}{N:>7}{K:>7}  "
                  + "".join(f"{t[c] * 1e3:>9.1f}" for c in G.CONFIGS)
                  + f"   {rule:<8}{100 * loss:5.1f}%", flush=True)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        dev = torch.cuda.get_device_name().lower().replace(" ", "-")
        path = os.path.join(a.out, f"gemm_tiles_{_dt.datetime.now():%Y-%m-%dT%H%M%S}_{dev}.json")
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, sms=sms,
                       rows=rows), open(path, "w"), indent=1)
        print("wrote", path)


if __name__ == "__main__":
    main()
