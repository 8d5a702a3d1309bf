"""Locate every linear layer in the AOTAutograd joint graph.

Why by node identity rather than op-sequence patterns: the forward GEMM of a linear is
``mm``/``addmm(b, X, Wt)`` where ``Wt`` is a transpose (possibly around a dtype cast) of a
weight placeholder; in the joint graph the g_W GEMM is ``mm(permute(G), X)`` on *the same*
``X`` node, and the g_x GEMM is ``mm(G, permute(Wt))`` on *the same* ``Wt`` node. Matching
those identities is immune to how views, casts and transposes are spelled on a given
torch version (checked on 2.11 and 2.13), where a sequence pattern would break.

Each find yields a :class:`LinearSite`; a site that cannot be proven safe carries the
``reason`` it stays exact, and the rewrite leaves it alone.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import operator
from typing import Dict, List, Optional, Set, Tuple

import torch
from torch.fx import Graph, Node

from ..debug.report import hint
from ..debug.sources import split_source
from .op_sets import CASTS

aten = torch.ops.aten
prims = torch.ops.prims

FWD_GEMMS = (aten.mm.default, aten.addmm.default)
FLOATS = (torch.float32, torch.bfloat16, torch.float16)
# parameters gathered *inside* the graph (SimpleFSDP-style, functional collectives):
# W = wait_tensor(all_gather_into_tensor(shard)), the shard a placeholder up to casts/views
_C10D = getattr(torch.ops, "_c10d_functional", None)
GATHERS = tuple(getattr(getattr(_C10D, n, None), "default", None)
                for n in ("wait_tensor", "all_gather_into_tensor")) if _C10D else ()


@dataclasses.dataclass
class LinearSite:
    """One linear layer of the joint graph and what the passes decided for it."""

    index: int
    name: str
    fwd: Node
    x: Node                       # 2-D input of the forward GEMM (L, I)
    wt: Node                      # the forward GEMM's (I, O) operand
    weight: Optional[Node]        # the parameter placeholder behind wt (or its FSDP gather)
    gx: Optional[Node] = None     # backward mm computing g_x: (L, I), or (I, L) if gx_t
    gw: Optional[Node] = None     # backward mm computing g_W: (O, I), or (I, O) if gw_t
    gx_t: bool = False            # g_x mm is mm(wt, G^T): its result is g_x transposed
    gw_t: bool = False            # g_W mm is mm(x^T, G): its result is g_W^T = grad of wt
    grad: Optional[Node] = None   # G, the (L, O) output gradient
    L: object = None
    I: object = None
    O: object = None
    dtype: Optional[torch.dtype] = None
    reason: Optional[str] = None  # why the site stays exact (None: rewritable)
    cost: Optional[tuple] = None  # (exact ms, HOT ms, model) predicted by the cost gate
    key: str = ""                 # site key within its graph (runtime tables, report)
    abc: str = "-"                # "forward" | "backward" | "-"
    layout: object = None         # tokens.TokenLayout of x's rows
    rank: object = None           # HLA rank the rewrite used (int), set by the rewrite
    gw_format: str = "-"          # the saved activation's format ("int8" | "e4m3"), set there too
    group: str = ""               # key of the ABC group (sites sharing one compressed x)
    w_cast: Optional[Node] = None  # the hot::weight_cast op making W (weight_cast.py)
    w_owned: bool = False         # the cost gate priced W's cast as HOT's to own (its W
    #                               operands kernel also writes the FP8 forward's W)
    forward: str = "bf16"         # the forward GEMM's format ("bf16" | "fp8"), passes/forward.py
    forward_reason: str = ""      # why a site asked for FP8 keeps a bf16 forward
    forward_ms: Optional[tuple] = None  # forward cost gate: (bf16 ms, FP8 ms) predicted
    forward_pad: int = 0          # zero rows padding W's FP8 operand (fp8_forward.out_padding)
    w_max: Optional[Node] = None  # W's maxima for its FP8 scale (int32 bits; rows if row-wise,
    #                               else columns), from hot::weight_cast (weight_cast.py)
    w_fp8: Optional[tuple] = None  # (W's FP8 forward operand, its scale) from
    #                               hot::weight_operands (weight_cast.py)
    w_chain: Optional[list] = None  # views + cast from the fp32 parameter to W (recompute.py)
    x_cast: Optional[Node] = None  # hot::gelu_e4m3 making x (GELU's output) and its FP8
    #                               operand in one pass (forward.py)
    x_cast_launch: str = ""       # how that op launches (as ``launch``), set by the rewrite
    launch: str = ""              # how its HOT kernels launch: "Inductor" or "hot:: op (why)"
    gx_kept: str = ""             # why its g_x mm stays exact while g_W is HOT's (exact_gx)
    gx_exact: Optional[Node] = None  # that g_x mm (exact_gx_gemm="e4m3" may rewrite it)
    gx_e4m3: bool = False         # its g_x runs on FP8 (hot::e4m3_gx_backward, rewrite.py)
    gx_e4m3_refusal: Optional[str] = None  # why the cost gate kept that g_x exact
    gw_fp32: bool = False         # g_W written in fp32, its cast folded (grad_cast.py)
    rewritten_gx: Optional[Node] = None
    rewritten_gw: Optional[Node] = None

    @property
    def eligible(self) -> bool:
        return self.reason is None

    @property
    def frozen(self) -> bool:
        """The weight gets no gradient: only g_x is rewritten (HQ), nothing is compressed."""
        return self.gw is None


def is_transpose(n: Node) -> bool:
    if n.op != "call_function":
        return False
    if n.target == aten.t.default:
        return True
    return n.target == aten.permute.default and list(n.args[1]) in ([1, 0], [-1, -2], [1, -2])


def strip(n: Node) -> tuple[Node, int]:
    """Follow casts and 2-D transposes upwards; return the source node and #transposes."""
    flips = 0
    while n.op == "call_function":
        if n.target in CASTS:
            n = n.args[0]
        elif is_transpose(n):
            flips += 1
            n = n.args[0]
        else:
            break
    return n, flips


