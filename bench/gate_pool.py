"""The LM accuracy gate against pooled baselines: each hot run's final validation loss against
the mean of every Inductor run of the same corpus, model config and seed in the given files.

Why: bench/accuracy.py compares a hot run with the Inductor run of its own process. That
Inductor run has its own spread: a std of 0.60% at one seed (bench/README). So a single
pair fails the 1% gate about one time in eight with no HOT effect at all. The twenty-fifth
stop measured Inductor's seed 0 at 0.9069, 0.9095 and 0.8932 in three calls, and every mode
"failed" that seed against the last, the control included. A mean of k Inductor runs has
1/sqrt(k) of that spread. The verdict is on the mean gap over runs, as the gate's is; the
last column says whether it stands at two standard errors, and if not, about how many runs
would decide it (``decided``).

    python bench/gate_pool.py bench/results/accuracy_*_s25bytes*.json \
        [--baselines-from OTHER.json ...] [--md OUT.md]

A mode string means what the code of its run made of it: pass only files whose modes mean
the same (``saved_activations="fp8"`` changed meaning between calls 67 and 70). The Inductor
runs of other files still count as baselines: ``--baselines-from``.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections import defaultdict
from typing import Dict, Iterable, List, Tuple

GATE = 0.01                      # hot within 1% of Inductor's final validation loss
_NOT_MODEL = ("modes", "corpora", "seeds")   # run lists, not the model or its training


def _config_key(cfg: dict) -> str:
    return json.dumps({k: v for k, v in sorted(cfg.items()) if k not in _NOT_MODEL})


def runs(results: Iterable[dict], only_mode: str = "") -> List[Tuple[str, str, object, str, float]]:
    """(corpus, config key, seed, mode, final val loss) of every ok LM run (of ``only_mode``
    if given)."""
    out = []
    for res in results:
        lm = res.get("lm") or {}
        key = _config_key(lm.get("config") or {})
        seed0 = (res.get("options") or {}).get("seed")
        for corpus, ent in (lm.get("corpora") or {}).items():
            for r in ent.get("runs", []):
                if (r.get("status") == "ok" and r.get("final_val_loss") is not None
                        and r["mode"] == (only_mode or r["mode"])):
                    out.append((ent.get("corpus", corpus), key, r.get("seed", seed0),
                                r["mode"], float(r["final_val_loss"])))
    return out


def pooled_gaps(records) -> Dict[Tuple[str, str], dict]:
    """(corpus, mode) -> {"gaps": [...], "baselines": n}: each run's relative gap to the mean
    of the Inductor runs of its corpus, config and seed (Inductor's own runs included: their
    spread about that mean is what the gaps of a mode with no effect look like)."""
    base = defaultdict(list)
    for corpus, key, seed, mode, loss in records:
        if mode == "inductor":
            base[corpus, key, seed].append(loss)
    out: Dict[Tuple[str, str], dict] = {}
    for corpus, key, seed, mode, loss in records:
        ref = base.get((corpus, key, seed))
        if not ref:
            continue                              # no baseline for this seed: not gated
        ent = out.setdefault((corpus, mode), {"gaps": [], "baselines": 0})
        ent["gaps"].append(loss / statistics.fmean(ref) - 1)
        ent["baselines"] += len(ref)
    return out


def decided(mean: float, sem, runs: int) -> str:
    """Whether the verdict on ``mean`` stands at two standard errors: "pass" when
    mean +- 2 sem lies inside the gate (+-1%), "fail" when it lies wholly outside, else
    "open" with about how many runs in all would decide it at the same spread.

    Why: the verdict is on a mean of a few runs whose pairs spread by +-3% on a corpus; the
    fifty-fifth stop's four torch-sources seeds read +1.32% (a fail), eight read +0.25%."""
    if sem is None:
        return "open: one run"
    dist = GATE - abs(mean)                  # > 0 inside the gate
    if abs(dist) >= 2 * sem:
        return "pass" if dist > 0 else "fail"
    if dist == 0:                            # on the line (sem > 0 here)
        return "open"
    sd = sem * math.sqrt(runs)
    return f"open: ~{math.ceil((2 * sd / abs(dist)) ** 2)} runs"


def verdicts(gaps: Dict[Tuple[str, str], dict]) -> List[dict]:
    rows = []
    for (corpus, mode), ent in sorted(gaps.items()):
        g = ent["gaps"]
        mean = statistics.fmean(g)
        sem = statistics.stdev(g) / math.sqrt(len(g)) if len(g) > 1 else None
        inductor = mode == "inductor"
        rows.append({"corpus": corpus, "mode": mode, "runs": len(g), "gaps": g, "mean": mean,
                     "sem": sem, "pass": None if inductor else abs(mean) <= GATE,
                     "decided": None if inductor else decided(mean, sem, len(g))})
    return rows


def markdown(rows: List[dict]) -> str:
    lines = ["| corpus | mode | runs | gap per run | mean (sem) | within 1% | at 2 sem |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        sem = "" if r["sem"] is None else f" ({r['sem'] * 100:.2f})"
        verdict = "-" if r["pass"] is None else ("yes" if r["pass"] else "**no**")
        lines.append(f"| {r['corpus']} | `{r['mode']}` | {r['runs']} | "
                     + ", ".join(f"{g * 100:+.2f}%" for g in r["gaps"])
                     + f" | {r['mean'] * 100:+.2f}%{sem} | {verdict} | {r['decided'] or '-'} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", help="bench/accuracy.py result JSONs")
    p.add_argument("--baselines-from", nargs="*", default=[],
                   help="result JSONs whose Inductor runs only are used")
    p.add_argument("--md", help="also write the table here")
    a = p.parse_args(argv)

    def load(paths):
        out = []
        for path in paths:
            with open(path) as f:
                out.append(json.load(f))
        return out
    records = runs(load(a.files)) + runs(load(a.baselines_from), only_mode="inductor")
    text = markdown(verdicts(pooled_gaps(records)))
    print(text, end="")
    if a.md:
        with open(a.md, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
