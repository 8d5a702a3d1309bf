"""Layer names from the user's own module, whatever the graph breaks.

Why this is not just Dynamo's module stack: Dynamo names everything relative to the frame
it compiles (``L['self']``). After a graph break inside a child module's forward, the frame
is the child's, and ``blocks.0.attn.qkv`` arrives as ``qkv``; a functional call
(``nn.MultiheadAttention``'s in/out projections) names only the calling module. The
backend knows more than Dynamo's strings: the real parameter tensors (the example inputs)
and, through the Python stack, the module the user compiled. A parameter found in that
root by identity has its fully qualified name; its Dynamo source path
(``L['self']._modules['qkv']._parameters['weight']``) is a suffix of that name, and what
is left is the frame local's prefix in the root (``blocks.0.attn``), which also fixes the
module names Dynamo's stack gives relative to that local. ``passes/find.py`` turns these
into site names (``Naming``); a compiled function (no root module) keeps Dynamo's names.

Dynamo reuses a compiled graph for every module whose code and guards match (the frame
after a graph break inside ``blocks[0]`` runs ``blocks[1]`` too): the names given at
compile time are ``blocks.0``'s. ``SharedGraphNames`` watches the parameters a compiled
graph is called with and, the first time it runs for another module of the root, adds
that module's rows to the report (what runs there is the graph compiled for the first).

Only APIs present in torch 2.11 and 2.13: ``sys._getframe``, ``OptimizedModule._orig_mod``,
``nn.Module._compiled_call_impl`` and ``named_parameters``; Dynamo's graph-input sources
(``node.meta["grapharg"].source.name``, a method on 2.11 and a property on 2.13).
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import sys
import weakref
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch

from .debug.sources import split_source
from .passes.find import Naming

log = logging.getLogger("hotcompile")

_CALL_FRAMES = ("__call__", "_call_impl", "_wrapped_call_impl")
_MAX_SEEN = 64       # distinct parameter sets a graph is watched for (then it stops looking)

Slot = Tuple[int, str, str]   # (graph input index, source base, path from the base)


def source_name(node: Optional[torch.fx.Node]) -> Optional[str]:
    """Dynamo's source of a graph input (``L['self']._modules['fc1']._parameters['weight']``)."""
    arg = node.meta.get("grapharg") if node is not None else None
    name = getattr(getattr(arg, "source", None), "name", None)
    name = name() if callable(name) else name      # a method on 2.11, a property on 2.13
    return name if isinstance(name, str) else None


def compiled_root() -> Optional[torch.nn.Module]:
    """The module the user compiled, found on the Python stack while Dynamo compiles one of
    its frames: the innermost ``OptimizedModule`` (``torch.compile(model)``: its
    ``_orig_mod``) or module whose ``.compile()`` was called (``_compiled_call_impl``
    set), among the frames of ``nn.Module.__call__``. None for a compiled function."""
    from torch._dynamo.eval_frame import OptimizedModule
    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_name in _CALL_FRAMES:
            obj = f.f_locals.get("self")
            if isinstance(obj, OptimizedModule):
                return getattr(obj, "_orig_mod", None)
            if (isinstance(obj, torch.nn.Module)
                    and getattr(obj, "_compiled_call_impl", None) is not None):
                return obj
        f = f.f_back
    return None


def fqn_index(root: Optional[torch.nn.Module]) -> Dict[int, List[str]]:
    """id(parameter) -> every FQN it has in ``root`` (tied weights have several)."""
    by_id: Dict[int, List[str]] = collections.defaultdict(list)
    if root is not None:
        for fqn, p in root.named_parameters(remove_duplicate=False):
            by_id[id(p)].append(fqn)
    return by_id


def param_slots(gm: torch.fx.GraphModule, positions: Set[int]) -> Tuple[int, List[Slot]]:
    """(#primals AOTAutograd lifts before the graph inputs, the parameter inputs that have a
    Dynamo source path: (input index, base, path))."""
    lifted = (len(dict(gm.named_parameters(remove_duplicate=False)))
              + len(dict(gm.named_buffers(remove_duplicate=False))))
    slots = []
    for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        raw = source_name(node) if lifted + i in positions else None
        base, path = split_source(raw) if raw else (None, "")
        if base is not None:
            slots.append((i, base, path))
    return lifted, slots


def prefixes_of(by_id: Dict[int, List[str]], slots: Sequence[Slot], values) -> Dict[str, str]:
    """Each source base's FQN in the root: a parameter reached as ``base.path`` whose root
    FQN is ``prefix.path`` votes for ``prefix``; a base is named only by a clear majority."""
    votes: Dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for i, base, path in slots:
        if not path or i >= len(values):
            continue
        for f in by_id.get(id(values[i]), ()):
            if f == path or f.endswith("." + path):
                votes[base][f[:len(f) - len(path)].rstrip(".")] += 1
    out = {}
    for base, count in votes.items():
        ranked = count.most_common(2)
        if len(ranked) == 1 or ranked[0][1] > ranked[1][1]:
            out[base] = ranked[0][0]
    return out


