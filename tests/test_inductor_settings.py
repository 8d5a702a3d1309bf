"""The Inductor settings HOT's compiles differ by (``inductor_settings.py``): each one off
where the user's environment decides, and the compile workers' static launch of HOT's
kernels set in the workers' environment only."""
import os
import subprocess
import sys
import textwrap

import pytest

import torch

from hotcompile import inductor_settings as S
from hotcompile.inductor_settings import (DYNAMIC_RBLOCK, STATIC_USER_LAUNCH, graph_patches,
                                          other_kernels)

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


@pytest.mark.parametrize("workers_static", [False, True])
def test_a_graph_with_other_kernels_keeps_tritons_launchers(monkeypatch, workers_static):
    """A graph with kernels that are not HOT's never asks for static launches of user
    kernels, and where the workers launch them statically, turns the static launcher off
    for the whole graph (Inductor passes that setting on to the workers)."""
    monkeypatch.delenv(STATIC_USER_LAUNCH, raising=False)
    monkeypatch.delenv(DYNAMIC_RBLOCK, raising=False)
    monkeypatch.setitem(S._STATE, "static_workers", workers_static)
    expected = {"dynamic_scale_rblock": False}
    if workers_static:
        expected["use_static_cuda_launcher"] = False
    assert graph_patches("`k` launches a user-defined Triton kernel") == expected
    assert graph_patches(None)["static_launch_user_defined_triton_kernels"] is True


def _graph(target, nested=False) -> torch.fx.GraphModule:
    g = torch.fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(torch.ops.aten.relu.default, (x,))
    if target is not None and not nested:
        y = g.call_function(target, (y,))
    root = torch.nn.Module()
    if nested:                    # a higher-order op's body: a submodule the graph refers to
        root.body = _graph(target)
        g.get_attr("body")
    g.output(y)
    return torch.fx.GraphModule(root, g)


def _triton_op():
    """A ``triton_op`` (its body need not launch a kernel to be one)."""
    if not hasattr(torch.ops.hotsettingstest, "tri"):
        @torch.library.triton_op("hotsettingstest::tri", mutates_args=())
        def tri(x: torch.Tensor) -> torch.Tensor:
            return x * 3

        tri.register_autograd(lambda ctx, g: g * 3)
    return torch.ops.hotsettingstest.tri


def _custom_op():
    """A custom op of the kind a compiled extension registers: not a ``triton_op``."""
    if not hasattr(torch.ops.hotsettingstest, "twice"):
        @torch.library.custom_op("hotsettingstest::twice", mutates_args=())
        def twice(x: torch.Tensor) -> torch.Tensor:
            return x * 2

        twice.register_fake(lambda x: torch.empty_like(x))
        twice.register_autograd(lambda ctx, g: g * 2)
    return torch.ops.hotsettingstest.twice


def test_other_kernels_finds_user_kernels_and_triton_ops_also_in_subgraphs():
    from torch._higher_order_ops.triton_kernel_wrap import (triton_kernel_wrapper_functional,
                                                            triton_kernel_wrapper_mutation)
    import torch._library.triton as triton_ops
    for plain in (None, torch.ops.aten.sin.default, torch.ops.prims.sin.default):
        assert other_kernels(_graph(plain)) is None
    for target in (triton_kernel_wrapper_mutation, triton_kernel_wrapper_functional):
        for nested in (False, True):
            why = other_kernels(_graph(target, nested))
            assert why and "user-defined Triton kernel" in why, (target, nested, why)
    tri = _triton_op()
    for target in (tri, tri.default):
        why = other_kernels(_graph(target, nested=True))
        assert why and "`hotsettingstest::tri`" in why, why
    custom = _custom_op()
    listed = hasattr(triton_ops, "triton_ops_to_kernels")  # else every custom op may be one
    for target in (custom, custom.default):
        assert (other_kernels(_graph(target)) is None) == listed