# a weight may be a slice of a parameter (nn.MultiheadAttention's in_proj_weight[:E])
_WEIGHT_VIEWS = (aten.slice.Tensor, aten.view.default, aten._unsafe_view.default,
                 aten.alias.default, operator.getitem, aten.split.Tensor,
                 aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int)


def weight_source(n: Node) -> Node:
    """The node a weight operand is read from: through casts, transposes, slices and views,
    and through an in-graph all-gather of a shard (FSDP)."""
    while n.op == "call_function":
        if n.target in CASTS or is_transpose(n) or n.target in _WEIGHT_VIEWS:
            n = n.args[0]
        elif GATHERS and n.target in GATHERS:
            n = n.args[0]
        else:
            break
    return n


def is_backward(n: Node) -> bool:
    return n.meta.get("partitioner_tag") == "is_backward"


def is_forward(n: Node) -> bool:
    return not is_backward(n)


def clean_fqn(raw: str) -> str:
    """Dynamo's ``L['self'].blocks._modules['0'].fc1`` -> ``blocks.0.fc1`` (relative to the
    frame's local: after a graph break inside a child module that is the child, not the
    module the user compiled; :class:`Naming` restores the prefix)."""
    return split_source(raw)[1]


@dataclasses.dataclass(frozen=True)
class Naming:
    """How the pass names a site after the user's own module, whatever the graph breaks.

    Dynamo names things relative to the frame it compiles (``L['self']``): after a graph
    break inside a child module, that is the child, and its prefix in the user's model is
    gone. The backend knows more: the real parameter tensors (``example_inputs``) and the
    module the user compiled (``root``). ``params`` gives each parameter placeholder's
    fully qualified names in the root (every alias of a tied weight, in
    ``named_parameters(remove_duplicate=False)`` order); ``prefixes`` gives each frame
    local's own FQN in the root, proven by a parameter reached through it (its source path
    is a suffix of the parameter's FQN). ``root`` is the root's class name, or None when no
    root module is known (a compiled function): then names are relative to the frame, as
    Dynamo gives them.
    """

    root: Optional[str] = None
    prefixes: Tuple[Tuple[str, str], ...] = ()               # (source base, FQN in the root)
    params: Tuple[Tuple[int, Tuple[str, ...]], ...] = ()     # (primal position, FQNs)
    buffers: Tuple[Tuple[int, str], ...] = ()                # (primal position, FQN)
    frozen: Tuple[int, ...] = ()         # parameter positions with requires_grad=False

    def prefix(self, base: Optional[str]) -> Optional[str]:
        return dict(self.prefixes).get(base) if base is not None else None