def naming_of(gm: torch.fx.GraphModule, example_inputs: List, positions: Set[int],
              root: Optional[torch.nn.Module]) -> Naming:
    """The graph's ``Naming``: every parameter primal's FQNs in ``root`` and the prefixes of
    the frame locals; buffer primals' names; which parameters are frozen. A parameter not
    found in the root (or with no root) is named by its source path, relative to its frame
    local, as Dynamo names it."""
    by_id = fqn_index(root)
    buf_id = {id(b): n for n, b in root.named_buffers(remove_duplicate=False)} \
        if root is not None else {}
    own = [p for _, p in gm.named_parameters(remove_duplicate=False)]
    own_buffers = list(gm.named_buffers(remove_duplicate=False))
    lifted, slots = param_slots(gm, positions)
    params: Dict[int, tuple] = {}
    frozen = [i for i, p in enumerate(own) if i in positions and not p.requires_grad]
    buffers = {len(own) + j: buf_id.get(id(b), n) for j, (n, b) in enumerate(own_buffers)}
    for i, p in enumerate(own):
        if i in positions and by_id.get(id(p)):
            params[i] = tuple(by_id[id(p)])
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, v in enumerate(example_inputs):
        raw = source_name(placeholders[i]) if i < len(placeholders) else None
        base, path = split_source(raw) if raw else (None, "")
        if lifted + i not in positions:
            if id(v) in buf_id or (raw is not None and "_buffers" in raw):
                buffers[lifted + i] = buf_id.get(id(v)) or path or raw
            continue
        if isinstance(v, torch.Tensor) and not v.requires_grad:
            frozen.append(lifted + i)
        if by_id.get(id(v)):
            params[lifted + i] = tuple(by_id[id(v)])
        elif raw is not None:
            params[lifted + i] = (path or (base or raw).split(":")[-1],)
    prefixes = prefixes_of(by_id, slots, example_inputs)
    return Naming(root=type(root).__name__ if root is not None else None,
                  prefixes=tuple(sorted(prefixes.items())), params=tuple(sorted(params.items())),
                  buffers=tuple(sorted(buffers.items())), frozen=tuple(sorted(frozen)))


def _moved(name: str, moves: Dict[str, str]) -> str:
    """``name`` with the compile-time prefix of its frame replaced by the run-time one."""
    for old in sorted(moves, key=len, reverse=True):
        if old and (name == old or name.startswith(old + ".")):
            return moves[old] + name[len(old):]
    return name


class SharedGraphNames:
    """Wraps a compiled graph whose frame local has a prefix in the root (a child module's
    frame): the first time the graph runs with another module's parameters (Dynamo reuses
    it for every module that passes its guards), ``backend.add_aliases`` adds that module's
    rows to the report. Per call: one tuple of ``id``s of the parameter inputs and a set
    lookup; after ``_MAX_SEEN`` distinct sets it stops looking and says so."""

    def __init__(self, backend, graph_index: int, compiled, slots: List[Slot], naming: Naming,
                 root: torch.nn.Module, example_inputs: List):
        self.backend, self.graph_index, self.compiled = backend, graph_index, compiled
        self.slots = [s for s in slots if s[0] < len(example_inputs)]
        self.idx = tuple(s[0] for s in self.slots)
        self.prefixes = dict(naming.prefixes)
        self.root = weakref.ref(root)
        self.seen = {tuple(id(example_inputs[i]) for i in self.idx)}
        self._boxed_call = getattr(compiled, "_boxed_call", False)

    def __call__(self, *a):
        args = a[0] if len(a) == 1 and isinstance(a[0], list) else a
        if self.seen is not None:
            try:
                ids = tuple(id(args[i]) for i in self.idx)
            except IndexError:
                ids = None
            if ids is not None and ids not in self.seen:
                self._new(args, ids)
        return self.compiled(*a)

    def _new(self, args, ids) -> None:
        from torch._subclasses.fake_tensor import FakeTensor
        if any(isinstance(args[i], FakeTensor) for i in self.idx):
            return                    # DDPOptimizer's fake run of a piece: not a module
        self.seen.add(ids)
        if len(self.seen) > _MAX_SEEN:
            self.seen = None
            self.backend.report.notes.append(
                f"graph {self.graph_index}: ran with more than {_MAX_SEEN} parameter sets; "
                "further modules reusing it are not listed")
            return
        root = self.root()
        try:
            now = prefixes_of(fqn_index(root), self.slots, args) if root is not None else {}
            moves = {old: now[b] for b, old in self.prefixes.items()
                     if b in now and now[b] != old}
            if moves:
                self.backend.add_aliases(self.graph_index, moves)
        except Exception as e:  # noqa: BLE001 - a report matter: never fail the user's step
            log.debug("hotcompile: graph %d: could not name a reusing module: %s",
                      self.graph_index, e)


def alias_records(records, moves: Dict[str, str], config) -> Tuple[list, List[str]]:
    """Rows for the modules a reused graph also runs (``moves``: old prefix -> new), and
    notes where include/exclude would have decided otherwise for the new name."""
    from .passes.find import _selected
    out, notes = [], []
    for r in records:
        name = _moved(r.name, moves)
        if name == r.name:
            continue
        reason = None if r.reason is None else \
            f"reuses the graph compiled for {r.key}: {r.reason}"
        out.append(dataclasses.replace(r, name=name, key=_moved(r.key, moves),
                                       compiled_for=r.key, reason=reason))
        if _selected(name, config) != _selected(r.name, config):
            sel = "selects" if _selected(name, config) else "leaves out"
            did = "rewritten" if r.reason is None else "exact"
            notes.append(f"{name} runs {did}: include/exclude {sel} it, but Dynamo runs it with "
                         f"the graph compiled for {r.key} (graph {r.graph}); HOT decides per "
                         f"compiled graph")
    return out, notes
