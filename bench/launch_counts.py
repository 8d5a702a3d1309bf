"""Issue 11 item 3 for a real model: what each compiled graph launches, per rewritten site.

    python bench/launch_counts.py --models llama_d4096 --modes "hot,hot[forward=fp8]" --out $OUT
    python bench/launch_counts.py --models tiny_gpt --modes hot --device cpu --out /tmp/r

One training step per mode (``train.setup_run``) under ``run_and_get_code``; each compiled
graph's output code is counted by ``hotcompile.debug.launches``. A graph is a backward when
its ``call`` unpacks tangents. Per site: the forward's HOT kernels, and the backward's HOT
launches (HOT's Triton kernels, cuBLAS ``_scaled_mm`` GEMMs and ``hot::`` ops but the
graph's one seed draw), each over the rewritten sites. Why a tool and not only the GPU
test: the test's block has four sites and one layout; where a kernel lands on a real model
is the partitioner's choice (Llama: HQ W in the forward, o_proj's ABC in the backward).
Results: ``<out>/launch_counts_<date>_<device>[_tag].{json,md}`` (``--keep-code`` adds each
graph's output code).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as C  # noqa: E402
from hotcompile.debug.launches import launches, site_op_calls  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def is_backward(code: str) -> bool:
    """Whether an output code's ``call`` takes tangents (AOTAutograd's backward)."""
    return "tangents_" in code


def hot_launches(counts: Dict) -> int:
    """A graph's launches that HOT's rewrite put there (see the module docstring)."""
    return (sum(counts["hot"].values()) + counts["extern"].get("_scaled_mm", 0)
            + site_op_calls(counts))


def measure(model: str, mode: str, opts: dict) -> dict:
    """One step of ``model`` in ``mode``: each compiled graph's counts, and per site."""
    import train as T
    from torch._inductor.utils import run_and_get_code
    C.reset_compile_state()
    run = T.setup_run(model, mode, opts)

    def step():
        run.step(0)
        C.sync(run.device)
    _, codes = run_and_get_code(step)
    sites = len(run.be.report.rewritten) if run.be is not None else 0
    graphs = [{"graph": "backward" if is_backward(c) else "forward", **launches(c)}
              for c in codes]
    for g in graphs:
        g["hot_launches"] = hot_launches(g)
    per_site = {}
    if sites:
        for kind in ("forward", "backward"):
            n = sum(g["hot_launches"] for g in graphs if g["graph"] == kind)
            per_site[kind] = n / sites
    return {"model": model, "mode": mode, "sites": sites, "graphs": graphs,
            "per_site": per_site, "codes": codes}


def table(results: List[dict]) -> str:
    rows = []
    for r in results:
        for g in r["graphs"]:
            hot = ", ".join(f"`{k}` {v}" for k, v in sorted(g["hot"].items())) or "-"
            ext = ", ".join(f"`{k}` {v}" for k, v in sorted(g["extern"].items())) or "-"
            ops = ", ".join(f"`{k}` {v}" for k, v in sorted(g["ops"].items())) or "-"
            per = r["per_site"].get(g["graph"])
            rows.append([r["model"], r["mode"], g["graph"], r["sites"], hot, g["inductor"],
                         ext, ops, g["hot_launches"], C.fmt(per)])
    return C.md_table(["model", "mode", "graph", "sites", "HOT kernels", "Inductor kernels",
                       "extern kernels", "op calls", "HOT launches", "per site"], rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="llama_d4096")
    p.add_argument("--modes", default="hot")
    p.add_argument("--device", help="cuda / cpu (default: cuda when available)")
    p.add_argument("--out", help="output folder (default bench/results)")
    p.add_argument("--tag", default="")
    p.add_argument("--keep-code", action="store_true",
                   help="also write each graph's output code (<base>_<model>_<mode>_<i>.py)")
    args = p.parse_args(argv)
    out = os.path.abspath(args.out or os.path.join(HERE, "results"))
    os.makedirs(out, exist_ok=True)
    device = C.pick_device(args.device)
    base = C.result_base(out, "launch_counts", device, args.tag)
    opts = {"device": args.device} if args.device else {}
    results = []
    for model in args.models.split(","):
        for mode in C.mode_list(args.modes):
            r = measure(model, mode, opts)
            codes = r.pop("codes")
            if args.keep_code:
                for i, code in enumerate(codes):
                    C.write_text(f"{base}_{model}_{C.file_part(mode)}_{i}.py", code)
            results.append(r)
    C.write_json(base + ".json", {"env": C.environment(device), "options": vars(args),
                                  "results": results})
    text = "\n".join([f"# Launches per compiled graph: {C.device_name(device)}", "",
                      table(results), ""])
    C.write_text(base + ".md", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
