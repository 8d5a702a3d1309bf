"""Run the property suites (``test_properties.SUITES``) on seeds CI never draws, for as long as
you give it: the CI tests run a fixed, derandomized sample of each suite, so a case outside
that sample is only ever met by a run like this one.

Each case is ``build_case(random.Random(seed), **SUITES[suite])`` checked by
``CHECKS[suite]``, exactly as the suite's test checks its own; one JSON line a case goes to
OUT (suite, seed, ok, the worst relative gradient error, sites rewritten of found, seconds,
and on a failure the message with the generated model's source; ok is null where plain
Inductor cannot compile the model either: ``test_properties.InductorFailsToo``). Replay a failure with

    python -c "import random, test_properties as P; \\
        P.CHECKS['SUITE'](P.build_case(random.Random(SEED), **P.SUITES['SUITE']))"

run from tests/. Two processes on a 2-core machine keep it busy:

    python tests/discover_properties.py spellings,frozen_shared_tied,products 5000 1800 a.jsonl &
    python tests/discover_properties.py autocast,recompute,fp8_forward 7000 1800 b.jsonl &

The fifty-fifth stop's run (2026-12-02, CPU): see docs/BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import traceback

_TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_TESTS, os.path.dirname(_TESTS)]
# what tests/conftest.py sets for every test
os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")
os.environ.setdefault("HOTCOMPILE_CHECK_WRITES", "1")

import torch  # noqa: E402

import test_properties as P  # noqa: E402
from hotcompile.passes import kernel_access  # noqa: E402
from hotcompile.runtime import rank  # noqa: E402
from hotcompile.runtime.lqs import TABLE  # noqa: E402


def run_one(suite: str, seed: int) -> dict:
    """One case of ``suite`` from ``seed``, checked in the state conftest gives a test."""
    case = P.build_case(random.Random(seed), **P.SUITES[suite])
    torch._dynamo.reset()
    TABLE.clear()
    rank.clear()
    kernel_access.MISMATCHES.clear()
    rec, t0 = {"suite": suite, "seed": seed}, time.time()
    try:
        r = P.CHECKS[suite](case)
        assert not kernel_access.MISMATCHES, kernel_access.MISMATCHES
        errs, floored = P.grad_errors(r)       # cancelled gradients counted apart
        rec.update(ok=True, worst_rel=max((e for _, e, _ in errs), default=0.0),
                   floored=len(floored),
                   rewritten=sum(rec_.reason is None for rec_ in r.report.layers),
                   sites=len(r.report.layers))
    except P.InductorFailsToo:                  # torch's bug, not HOT's: recorded apart
        rec.update(ok=None, inductor_fails_too=True)
    except Exception as e:                     # a failed property or a crash: both findings
        msg = str(e)        # its first line names the property; compile logs can run long
        rec.update(ok=False, error=msg if len(msg) <= 6000 else msg[:3000] + "\n...\n" + msg[-3000:],
                   trace=traceback.format_exc()[-2000:])
    rec["s"] = round(time.time() - t0, 1)
    return rec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("suites", help="comma list of " + ",".join(P.SUITES))
    p.add_argument("seed", type=int, help="first seed; each round takes the next")
    p.add_argument("seconds", type=float, help="start no round after this long (one round at least)")
    p.add_argument("out", help="JSON lines, appended")
    a = p.parse_args(argv)
    suites = a.suites.split(",")
    unknown = [s for s in suites if s not in P.SUITES]
    if unknown:
        p.error(f"unknown suite(s) {unknown}: the suites are {list(P.SUITES)}")
    end, seed, failed = time.time() + a.seconds, a.seed, 0
    with open(a.out, "a") as f:
        while True:                             # one round at least
            for suite in suites:
                rec = run_one(suite, seed)
                failed += rec["ok"] is False
                f.write(json.dumps(rec) + "\n")
                f.flush()
            seed += 1
            if time.time() >= end:
                break
    print(f"{seed - a.seed} rounds of {suites}, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
