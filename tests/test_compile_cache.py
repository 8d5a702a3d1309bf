"""The pass is a CustomGraphPass: Inductor's FX/AOT caches serve a second process, and a
cache hit still gives the full report and run-time registrations (issue 11, item 4)."""
import json
import os
import subprocess
import sys

import pytest
import torch

import hotcompile
from hotcompile import HOTConfig
from hotcompile.entry import JointPass
from hotcompile.debug.report import Report

HERE = os.path.dirname(__file__)


def _run(which: str, cache: str, out: str, *extra: str) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TORCHINDUCTOR_FX_GRAPH_CACHE="1",
               TORCHINDUCTOR_AUTOGRAD_CACHE="1", PYTHONPATH=os.pathsep.join(
                   [os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, os.path.join(HERE, "cache_worker.py"), which, out, *extra],
                   env=env, check=True, timeout=900)
    with open(out) as f:
        return json.load(f)


def _load(r: dict) -> float:
    """Compile (or cache load) time: the first step minus a steady step (on CPU hot's ops
    run as the torch reference, slower than the exact GEMMs: not what the cache is about)."""
    return r["seconds"] - r["steady"]


@pytest.mark.slow     # ten processes, one compile each: ~2 min on 2 cores
def test_second_process_hits_the_cache_with_the_full_report(tmp_path):
    t = {}
    # two cold compiles per backend, each on a cache folder of its own, in the order hot,
    # inductor, inductor, hot, the faster of each kept: with the suite in two workers the
    # other worker's heaviest tests fell on one cold process (hot 17.8 s against Inductor's
    # 11.6 s in one CI run of cab8db7; 12.1 against 12.4 s with the test alone)
    cold_runs = {"hot": [], "inductor": []}
    for i, which in enumerate(("hot", "inductor", "inductor", "hot")):
        folder = str(tmp_path / which) if i < 2 else str(tmp_path / f"{which}2")
        cold_runs[which].append(_run(which, folder, str(tmp_path / f"{which}cold{i}")))
    for which, runs in cold_runs.items():
        t[which, "cold"] = min(runs, key=_load)
    # the warm processes three times, interleaved, the fastest of each kept: the sub-second
    # loads are compared, and with the suite in two workers (README) the other worker's
    # load fell on one of them (hot 0.83 s against Inductor's 0.36 s in one CI run, while
    # a run before measured them level)
    warm_runs = {"hot": [], "inductor": []}
    for i in range(3):
        for which in warm_runs:
            warm_runs[which].append(_run(which, str(tmp_path / which),
                                         str(tmp_path / f"{which}warm{i}")))
    for which, runs in warm_runs.items():
        t[which, "warm"] = min(runs, key=_load)
    cold, warm = t["hot", "cold"], t["hot", "warm"]
    sec = {k: v["seconds"] for k, v in t.items()}
    load = {k: _load(v) for k, v in t.items()}
    print("first step (s): " + ", ".join(f"{a} {b} {v:.2f}" for (a, b), v in sec.items())
          + "; minus a steady step: " + ", ".join(f"{a} {b} {v:.2f}" for (a, b), v in load.items()))
    assert len(cold["report"]) == 16 and all(r["reason"] is None for r in cold["report"])
    assert all(c["report"] == cold["report"] for c in cold_runs["hot"])
    for w in warm_runs["hot"]:                           # the full report from the store
        assert w["report"] == cold["report"]
        assert w["lqs_keys"] == cold["lqs_keys"] and w["lqs_keys"]
        assert not w["notes"], w["notes"]
    # the warm process really hit the cache (a cold hot compile costs several times this)
    assert sec["hot", "warm"] < 0.5 * sec["hot", "cold"], sec
    # acceptance: warm first step <= 1.5x Inductor's, first compile <= 1.5x Inductor's
    # (+0.1 s: scheduling noise of a 2-core box at sub-second times)
    assert load["hot", "warm"] <= 1.5 * load["inductor", "warm"] + 0.1, load
    assert load["hot", "cold"] <= 1.5 * load["inductor", "cold"], load


