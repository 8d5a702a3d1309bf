"""Dynamo's source strings as module paths.

Why a module of its own, at the bottom: the site names (``passes/find.py``, ``names.py``)
and the saved-tensor listing (``debug/saved.py``) both read Dynamo's ``nn_module_stack``
strings (``L['self']._modules['blocks']._modules['0'].fc1``), and the debug layer may not
import the passes.
"""
from __future__ import annotations

import re
from typing import Optional, Tuple

_BASE = re.compile(r"""^([LG])\[(['"])(.+?)\2\]\.?""")   # a frame local / global: L['self']


def split_source(raw: str) -> Tuple[Optional[str], str]:
    """Dynamo's ``L['self']._modules['blocks']._modules['0'].fc1`` -> ``("L:self",
    "blocks.0.fc1")``: the frame local (or global) a path starts from, and the path as
    ``named_modules()`` / ``named_parameters()`` spell it; ``(None, path)`` with no base."""
    m = _BASE.match(raw)
    base = f"{m.group(1)}:{m.group(3)}" if m else None
    s = raw[m.end():] if m else raw
    s = re.sub(r"(^|\.)_(?:modules|parameters|buffers)\[['\"]([^'\"]+)['\"]\]", r"\1\2", s)
    s = re.sub(r"\[['\"]([^'\"]+)['\"]\]", r".\1", s)
    s = re.sub(r"\[(\d+)\]", r".\1", s)
    return base, s.strip(".")
