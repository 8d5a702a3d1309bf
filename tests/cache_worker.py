"""One process of test_compile_cache: compile a model with Inductor or with hot, time the
first training step (compile included), and write hot's report. Run twice with one cache
folder per backend: the second process is the warm-cache case."""
import json
import sys
import time

import torch

import hotcompile
from hotcompile import HOTConfig


class MLP(torch.nn.Module):
    def __init__(self, d=256, depth=8):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(
            torch.nn.LayerNorm(d), torch.nn.Linear(d, 2 * d), torch.nn.GELU(),
            torch.nn.Linear(2 * d, d)) for _ in range(depth))

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x


def first_step(backend, depth=8) -> float:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MLP(depth=depth)
    x = torch.randn(4, 64, 256)
    fn = torch.compile(model, backend=backend)
    times = []
    for _ in range(3):
        t = time.perf_counter()
        fn(x).square().mean().backward()
        times.append(time.perf_counter() - t)
    return times[0], min(times[1:])


def main(which: str, out: str, saved: str = "exact") -> None:
    """``saved``: HOTConfig.saved_activations (with "fp8", two blocks and no warm-up graph:
    the test checks that the partition came from the cache, not how fast)."""
    torch.set_num_threads(1)
    runs = []
    orig = hotcompile.entry.JointPass.__call__

    def counted(self, graph):
        runs.append(1)
        return orig(self, graph)
    hotcompile.entry.JointPass.__call__ = counted
    if saved == "exact":
        # one-time costs of the process (imports, Inductor's first codegen) on another graph
        first_step("inductor", depth=1)
    be = hotcompile.backend(HOTConfig(min_features=0, kernels="reference",
                                      saved_activations=saved))
    first, steady = first_step(be if which == "hot" else "inductor",
                               depth=8 if saved == "exact" else 2)
    res = {"seconds": first, "steady": steady, "pass_runs": len(runs),
           "saved": be.report.to_dict()["saved"]}
    res["report"] = [{k: v for k, v in r.items() if k != "graph"}
                     for r in be.report.to_dict()["layers"]]
    res["notes"] = be.report.notes
    res["lqs_keys"] = sorted(hotcompile.runtime.lqs.TABLE.sites)
    with open(out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
