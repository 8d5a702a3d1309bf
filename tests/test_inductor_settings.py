"""The Inductor settings HOT's compiles differ by (``inductor_settings.py``): each one off
where the user's environment decides, and the compile workers' static launch of HOT's
kernels set in the workers' environment only."""
import os
import subprocess
import sys
import textwrap

import pytest

from hotcompile.inductor_settings import (DYNAMIC_RBLOCK, STATIC_USER_LAUNCH, graph_patches)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("env", [None, "0", "1"])
def test_graph_patches_leave_each_setting_to_the_environment_that_names_it(monkeypatch, env):
    for var in (DYNAMIC_RBLOCK, STATIC_USER_LAUNCH):
        if env is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, env)
    expected = {} if env is not None else {"dynamic_scale_rblock": False,
                                           "static_launch_user_defined_triton_kernels": True}
    assert graph_patches() == expected
    monkeypatch.setenv(DYNAMIC_RBLOCK, "1")                 # one set, the other not
    if env is None:
        assert graph_patches() == {"static_launch_user_defined_triton_kernels": True}


# A fresh process (the workers are per process): start them as the case says, then ask a
# worker what it read from its environment.
_PROBE = textwrap.dedent("""
    import os, sys
    from torch._inductor.async_compile import AsyncCompile, maybe_warm_pool
    from hotcompile.inductor_settings import STATIC_USER_LAUNCH, start_compile_workers
    case = sys.argv[1]
    if case == "user0":
        os.environ[STATIC_USER_LAUNCH] = "0"
    if case == "started":                   # something compiled before HOT's first graph
        maybe_warm_pool()
    static = start_compile_workers()
    here = os.environ.get(STATIC_USER_LAUNCH)
    there = AsyncCompile.process_pool().submit(os.getenv, STATIC_USER_LAUNCH).result(timeout=300)
    print("RESULT", static, here, there)
""")


@pytest.mark.parametrize("case, expected", [
    ("fresh", "True None 1"),          # the workers launch statically; this process unchanged
    ("started", "False None None"),    # workers already running: left as they are
    ("user0", "False 0 0"),            # the user's choice stands
])
def test_compile_workers_start_with_static_launches_in_their_environment_only(case, expected):
    env = dict(os.environ, TORCHINDUCTOR_COMPILE_THREADS="2", PYTHONPATH=os.pathsep.join(
        [ROOT, os.environ.get("PYTHONPATH", "")]))
    for var in (STATIC_USER_LAUNCH, "TORCH_WARM_POOL"):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, "-c", _PROBE, case], env=env, timeout=600,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:]
    assert lines[-1] == f"RESULT {expected}", proc.stdout[-3000:]


# A cold compile of a HOT block on the GPU in a fresh process and cache: how each of HOT's
# kernels (Inductor's user-defined ones) is launched, and the gradients.
_GPU_STEP = textwrap.dedent("""
    import sys, torch, hotcompile
    from hotcompile import HOTConfig
    from torch._inductor.codecache import PyCodeCache
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner, HeuristicType
    sys.path.insert(0, sys.argv[2])
    from helpers import Block
    torch.manual_seed(0)
    model = Block(d=256, heads=4).cuda()
    x = torch.randn(8, 256, 256, device="cuda", requires_grad=True)
    be = hotcompile.backend(HOTConfig(min_features=0, min_speedup=0, exclude=()))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = torch.compile(model, backend=be)(x)
    torch.manual_seed(1)
    out.float().square().mean().backward()
    assert len(be.report.rewritten) == 4, be.report
    user = {}
    for mod in list(PyCodeCache.modules):
        for k in vars(mod).values():
            if isinstance(k, CachingAutotuner) and k.heuristic_type == HeuristicType.USER_AUTOTUNE:
                user[k.fn.__name__] = user.get(k.fn.__name__, True) and k.is_statically_launchable()
    torch.save([x.grad] + [p.grad for p in model.parameters()], sys.argv[1])
    print("USER", sorted(user.items()))
""")


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_hot_kernels_launch_statically_from_a_cold_compile_with_the_same_gradients(tmp_path):
    """Every HOT kernel of a cold compile launches through Inductor's static launcher (no
    C compiler run for its launcher), and the gradients are bit-identical to Triton's
    launcher's (the user's ``=0``), each in a fresh process on an empty cache."""
    import torch
    grads, seen = {}, {}
    for var in ("", "0"):
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / f"cache{var}"),
                   TRITON_CACHE_DIR=str(tmp_path / f"triton{var}"), PYTHONPATH=os.pathsep.join(
                       [ROOT, os.environ.get("PYTHONPATH", "")]))
        env.pop(STATIC_USER_LAUNCH, None)
        if var:
            env[STATIC_USER_LAUNCH] = var
        out = str(tmp_path / f"grads{var}.pt")
        proc = subprocess.run([sys.executable, "-c", _GPU_STEP, out, os.path.join(ROOT, "tests")],
                              env=env, timeout=600, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("USER ")]
        assert proc.returncode == 0 and lines, proc.stdout[-3000:]
        seen[var] = dict(eval(lines[-1][5:]))
        grads[var] = torch.load(out)
    print(seen)
    hot = {"_hla_kernel", "_hq_token_kernel", "_hq_weight_kernel", "_weight_cast_kernel",
           "_block_bound_kernel"}
    assert hot <= set(seen[""]) and all(seen[""].values()), seen
    assert hot <= set(seen["0"]) and not any(seen["0"].values()), seen
    for a, b in zip(grads[""], grads["0"]):
        assert torch.equal(a, b)
