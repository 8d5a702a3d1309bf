"""What a training step keeps for backward, by producer: Inductor bf16 against HOT, one model.

    python bench/saved_tensors.py --models vit_b16_bs64,llama_d4096 --out $OUT       # GPU
    python bench/saved_tensors.py --models vit_base_geometry --layers 2 --batch 4    # CPU
    python bench/saved_tensors.py --models llama_d4096 --hot min_speedup=0 forward=fp8_rowwise

Why: the step's peak memory is mostly the tensors alive between forward and backward, and
which tensors those are is decided by Inductor's partitioner after HOT's pass. Before
compressing anything else (a LayerNorm input, a GELU input, attention's output), one has
to know what dominates. Each model is compiled twice in this process through the HOT
backend with a dump directory: once with every layer excluded (the pass changes nothing, so
the compiled graphs are Inductor's own) and once with the HOT config asked for. The dumps
name every kept tensor by the op that produced it and the backward ops that read it
(``hotcompile/debug/saved.py``); this script puts the two side by side, grouped by
(producer, use), with autograd's own count of saved bytes (``common.SavedBytes``, distinct
non-parameter storages of one forward) as a cross-check of the total, and on a GPU the
peak allocated memory of one full training step (AdamW state included).

Bytes are the compiled graphs' own shapes and dtypes: they do not depend on the device,
except for which attention kernel runs (flash on CUDA keeps the output and log-sum-exp, the
CPU kernel the same) and which layers HOT's cost gate rewrites (on CPU every eligible one;
``--hot min_speedup=0`` does the same on a GPU). Per-layer rows scale with tokens, so a
CPU run at a small batch and fewer layers shows the same shares as the full model.
``vit_base_geometry`` is the built-in ViT (``common.ViT``) at ViT-B/16's sizes (224 px,
patch 16, d 768, 12 heads, MLP 3072), for machines without timm.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import common as C  # noqa: E402
import peak_live  # noqa: E402
import train as T  # noqa: E402
from hotcompile.debug.summary import fmt_bytes, load_dump  # noqa: E402

NOTHING = "-nothing-"      # an include pattern no layer matches: the pass changes nothing


def build_vit_geometry(layers: int):
    def build(device):
        with torch.device(device):
            m = C.ViT(img=224, patch=16, chans=3, classes=1000, d=768, layers=layers,
                      heads=12)
        return T.Workload(C.ClsLoss(m), T._images((3, 224, 224), 1000), 64, 197, {},
                          ("head",), f"built-in ViT at ViT-B/16 sizes, {layers} layers")
    return build


def measure(model: str, hot: dict, opts: dict, dump_dir: str, breakdown: bool = False) -> dict:
    """One compiled fwd+bwd step of ``model`` with a dump; the dump's rows and totals.
    ``breakdown`` (CUDA): one more step with the allocator's history on, and what is alive
    at its peak (``peak_live``)."""
    C.reset_compile_state()
    run = T.setup_run(model, "hot", dict(opts, hot=dict(hot, dump_dir=dump_dir)))
    run.step(0)
    run.step(1)                       # AdamW's state exists from here on, as in training
    cuda = run.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(run.device)
        torch.cuda.reset_peak_memory_stats(run.device)
    with C.SavedBytes(run.wl.module.parameters()) as sb:
        with C.amp_ctx(run.device, run.amp):
            loss = run.step_fn(*run.batches[0])
    loss.backward()
    run.opt.step()
    run.opt.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated(run.device) if cuda else None
    at_peak = None
    if breakdown and cuda:
        def step():
            run.step(0)
        traced_peak, groups = peak_live.record_step(step, run.device)
        at_peak = {"peak_bytes": traced_peak,
                   "groups": [{"phase": k[0], "origin": k[1], "bytes": v}
                              for k, v in sorted(groups.items(), key=lambda kv: -kv[1])]}
    rep = run.be.report
    data = load_dump(dump_dir)
    out = {"rows": data["saved"], "autograd_saved_bytes": sb.nbytes, "peak_bytes": peak,
           "sites": len(rep.training), "rewritten": len(rep.rewritten),
           "batch": run.wl.batch, "notes": run.wl.notes, "at_peak": at_peak}
    del run, loss
    C.reset_compile_state()
    return out


def side_by_side(base: List[dict], hot: List[dict]) -> List[Dict]:
    keys = []
    for r in base + hot:
        if (r["producer"], r["use"]) not in keys:
            keys.append((r["producer"], r["use"]))
    b = {(r["producer"], r["use"]): r for r in base}
    h = {(r["producer"], r["use"]): r for r in hot}
    rows = [{"producer": k[0], "use": k[1],
             "activation": (b.get(k) or h.get(k))["activation"],
             "inductor": b[k]["bytes"] if k in b else 0,
             "hot": h[k]["bytes"] if k in h else 0,
             "count": f"{b[k]['count'] if k in b else 0}/{h[k]['count'] if k in h else 0}"}
            for k in keys]
    return sorted(rows, key=lambda r: -max(r["inductor"], r["hot"]))


def markdown(model: str, res: dict) -> str:
    base, hot = res["inductor"], res["hot"]
    rows = side_by_side(base["rows"], hot["rows"])
    tot_b = sum(r["inductor"] for r in rows if r["activation"])
    tot_h = sum(r["hot"] for r in rows if r["activation"])
    L = [f"### {model}", "", f"{hot['notes']}; batch {hot['batch']}; HOT config "
         f"`{res['hot_config']}`: {hot['rewritten']}/{hot['sites']} sites rewritten", "",
         "| producer | used by | tensors (ind/hot) | Inductor | share | HOT | share |",
         "|---|---|---|---|---|---|---|"]
    for r in rows:
        def share(v, tot):
            return f"{100 * v / tot:.1f}%" if r["activation"] and tot else "held anyway"
        L.append(f"| {r['producer']} | {r['use']} | {r['count']} | {fmt_bytes(r['inductor'])}"
                 f" | {share(r['inductor'], tot_b)} | {fmt_bytes(r['hot'])} | "
                 f"{share(r['hot'], tot_h)} |")
    L += ["", f"kept activations (graph inputs not counted): Inductor {fmt_bytes(tot_b)}, HOT "
              f"{fmt_bytes(tot_h)} ({tot_h / tot_b:.3f}x)" if tot_b else "",
          f"autograd saved_tensors_hooks (distinct non-parameter storages): Inductor "
          f"{fmt_bytes(base['autograd_saved_bytes'])}, HOT {fmt_bytes(hot['autograd_saved_bytes'])}"]
    if base["peak_bytes"]:
        L.append(f"peak allocated over one training step (after two): Inductor "
                 f"{fmt_bytes(base['peak_bytes'])}, HOT {fmt_bytes(hot['peak_bytes'])} "
                 f"({hot['peak_bytes'] / base['peak_bytes']:.3f}x)")
    for side in ("inductor", "hot"):
        at = res[side].get("at_peak")
        if at:
            L += ["", f"alive at the peak of one more step, {side} ({fmt_bytes(at['peak_bytes'])}, "
                      "from the allocator's trace):", ""]
            L += peak_live.table({(g["phase"], g["origin"]): g["bytes"] for g in at["groups"]},
                                 at["peak_bytes"], fmt=fmt_bytes)
    L.append("")
    return "\n".join(L)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="vit_b16_bs64,llama_d4096")
    p.add_argument("--batch", type=int, help="override every model's batch")
    p.add_argument("--layers", type=int, default=12, help="vit_base_geometry's depth")
    p.add_argument("--hot", nargs="*", help="HOTConfig overrides for the HOT side, key=value")
    p.add_argument("--device")
    p.add_argument("--amp", default="bf16", choices=["bf16", "fp16", "none"])
    p.add_argument("--out", help="folder for saved_tensors_<date>_<device>.{json,md}")
    p.add_argument("--peak-breakdown", action="store_true",
                   help="CUDA: also what is alive at a step's peak, by where it was allocated")
    args = p.parse_args(argv)
    T.MODELS["vit_base_geometry"] = build_vit_geometry(args.layers)
    opts = {"device": args.device, "batch": args.batch, "amp": args.amp}
    device = C.pick_device(args.device)
    hot_kw = C.parse_overrides(args.hot)
    results, text = {}, [f"## Kept for backward, by producer ({C.device_name(device)}, "
                         f"{C.stamp()})", ""]
    for model in args.models.split(","):
        why = T.model_unavailable(model)
        if why:
            print(f"{model}: skipped ({why})")
            continue
        with tempfile.TemporaryDirectory() as d0, tempfile.TemporaryDirectory() as d1:
            # Inductor's own partition: no layer rewritten and every kept tensor as it is
            res = {"inductor": measure(model, {"include": (NOTHING,), "saved_activations": "exact"},
                                       opts, d0,
                                       args.peak_breakdown),
                   "hot": measure(model, hot_kw, opts, d1, args.peak_breakdown),
                   "hot_config": hot_kw}
        if res["inductor"]["rewritten"]:
            raise SystemExit(f"{model}: the baseline rewrote a layer (include={NOTHING!r})")
        results[model] = res
        text.append(markdown(model, res))
        print(text[-1], flush=True)
    if args.out and results:
        base = C.result_base(args.out, "saved_tensors", device)
        C.write_json(base + ".json", {"env": C.environment(device), "results": results})
        C.write_text(base + ".md", "\n".join(text))
        print(f"wrote {base}.json / .md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