class ParamSet(set):
    """The joint graph's parameter placeholders (a set: ``node in params``), with each one's
    fully qualified names and the :class:`Naming` they came from."""

    def __init__(self, nodes=(), names: Optional[Dict[Node, Tuple[str, ...]]] = None,
                 naming: Optional[Naming] = None, buffers: Optional[Dict[Node, str]] = None,
                 frozen: Optional[Set[Node]] = None):
        super().__init__(nodes)
        self.names = names or {}
        self.naming = naming or Naming()
        self.buffers = buffers or {}            # buffer placeholders -> FQN
        self.frozen = frozen          # parameters with requires_grad=False (None: unknown)


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def layer_name(param_fqn: str) -> str:
    """The layer a weight parameter names: ``blocks.0.fc1.weight`` -> ``blocks.0.fc1`` (the
    module, as in ``named_modules()``); a parameter with another name keeps it, without a
    ``_weight`` suffix: ``self_attn.in_proj_weight`` -> ``self_attn.in_proj``."""
    owner, _, pname = param_fqn.rpartition(".")
    if pname == "weight":
        return owner
    return _join(owner, pname[:-len("_weight")] if pname.endswith("_weight") else pname)


def _stack_module(fwd: Node, gx: Optional[Node], gw: Optional[Node]):
    """(raw Dynamo path, class) of the innermost module that made the forward GEMM."""
    for n, key in ((fwd, "nn_module_stack"), (gw, "fwd_nn_module_stack"),
                   (gx, "fwd_nn_module_stack")):
        stack = n.meta.get(key) if n is not None else None
        if stack:
            fqn, mod_type = list(stack.values())[-1][:2]
            return str(fqn), mod_type
    return None, None


def module_name(fwd: Node, gx: Optional[Node], gw: Optional[Node],
                naming: Optional[Naming] = None) -> Optional[str]:
    """The FQN of the module whose forward made the GEMM: in the root when the frame local
    it hangs off has a known prefix, else relative to the frame; None with no module stack
    (an op in the compiled frame's own code)."""
    raw, _ = _stack_module(fwd, gx, gw)
    if raw is None:
        return None
    base, path = split_source(raw)
    prefix = naming.prefix(base) if naming is not None else None
    return _join(prefix, path) if prefix is not None else path


def _under(fqn: str, module: str) -> bool:
    return module == "" or fqn.startswith(module + ".")


def site_name(site: "LinearSite", params) -> str:
    """The site's name: the weight's layer (``layer_name`` of its parameter FQN, the alias
    inside the module that made the call when the weight is tied), else the calling
    module; a row slice of a parameter (``nn.MultiheadAttention``'s q / kv projections of
    ``in_proj_weight``) gets its rows, ``self_attn.in_proj[0:64]``."""
    naming = getattr(params, "naming", None)
    module = module_name(site.fwd, site.gx, site.gw, naming)
    fqns = getattr(params, "names", {}).get(site.weight, ()) if site.weight is not None else ()
    if fqns:
        mine = [f for f in fqns if module is not None and _under(f, module)]
        name = layer_name((mine or list(fqns))[0]) + _row_slice(site.wt, site.weight)
    else:
        name = module
    if name:
        return name
    # the compiled module's own weight (torch.compile(nn.Linear(...))): its class name
    raw, mod_type = _stack_module(site.fwd, site.gx, site.gw)
    root = naming.root if naming is not None else None
    return root or getattr(mod_type, "__name__", None) or "linear"


_SPLITS = (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default)


