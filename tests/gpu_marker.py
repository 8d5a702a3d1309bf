"""The rule that every GPU test carries the ``gpu`` marker, checked when tests are collected.

Why: the device runs select GPU tests with ``-m gpu``. A test that only has
``skipif(not torch.cuda.is_available())`` (or is named ``test_gpu_*``) without the marker
is skipped in CI, as it should be, and deselected on the GPU machine too, silently: a new
kernel test went unrun that way (H100, 2026-11-27). Collection fails instead, naming it.
"""
import pytest


def needs_gpu_marker(item) -> bool:
    cuda_skip = any("cuda" in str(m.kwargs.get("reason", "")).lower()
                    for m in item.iter_markers("skipif"))
    return (item.name.startswith("test_gpu") or cuda_skip) and \
        item.get_closest_marker("gpu") is None


def check(items) -> None:
    bad = [i.nodeid for i in items if needs_gpu_marker(i)]
    if bad:
        raise pytest.UsageError("GPU tests without @pytest.mark.gpu (-m gpu would not select "
                                "them on the GPU machine): " + ", ".join(bad))