def test_the_backend_passes_a_triton_op_graph_as_one_with_other_kernels(monkeypatch):
    """End to end on the CPU: a model calling a ``triton_op`` compiles with
    ``graph_patches(<why>)``; one calling a plain custom op, or neither, with
    ``graph_patches(None)`` (where torch lists its ``triton_op``s)."""
    import hotcompile
    import torch._library.triton as triton_ops
    from hotcompile import entry as E
    tri, twice = _triton_op(), _custom_op()
    seen = []
    real = E.graph_patches
    monkeypatch.setattr(E, "graph_patches", lambda other=None: seen.append(other) or real(other))
    lin = torch.nn.Linear(8, 8)
    for fn in (lambda x: lin(x).relu(), lambda x: twice(lin(x)), lambda x: tri(lin(x))):
        torch._dynamo.reset()
        torch.compile(fn, backend=hotcompile.backend())(torch.randn(4, 8)).sum().backward()
    assert len(seen) == 3 and seen[0] is None and "hotsettingstest::tri" in seen[2], seen
    assert (seen[1] is None) == hasattr(triton_ops, "triton_ops_to_kernels"), seen


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
    static = start_compile_workers(static=case != "other")
    here = os.environ.get(STATIC_USER_LAUNCH)
    pool = AsyncCompile.process_pool()
    there = pool.submit(os.getenv, STATIC_USER_LAUNCH).result(timeout=300)
    config = pool.submit(eval, "__import__('torch._inductor.config', fromlist=['c'])"
                         ".static_launch_user_defined_triton_kernels").result(timeout=300)
    assert config == (there == "1"), (there, config)     # what the workers' Inductor reads
    print("RESULT", static, here, there)
