"""What autograd keeps for backward, grouped by (dtype, shape), for any bench/train.py modes.

    python bench/saved_by_shape.py --model llama_d4096 \
        --modes "inductor,hot[forward=fp8_rowwise],fp8_tensorwise[exclude=]" --out $OUT

Why: bench/saved_tensors.py names HOT's and Inductor's kept tensors by producer from HOT's
graph dumps, which torchao's float8 runs do not have. Grouping the storages the compiled
forward hands to autograd (``saved_tensors_hooks``; parameters left out, each storage
once) by dtype and shape needs no dump, so any mode compares: it showed that torchao keeps
none of its FP8 operands (Inductor's partitioner recomputes them in backward from tensors
kept anyway), where HOT keeps its compressed x and HQ's W (bench/results,
saved_by_shape_2026-11-27T054905_h100_llama_d4096.json). One step runs first in each mode (compiles, warms up).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import common as C  # noqa: E402
import train as T  # noqa: E402


def kept_by_shape(model: str, mode: str, opts: dict | None = None) -> dict:
    run = T.setup_run(model, mode, opts or {})
    for i in range(2):
        run.step(i)
    with C.SavedBytes(run.wl.module.parameters()) as kept:
        with C.amp_ctx(run.device, run.amp):
            loss = run.step_fn(*run.batches[0])
    loss.backward()
    run.opt.zero_grad(set_to_none=True)
    size, count = collections.Counter(), collections.Counter()
    for ptr, nb in kept.storages.items():
        size[kept.first[ptr]] += nb
        count[kept.first[ptr]] += 1
    rows = [dict(dtype=k[0], shape=list(k[1]), n=count[k], MiB=round(v / 2 ** 20, 1))
            for k, v in size.most_common()]
    torch._dynamo.reset()
    return dict(total_MiB=round(sum(size.values()) / 2 ** 20, 1), storages=len(kept.storages),
                rows=rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama_d4096")
    p.add_argument("--modes", default="inductor,hot,hot[forward=fp8_rowwise]")
    p.add_argument("--out", default=None)
    p.add_argument("--batch", type=int, help="override the model's batch (a CPU run: 1-4)")
    p.add_argument("--device", help="cuda / cpu (default: cuda when available)")
    a = p.parse_args(argv)
    opts = {k: v for k, v in (("batch", a.batch), ("device", a.device)) if v}
    res = {}
    for mode in C.mode_list(a.modes):
        res[mode] = r = kept_by_shape(a.model, mode, opts)
        print(f"== {mode}: {r['total_MiB']} MiB in {r['storages']} storages")
        for row in r["rows"][:30]:
            print(f"  {row['dtype']:>14} {str(row['shape']):>24} x{row['n']:<3} "
                  f"{row['MiB']:>8} MiB")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        path = os.path.join(a.out, f"saved_by_shape_{C.stamp().replace(':', '')}_{a.model}.json")
        with open(path, "w") as f:
            json.dump(dict(device=dev, model=a.model, batch=a.batch, modes=res), f, indent=1)
        print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
