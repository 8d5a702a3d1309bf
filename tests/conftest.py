import os

import pytest
import torch

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