def test_saved_activations_fp8_partition_is_served_from_the_cache(tmp_path):
    """With ``saved_activations="fp8"`` the partition is HOT's own (a custom partitioner):
    a second process still loads the compiled graphs (the pass does not run) and reports
    what the compression did from hotcompile's store."""
    cache = str(tmp_path / "c")
    cold = _run("hot", cache, str(tmp_path / "cold"), "fp8")
    warm = _run("hot", cache, str(tmp_path / "warm"), "fp8")
    assert cold["pass_runs"] >= 1 and warm["pass_runs"] == 0, (cold, warm)
    assert cold["saved"] and warm["saved"] == cold["saved"]
    (d,) = cold["saved"].values()
    assert d["compressed"] >= 2 and d["bytes_after"] < d["bytes_before"], d
    assert warm["report"] == cold["report"]


def _uuid(**kw) -> str:
    cfg = HOTConfig(**kw)
    return JointPass(cfg, Report(), 0, {0, 1}).uuid()


def test_uuid_covers_config_and_parameters_but_not_the_dump_folder():
    base = _uuid()
    assert base == _uuid()
    assert base != _uuid(rank=8)
    assert base != _uuid(gx_bits=8)
    assert base == _uuid(dump_dir="/tmp/somewhere")
    assert base != JointPass(HOTConfig(), Report(), 0, {0}).uuid()


def test_a_second_backend_in_process_never_reuses_the_first_ones_graph(monkeypatch, tmp_path):
    """The rewritten graph names its run-time entries after its backend and graph; a cache
    hit across two backends of one process would make them share LQS/rank state. Their
    uuids differ, so the second compile runs the pass and gets its own keys."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    # config.patch, not monkeypatch: Torch's config modules do not survive a setattr undo
    with torch._functorch.config.patch(enable_autograd_cache=True), \
            torch._inductor.config.patch(fx_graph_cache=True):
        _two_backends(monkeypatch)


def _two_backends(monkeypatch):
    from cache_worker import MLP
    cfg = HOTConfig(min_features=0, kernels="reference")
    ran, keys = [], []
    orig = JointPass.__call__

    def spy(self, graph):
        ran.append(1)
        return orig(self, graph)
    monkeypatch.setattr(JointPass, "__call__", spy)
    for _ in range(2):
        torch._dynamo.reset()
        torch.manual_seed(0)
        be = hotcompile.backend(cfg)
        before = set(hotcompile.runtime.lqs.TABLE.sites)
        torch.compile(MLP(d=64, depth=2), backend=be)(torch.randn(2, 32, 64)).sum().backward()
        keys.append(set(hotcompile.runtime.lqs.TABLE.sites) - before)
        assert len(be.report.rewritten) == 4
    assert len(ran) == 2
    assert len(keys[0]) == len(keys[1]) == 4 and not keys[0] & keys[1]


def test_record_key_names_the_gpu(monkeypatch):
    """The records' key covers the GPU the graph's inputs are on (name and capability):
    the pass decides by the chip (``forward="auto"``, the cost table), and a cache folder
    shared by two machines must not serve one chip's records to the other. CPU inputs and
    inputs on an unnamed device keep a key of their own."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from hotcompile import compile_cache
    gm = torch.fx.symbolic_trace(lambda x: x * 2)
    with FakeTensorMode():
        x = torch.empty(4, 8, device="cuda")
    keys = {}
    for name, cap in (("NVIDIA H100 80GB HBM3", (9, 0)), ("NVIDIA H200", (9, 0)),
                      ("NVIDIA A100-SXM4-80GB", (8, 0))):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None, n=name: n)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None, c=cap: c)
        keys[name] = compile_cache.graph_key(gm, [x], "uuid")
        assert keys[name] == compile_cache.graph_key(gm, [x], "uuid")     # stable
    assert len(set(keys.values())) == 3, keys
    cpu = compile_cache.graph_key(gm, [torch.empty(4, 8)], "uuid")
    assert cpu not in keys.values()