def _row_slice(wt: Node, weight: Optional[Node]) -> str:
    """``[a:b]`` when the weight operand is rows a..b of its parameter (``W[a:b]`` or one
    part of ``W.split(...)`` / ``W.chunk(...)`` along dim 0), else ``""``."""
    n = wt
    while n.op == "call_function" and (n.target in CASTS or is_transpose(n)):
        n = n.args[0]
    if weight is None or n.op != "call_function":
        return ""
    if n.target == aten.slice.Tensor:
        src, dim = n.args[0], (n.args[1] if len(n.args) > 1 else 0)
    elif n.target is operator.getitem and isinstance(n.args[0], Node) \
            and n.args[0].target in _SPLITS:
        src = n.args[0].args[0]
        dim = n.args[0].args[2] if len(n.args[0].args) > 2 else n.args[0].kwargs.get("dim", 0)
    else:
        return ""
    v, p = _val(n), _val(weight)
    try:
        if (src is not weight or v is None or p is None or v.dim() != 2 or p.dim() != 2
                or dim % 2 != 0 or tuple(v.stride()) != tuple(p.stride())
                or v.shape[1] != p.shape[1] or v.shape[0] == p.shape[0]):
            return ""
        start = (hint(v.storage_offset()) - hint(p.storage_offset())) // hint(p.stride(0))
        rows = hint(v.shape[0])
        return f"[{start}:{start + rows}]" if isinstance(start, int) and isinstance(rows, int) \
            else ""
    except Exception:  # noqa: BLE001 - a view we cannot read: no suffix, keys still unique
        return ""


