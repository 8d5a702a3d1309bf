"""Set-up shared by the Triton kernel test modules (CPU interpreter or GPU).

Why a module: the interpreter must be chosen before ``triton.language`` is first imported
(its library functions, ``tl.max`` and co., are decorated at import time). A kernel test
module calls ``choose_interpreter()`` before importing the kernels; if another module had
imported triton in compiled mode first, its CPU tests re-run in a fresh process through the
test ``subprocess_suite(__file__, ...)`` returns.
"""
import os
import subprocess
import sys

import pytest
import torch


def choose_interpreter() -> None:
    """TRITON_INTERPRET=1 on a CPU-only machine, unless triton.language was imported already
    (compiled): then the variable would no longer make the kernels interpreted, but Triton
    reads it live in places (``constexpr_function``), and set process-wide it broke every
    later test that traces compiled kernels (test_splice after this module's collection)."""
    if not torch.cuda.is_available() and "triton.language" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"


def interpreted(kernel) -> bool:
    """Whether ``kernel`` and triton's own library functions run under the interpreter."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(kernel, InterpretedFunction) and isinstance(tl.standard.max,
                                                                  InterpretedFunction)


def cpu_mark(is_interpreted: bool):
    return pytest.mark.skipif(
        torch.cuda.is_available() or not is_interpreted,
        reason="interpreter tests: CPU-only machine, triton imported after "
               "TRITON_INTERPRET=1 (else see test_interpreter_suite_in_subprocess)")


def subprocess_suite(path: str, is_interpreted: bool):
    """A test that re-runs the module at ``path`` in a child with TRITON_INTERPRET=1."""
    @pytest.mark.slow     # the whole module interpreted: 2-9 min on 2 cores
    @pytest.mark.skipif(torch.cuda.is_available() or is_interpreted
                        or os.environ.get("HOT_KERNEL_TESTS_CHILD") == "1",
                        reason="the interpreter tests run in this process")
    def test_interpreter_suite_in_subprocess():
        _rerun(path, dict(os.environ, TRITON_INTERPRET="1", HOT_KERNEL_TESTS_CHILD="1"))
    return test_interpreter_suite_in_subprocess


def _rerun(path: str, env: dict) -> None:
    """Run the test module at ``path`` in a child pytest with ``env``; fail with its output."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           os.path.abspath(path)], cwd=root, env=env, capture_output=True,
                          text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]


def compiled_mark(is_interpreted: bool):
    """For tests that trace the kernels (``wrap_triton`` needs compiled-mode ``JITFunction``s):
    skipped where an earlier module imported triton under the interpreter."""
    return pytest.mark.skipif(is_interpreted, reason="triton was imported under the "
                              "interpreter (see test_compiled_suite_in_subprocess)")


def compiled_subprocess_suite(path: str, is_interpreted: bool):
    """A test that re-runs the module at ``path`` in a child with triton in compiled mode."""
    @pytest.mark.slow
    @pytest.mark.skipif(not is_interpreted, reason="the tests run in this process")
    def test_compiled_suite_in_subprocess():
        _rerun(path, {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    return test_compiled_suite_in_subprocess

