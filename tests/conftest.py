import os

# Inductor's CPU kernels as scalar C++ (set before torch is imported: Inductor reads it when
# its config loads; child processes inherit it). Why: the CPU suite is compile-bound, and
# g++ on the vectorized (at::vec) kernels is the largest part of it. One hypothesis suite
# on 2 cores (test_properties.py::test_recompute_operands, cold caches): 121 s vectorized,
# 92 s scalar; about half of the rest is Dynamo, AOTAutograd, the pass and Inductor's own
# Python (cProfile, 2026-11-30). What the CPU suite checks (the pass's rewrites, the
# reference twins, gradients against eager) does not depend on Inductor's vector ISA;
# ``TORCHINDUCTOR_VEC_ISA_OK=1`` restores it.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")
# every kernel launch with declared writes is also analysed, and a differing declaration
# raises (hotcompile/passes/kernel_access.py) and fails the test (_declared_writes_agree)
os.environ.setdefault("HOTCOMPILE_CHECK_WRITES", "1")


@pytest.fixture(autouse=True)
def _declared_writes_agree():
    """A kernel's declared writes that differ from Triton's analysis fail the test that met
    them, wherever the splicing pass caught the raise and kept the op."""
    from hotcompile.passes import kernel_access as KA
    KA.MISMATCHES.clear()
    yield
    found, KA.MISMATCHES[:] = list(KA.MISMATCHES), []
    assert not found, found


@pytest.fixture(autouse=True)
def _fresh_state():
    """Each test starts with empty Dynamo caches and an empty LQS table."""
    from hotcompile.runtime.lqs import TABLE
    from hotcompile.runtime import rank
    torch._dynamo.reset()
    TABLE.clear()
    rank.clear()
    yield
    torch._dynamo.reset()
    TABLE.clear()
    rank.clear()


def pytest_collection_modifyitems(config, items):
    """Checks the GPU markers, then runs the ``slow`` tests first (in collection order, the
    others after them). Why: with ``-n 2 --dist worksteal`` (README) a worker that runs out
    steals from the other's queue, so the suite ends when its last test does; a 2-9 minute
    test met late (the interpreter suite, a hypothesis suite) left the other worker idle
    for its length, started first it overlaps the short ones."""
    import gpu_marker
    gpu_marker.check(items)
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
