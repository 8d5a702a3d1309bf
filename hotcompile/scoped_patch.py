"""An attribute of torch's replaced while any block that asks for it runs, then put back.

Why one helper: HOT changes two of Inductor's steps for its own compiles only
(``inductor_settings.early_kernel_compiles``, ``kernel_nodes.traceless_kernel_decomposition``).
Compiles nest (AOTAutograd compiles a backward lazily, inside a later call) and may run on
more than one thread, so the replacement is installed by the outermost block, counted under
a lock, and the original is restored when the last block ends, exceptions included.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable


class ScopedPatch:
    """``owner.<name>`` replaced by ``build(original)`` while an ``active(owner)`` block runs
    (re-entrant, thread-safe); where ``owner`` has no such attribute, nothing changes."""

    def __init__(self, name: str, build: Callable[[Any], Any]):
        self.name, self.build = name, build
        self.depth, self.owner, self.original = 0, None, None
        self.lock = threading.Lock()

    @contextlib.contextmanager
    def active(self, owner):
        with self.lock:
            if self.depth == 0:
                original = getattr(owner, self.name, None)
                if original is not None:
                    self.owner, self.original = owner, original
                    setattr(owner, self.name, self.build(original))
            self.depth += 1
        try:
            yield
        finally:
            with self.lock:
                self.depth -= 1
                if self.depth == 0 and self.original is not None:
                    setattr(self.owner, self.name, self.original)
                    self.owner = self.original = None
