"""The collection check of ``gpu_marker``: a GPU-only test without the ``gpu`` marker fails
collection, naming it; marked ones and CPU tests pass."""
import pytest

pytest_plugins = ["pytester"]

CONFTEST = """
def pytest_collection_modifyitems(config, items):
    import gpu_marker
    gpu_marker.check(items)
"""


@pytest.mark.parametrize("body,ok", [
    ("import pytest, torch\n@pytest.mark.skipif(not torch.cuda.is_available(), "
     "reason='needs CUDA')\ndef test_kernel():\n    pass\n", False),
    ("def test_gpu_thing():\n    pass\n", False),
    ("import pytest, torch\n@pytest.mark.gpu\n@pytest.mark.skipif(not torch.cuda.is_available(), "
     "reason='needs CUDA')\ndef test_gpu_kernel():\n    pass\n", True),
    ("def test_cpu_thing():\n    pass\n", True),
])
def test_unmarked_gpu_tests_fail_collection(pytester, body, ok):
    pytester.makeconftest(CONFTEST)
    pytester.makeini("[pytest]\nmarkers =\n    gpu: needs a CUDA device\n")
    pytester.makepyfile(test_it=body)
    result = pytester.runpytest_inprocess("--collect-only", "-q")
    out = result.stdout.str() + result.stderr.str()
    if ok:
        assert result.ret == 0, out
    else:
        assert result.ret != 0 and "without @pytest.mark.gpu" in out and "test_it.py::" in out
