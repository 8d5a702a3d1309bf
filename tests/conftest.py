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
    import gpu_marker
    gpu_marker.check(items)