def _val(n) -> Optional[torch.Tensor]:
    v = n.meta.get("val") if isinstance(n, Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _same_grad(a: Node, b: Node) -> bool:
    if a is b:
        return True
    sa, _ = strip(a)
    sb, _ = strip(b)
    return sa is sb


def find_linear_sites(graph: Graph, config, params: Optional[Set[Node]] = None,
                      labels=None) -> List[LinearSite]:
    """All forward linear GEMMs of ``graph`` with their backward GEMMs and a verdict.

    ``params``: the placeholders that are parameters of the compiled module (the backend
    knows which example inputs are ``nn.Parameter``s). A weight must be one of them and x
    must not be: any other GEMM is an activation product and stays exact.
    """
    sites: List[LinearSite] = []
    bwd_mms = [n for n in graph.nodes
               if n.op == "call_function" and n.target == aten.mm.default and is_backward(n)]
    for fwd in graph.nodes:
        if fwd.op != "call_function" or fwd.target not in FWD_GEMMS or not is_forward(fwd):
            continue
        x, wt = (fwd.args[1], fwd.args[2]) if fwd.target == aten.addmm.default else fwd.args[:2]
        src = weight_source(wt)
        site = LinearSite(index=len(sites), name="linear", fwd=fwd, x=x, wt=wt,
                          weight=src if params is not None and src in params else None)
        seq = fwd.meta.get("seq_nr")
        # g_x: mm(G, wt^T) -> (L, I), or mm(wt, G^T) -> (I, L) when x was column-major
        gx_a = [mm for mm in bwd_mms if is_transpose(mm.args[1]) and mm.args[1].args[0] is wt]
        gx_b = [mm for mm in bwd_mms if mm.args[0] is wt and is_transpose(mm.args[1])]
        # g_W: mm(G^T, x) -> (O, I), or mm(x^T, G) -> (I, O) when wt was row-major
        gw_a = [mm for mm in bwd_mms if mm.args[1] is x and is_transpose(mm.args[0])]
        gw_b = [mm for mm in bwd_mms if is_transpose(mm.args[0]) and mm.args[0].args[0] is x]
        wv = _val(wt)
        io = tuple(wv.shape) if wv is not None else None            # (I, O)
        oi = io[::-1] if io is not None else None
        gx, why_x = _pick([(m, False) for m in gx_a] + [(m, True) for m in gx_b], seq, "g_x")
        gw, why_w = _pick([(m, False) for m in gw_a if _shape_is(m, oi)]
                          + [(m, True) for m in gw_b if _shape_is(m, io)], seq, "g_W")
        if gx is not None:
            site.gx, site.gx_t = gx
            site.grad = site.gx.args[1].args[0] if site.gx_t else site.gx.args[0]
        if gw is not None:
            site.gw, site.gw_t = gw
            g = site.gw.args[1] if site.gw_t else site.gw.args[0].args[0]
            if site.grad is not None and not _same_grad(site.grad, g):
                why_w = why_w or "g_x and g_W consume different output gradients"
            site.grad = g
        site.reason = why_x or why_w
        xv = _val(x)
        if xv is not None and xv.dim() == 2:
            site.L = hint(xv.shape[0])
            site.dtype = xv.dtype
        if io is not None and len(io) == 2:
            site.I, site.O = hint(io[0]), hint(io[1])
        sites.append(site)
    claims = _shared_claims(sites, params)
    for site in sites:
        site.name = site_name(site, params)
        if site.reason is None:
            site.reason = _verdict(site, config, params) or claims.get(site.index)
        if site.reason is None and site.gx is not None and site.gw is not None:
            hit = next((p for p in config.exact_gx if _matches(site.name, p)), None)
            if hit is not None:     # its g_x mm is left in the graph as it is
                site.gx_exact, site.gx, site.gx_kept = site.gx, None, f"exact_gx pattern {hit!r}"
        if site.reason is None and site.gw is not None and labels is not None:
            site.layout = labels.layout(site.x)
    _assign_keys(sites)
    return sites


def _shape_is(n: Node, shape) -> bool:
    v = _val(n)
    return shape is None or v is None or tuple(v.shape) == tuple(shape)


def _shared_claims(sites: List[LinearSite], params) -> Dict[int, str]:
    """A backward GEMM claimed by several forward GEMMs: a layer that created no autograd
    node (frozen weight, input needing no grad) carries its neighbour's seq_nr. A layer
    whose weight is frozen computes no g_W, so it drops a g_W claim; where one trainable
    claimant is left it owns the GEMM. Otherwise no claim can be proven, and every
    claimant keeps that GEMM exact: returns {site index: why}."""
    frozen = getattr(params, "frozen", None)
    why: Dict[int, str] = {}
    for attr in ("gw", "gx"):
        owners: dict = {}
        for s in sites:
            n = getattr(s, attr)
            if n is not None:
                owners.setdefault(n, []).append(s)
        for n, claim in owners.items():
            if len(claim) < 2:
                continue
            if attr == "gw" and frozen is not None:
                trainable = [s for s in claim if s.weight is not None and s.weight not in frozen]
                if len(trainable) == 1:
                    for s in claim:
                        if s is not trainable[0]:
                            s.gw, s.gw_t = None, False
                            s.grad = s.grad if s.gx is not None else None
                    continue
            names = ", ".join(site_name(s, params) for s in claim)
            what = "g_W" if attr == "gw" else "g_x"
            for s in claim:
                why.setdefault(s.index, (
                    f"cannot tell which of {len(claim)} layers ({names}) owns the {what} GEMM "
                    f"{n.name}: they share seq_nr {n.meta.get('seq_nr')} (a layer that made "
                    f"no autograd node carries its neighbour's)"))
    return why


def _pick(cands: List[tuple], seq, what: str):
    """The backward GEMM of this forward GEMM among candidates sharing an operand.

    Autograd stamps a forward op and its gradient nodes with the same ``seq_nr``; every
    pairing is confirmed by it (a frozen linear reading the same x as a trainable one must
    not take its sibling's g_W).
    """
    if not cands:
        return None, None
    if seq is None:
        return None, f"cannot confirm which {what} GEMM belongs to this layer (no seq_nr)"
    mine = [c for c in cands if c[0].meta.get("seq_nr") == seq]
    if len(mine) > 1:
        return None, f"cannot tell which of several {what} GEMMs belongs to this layer"
    return (mine[0] if mine else None), None


def _label(n: Node, params) -> str:
    """`` (`blocks.0.fc.weight`)`` for a parameter or buffer placeholder, else ``""``."""
    name = (getattr(params, "names", {}).get(n) or (None,))[0] or \
        getattr(params, "buffers", {}).get(n)
    return f" (`{name}`)" if name else ""


def _computed_from(n: Node) -> Set[Node]:
    """The placeholders a forward value is computed from."""
    seen, todo, out = set(), [n], set()
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        if m.op == "placeholder":
            out.add(m)
        todo.extend(m.all_input_nodes)
    return out


def _not_a_weight(site: LinearSite, params) -> str:
    """What the weight operand of a GEMM whose weight is not a parameter is, as far as the
    graph shows."""
    src = weight_source(site.wt)
    if src in getattr(params, "buffers", {}):
        return (f"weight operand is a buffer{_label(src, params)}, not a parameter: only "
                f"parameters are taken for a linear layer's weight")
    if src.op == "placeholder":
        return ("weight operand is an input of this graph, not a parameter (a model input, or "
                "an activation passed across a graph break): an activation product")
    inputs = _computed_from(src)
    if inputs and all(i in params or i in getattr(params, "buffers", {}) for i in inputs):
        return ("weight operand is computed in the graph from parameters only (a merged or "
                "normalised weight, W1 @ W2), not a parameter itself")
    return ("weight operand is an activation computed in the graph, not a parameter: an "
            "activation product (e.g. q @ k^T)")


def _no_gradient(site: LinearSite, params) -> str:
    frozen = getattr(params, "frozen", None)
    if frozen is not None and site.weight not in frozen:
        return ("no gradient flows through this GEMM: its output is used by nothing "
                "differentiated (e.g. only argmax); the weight is trainable")
    what = "frozen weight (requires_grad=False)" if frozen is not None else "the weight gets none"
    return f"no gradient flows through this GEMM: {what} and x needs no grad"


def _verdict(site: LinearSite, config, params) -> Optional[str]:
    """Why this site must stay exact, or None when it is safe to rewrite."""
    if params is None:
        return "parameters of the compiled module unknown (cannot prove the weight's role)"
    xs = weight_source(site.x)
    if site.weight is None:
        if xs in params:
            return (f"the parameter{_label(xs, params)} is the left operand (W @ x): not a "
                    f"linear layer's layout")
        return _not_a_weight(site, params)
    if xs in params:
        return f"the input x is itself a parameter{_label(xs, params)}"
    if site.gx is None and site.gw is None:
        return _no_gradient(site, params)
    xv, gv = _val(site.x), _val(site.grad)
    if xv is None or gv is None or xv.dim() != 2 or gv.dim() != 2:
        return "operands are not 2-D tensors with known metadata"
    if gv.dtype != xv.dtype:
        return f"x and its output gradient differ in dtype ({xv.dtype} vs {gv.dtype})"
    if xv.dtype not in FLOATS:
        return (f"dtype {str(xv.dtype).replace('torch.', '')} is not supported (HOT's kernels "
                f"take float32, bfloat16 and float16)")
    if xv.device.type not in ("cpu", "cuda"):
        return f"device {xv.device.type} is not supported (HOT runs on cpu and cuda)"
    excluded = _exclusion(site.name, config)
    if excluded:
        return excluded
    dims = [d for d in (site.I, site.O) if isinstance(d, int)]
    if dims and min(dims) < config.min_features:
        return (f"features {min(dims)} < min_features={config.min_features} (in {site.I}, "
                f"out {site.O})")
    return None


def _exclusion(name: str, config) -> Optional[str]:
    """Why ``name`` is not selected by include/exclude, or None."""
    if config.include is not None:
        if not any(_matches(name, p) for p in config.include):
            return f"excluded by name: matches no include pattern (include={config.include})"
    hit = next((p for p in config.exclude if _matches(name, p)), None)
    return f"excluded by name: matches exclude pattern {hit!r}" if hit is not None else None


def _matches(name: str, pattern: str) -> bool:
    """A pattern names a dotted component (``head``) or globs the full name
    (``blocks.*.fc2``); a row slice ``self_attn.in_proj[0:64]`` also answers to its
    parameter's name."""
    base = name.split("[")[0]
    return (pattern in base.split(".") or fnmatch.fnmatchcase(name, pattern)
            or fnmatch.fnmatchcase(base, pattern))


def _selected(name: str, config) -> bool:
    return _exclusion(name, config) is None


def _assign_keys(sites: List[LinearSite]) -> None:
    """Runtime keys: the module name, suffixed with #k when a module is applied twice."""
    seen: dict = {}
    for s in sites:
        k = seen.get(s.name, 0)
        seen[s.name] = k + 1
        s.key = s.name if k == 0 else f"{s.name}#{k}"