""")


@pytest.mark.parametrize("case, expected", [
    ("fresh", "True None 1"),          # the workers launch statically; this process unchanged
    ("started", "False None None"),    # workers already running: left as they are
    ("user0", "False 0 0"),            # the user's choice stands
    ("other", "False None None"),      # the first graph has kernels of its own
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
    from hotcompile.inductor_settings import start_compile_workers
    from torch._inductor.async_compile import AsyncCompile
    if sys.argv[3] == "workers":   # kernels compiled by the workers, not in this process
        start_compile_workers()
        AsyncCompile.wait_pool_ready()
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
        # deterministic: no benchmark-picked reduction configs, which could differ between
        # the two processes and change bits that the launcher does not
        env = dict(os.environ, TORCHINDUCTOR_DETERMINISTIC="1",
                   TORCHINDUCTOR_CACHE_DIR=str(tmp_path / f"cache{var}"),
                   TRITON_CACHE_DIR=str(tmp_path / f"triton{var}"), PYTHONPATH=os.pathsep.join(
                       [ROOT, os.environ.get("PYTHONPATH", "")]))
        env.pop(STATIC_USER_LAUNCH, None)
        if var:
            env[STATIC_USER_LAUNCH] = var
        out = str(tmp_path / f"grads{var}.pt")
        proc = subprocess.run([sys.executable, "-c", _GPU_STEP, out, os.path.join(ROOT, "tests"),
                               "workers"],
                              env=env, timeout=600, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("USER ")]
        assert proc.returncode == 0 and lines, proc.stdout[-3000:]
        seen[var] = dict(eval(lines[-1][5:]))
        grads[var] = torch.load(out)
    print(seen)
    hot = {"_hla_kernel", "_hq_token_kernel", "_weight_operands_kernel", "_weight_cast_kernel",
           "_block_bound_kernel"}
    assert hot <= set(seen[""]) and all(seen[""].values()), seen
    assert hot <= set(seen["0"]) and not any(seen["0"].values()), seen
    for a, b in zip(grads[""], grads["0"]):
        assert torch.equal(a, b)


def _fixture_kernels(which):
    """``(statement, right-hand side)`` of each HOT kernel's definition in Inductor's output
    code for Llama d4096 on the H200 (``tests/data``), as the wrapper wrote them."""
    import gzip
    import re
    path = os.path.join(ROOT, "tests", "data", f"output_code_llama_d4096_hot_{which}_h200.py.gz")
    with gzip.open(path, "rt") as f:
        text = f.read()
    found = re.findall(r"^(\w+ = (async_compile\.triton\('_(?:hla|hq|weight|block)\w*', '''.*?"
                       r"''', device_str='cuda'\)))$", text, re.S | re.M)
    assert found
    return found


@pytest.mark.parametrize("which", ["forward", "backward"])
def test_a_kernel_definition_reads_back_as_the_source_its_module_compiles(which):
    """``_kernel_source`` gives the name, source and device the compiled module's own
    ``async_compile.triton`` call will receive (so the early submission is found by its
    source when the module loads): checked on every HOT kernel of a real output code,
    escapes included."""
    for statement, rhs in _fixture_kernels(which):
        seen = []

        class Recorder:
            def triton(self, *args, **kwargs):
                seen.append((*args, kwargs.get("device_str")))

        exec(compile(statement, "<module>", "exec"), {"async_compile": Recorder()})
        assert S._kernel_source(rhs) == seen[0]
    assert S._kernel_source("x = 1") is None
    assert S._kernel_source("async_compile.triton(name, src)") is None
    assert S._kernel_source("not python (") is None


def test_user_kernels_are_submitted_when_the_wrapper_defines_them(monkeypatch):
    """Inside ``early_kernel_compiles()`` a user kernel the Python wrapper defines goes to the
    compile workers at once (when they are ready) with the source its module will ask for;
    the wrapper still gets the definition; nothing is submitted without ready workers or
    under a C++ wrapper; the method is restored when the outermost block ends."""
    from torch._inductor import config
    from torch._inductor.async_compile import AsyncCompile
    from torch._inductor.codegen.wrapper import PythonWrapperCodegen
    statement, rhs = _fixture_kernels("backward")[0]
    submitted, defined = [], []
    ready = {"on": True}
    monkeypatch.setattr(AsyncCompile, "use_process_pool", classmethod(lambda c: ready["on"]))
    monkeypatch.setattr(AsyncCompile, "triton",
                        lambda self, n, src, device_str="cuda": submitted.append((n, src)))
    monkeypatch.setattr(PythonWrapperCodegen, "define_kernel",
                        lambda self, kernel_name, kernel_body, metadata=None, gpu=True:
                        defined.append(kernel_name))
    def define_user_defined_triton_kernel(self, kernel):
        if kernel == "by keyword":
            return self.define_kernel(kernel_name="_k_0", kernel_body=rhs, metadata="# meta")
        return self.define_kernel("_k_0", rhs, "# meta")

    monkeypatch.setattr(PythonWrapperCodegen, "define_user_defined_triton_kernel",
                        define_user_defined_triton_kernel)
    original = PythonWrapperCodegen.define_user_defined_triton_kernel
    wrapper = PythonWrapperCodegen.__new__(PythonWrapperCodegen)
    with S.early_kernel_compiles():
        with S.early_kernel_compiles():
            assert PythonWrapperCodegen.define_user_defined_triton_kernel is not original
        assert PythonWrapperCodegen.define_user_defined_triton_kernel is not original
        wrapper.define_user_defined_triton_kernel(None)
        assert defined == ["_k_0"] and submitted == [S._kernel_source(rhs)[:2]]
        assert "define_kernel" not in vars(wrapper)               # the capture is undone
        ready["on"] = False
        wrapper.define_user_defined_triton_kernel(None)
        ready["on"] = True
        with config.patch(cpp_wrapper=True):     # (monkeypatch would delete the entry)
            wrapper.define_user_defined_triton_kernel(None)
        assert len(defined) == 3 and len(submitted) == 1
        wrapper.define_user_defined_triton_kernel("by keyword")      # keywords captured too
        assert len(defined) == 4 and len(submitted) == 2
        own = []                                # an instance's own define_kernel is kept

        def mine(*a, **k):
            own.append(a[0])

        wrapper.define_kernel = mine
        wrapper.define_user_defined_triton_kernel(None)
        assert own == ["_k_0"] and len(submitted) == 3
        assert vars(wrapper)["define_kernel"] is mine
        del wrapper.define_kernel
    assert PythonWrapperCodegen.define_user_defined_triton_kernel is original
    wrapper.define_user_defined_triton_kernel(None)
    assert len(defined) == 5 and len(submitted) == 3


def test_a_scoped_patch_nests_and_restores_after_an_error():
    """``ScopedPatch``: installed once by the outermost block, restored when the last one
    ends, an exception included; an owner without the attribute is left as it is."""
    import types
    from hotcompile.scoped_patch import ScopedPatch
    owner = types.SimpleNamespace(f=lambda: "original")
    original, built = owner.f, []
    patch = ScopedPatch("f", lambda orig: built.append(orig) or (lambda: "patched " + orig()))
    with pytest.raises(RuntimeError):
        with patch.active(owner):
            with patch.active(owner):
                assert owner.f() == "patched original"
            assert owner.f() == "patched original"
            raise RuntimeError("a compile failed")
    assert owner.f is original and built == [original] and patch.depth == 0
    bare = types.SimpleNamespace()
    with patch.active(bare):
        assert not hasattr(bare, "f")
    assert owner.f is original and patch.depth == 0
