"""What a compile-cache hit must still give: the pass's report and its run-time registrations.

Why: the joint pass is a ``CustomGraphPass`` whose ``uuid()`` covers hotcompile's code and
the config, so Inductor's FX graph cache and AOTAutograd's cache key on it and serve a
second process (or a second compile of the same graph) without re-running the pass. A
cache hit therefore runs no pass at all: no site records, no LQS / rank registrations.
So each run of the pass stores them here, beside Inductor's own cache, under a key made of
what determines the joint graph (the Dynamo graph's code, the example inputs' metadata,
the torch version and the pass's uuid); a compile whose pass did not run loads them back.

A record is plain JSON (``SiteRecord`` fields; symbolic sizes as text). Writes go through a
temporary file and ``os.replace`` so concurrent ranks never read half a file.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import tempfile
from typing import List, Optional

import torch

_FORMAT = 1


@functools.lru_cache(maxsize=1)
def code_hash() -> str:
    """Hash of every source file of the package: any code change changes the pass's uuid."""
    root = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256()
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                h.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


def _describe(v) -> str:
    if isinstance(v, torch.Tensor):
        return (f"T({tuple(str(d) for d in v.shape)},{tuple(str(s) for s in v.stride())},"
                f"{v.dtype},{v.device.type},{v.requires_grad},"
                f"{isinstance(v, torch.nn.Parameter)})")
    return f"{type(v).__name__}({v})" if isinstance(v, (int, float, bool, torch.SymInt)) \
        else type(v).__name__


def _gpus(example_inputs: List) -> str:
    """The GPUs a graph's inputs live on, by name and compute capability. Why: the pass
    decides by the chip (its cost table, ``forward="auto"``, ``gw_format="auto"``), a cache
    folder can be shared by machines with different GPUs, and Inductor keys its own cache
    on the GPU: without this, a hit on one chip could load the records another wrote."""
    names = set()
    for d in {v.device for v in example_inputs
              if isinstance(v, torch.Tensor) and v.device.type == "cuda"}:
        try:
            names.add(f"{torch.cuda.get_device_name(d)} "
                      f"{tuple(torch.cuda.get_device_capability(d))}")
        except Exception:  # noqa: BLE001 - no driver (fake CUDA tensors in CPU tests)
            names.add("cuda")
    return ",".join(sorted(names))


def graph_key(gm: torch.fx.GraphModule, example_inputs: List, pass_uuid: str) -> str:
    """Key of the records of one Dynamo graph compiled by one pass configuration on one
    kind of GPU (``_gpus``)."""
    h = hashlib.sha256()
    for part in (str(_FORMAT), torch.__version__, pass_uuid, gm.code,
                 "|".join(_describe(v) for v in example_inputs), _gpus(example_inputs)):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def _folder() -> str:
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
        base = cache_dir()
    except Exception:  # noqa: BLE001 - older layouts: Inductor's default location
        base = os.path.join(tempfile.gettempdir(), "torchinductor_" + os.environ.get("USER", "u"))
    return os.path.join(base, "hotcompile")


def _plain(v):
    return v if v is None or isinstance(v, (int, float, str, bool)) else str(v)


def save(key: str, records: list, registrations: dict, saved: Optional[dict] = None) -> None:
    """Store one pass run's records (``SiteRecord``s) and registrations under ``key``, and
    what the partition did to the kept activations (``saved``) once it has run."""
    rows = []
    for r in records:
        d = dataclasses.asdict(r)
        d.pop("graph", None)
        for f in ("L", "I", "O", "rank"):
            d[f] = _plain(d[f])
        if d.get("rank_errors"):
            d["rank_errors"] = {str(k): v for k, v in d["rank_errors"].items()}
        rows.append(d)
    payload = {"format": _FORMAT, "records": rows, "registrations": registrations,
               "saved": saved}
    folder = _folder()
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f)
        os.replace(tmp, os.path.join(folder, key + ".json"))
    except OSError:
        pass   # a read-only cache folder: the next cache hit reports that records are missing


def load(key: str) -> Optional[dict]:
    """The stored payload of ``key`` (records as dicts), or None."""
    try:
        with open(os.path.join(_folder(), key + ".json")) as f:
            payload = json.load(f)
    except (OSError, ValueError):
        return None
    if payload.get("format") != _FORMAT:
        return None
    for d in payload["records"]:
        if d.get("rank_errors"):
            d["rank_errors"] = {int(k): v for k, v in d["rank_errors"].items()}
    return payload
