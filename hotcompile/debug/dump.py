"""Graph dumps: what HOT did to each compiled graph, written as files a person can read later.

Why files (not logs): the person debugging is often not the one whose job ran. With
``HOTConfig(dump_dir=...)`` or ``HOT_DUMP=dir`` every graph the backend compiles gets a
folder of its own, and the directory as a whole can be copied off the machine and read with
``python -m hotcompile.debug DIR`` (summary.py, which needs only these files).

Layout (one folder per backend call, so several graphs, recompiles and processes never
overwrite each other; the folder name is created atomically and suffixed on collision)::

    DIR/report.json, DIR/report.md          every graph found in DIR (rewritten on each dump)
    DIR/graph{index:03d}[_r{RANK}]_p{pid}/
        joint_before.txt                    joint graph before HOT's pass (str(fx.Graph))
        joint_after.txt                     ... after it (diff the two)
        sites.dot                           Graphviz: the neighbourhood of every linear site
        forward.txt, backward.txt           post-grad graphs as Inductor compiles them
                                            (inference.txt for a no-grad compile)
        graph.json                          this graph's records, costs, node names

report.json aggregates the ``graph.json`` of every folder in DIR (all graphs of this process,
and those of other processes writing the same DIR, e.g. DDP ranks): each process rebuilds it
from the folders, so the last writer's copy is complete. The files of a graph are refreshed
when its forward/backward are compiled and once more at interpreter exit, so LQS choices made
during training (after the compile) reach the report.

Cost model (per linear site, one backward step; ``report.json``'s ``cost`` field). Notation
of HOT_SPEC.md: x (L, I), W (O, I), g_y (L, O); n = block, r = rank, and
``Lc = ceil(L/n)·r`` tokens after HLA (L is zero-padded to a multiple of n, so this is the
paper's L·r/n rounded up). FLOPs, supplementary Table 5 of the paper:

- exact: ``2·L·I·O`` per backward GEMM present (g_x, g_W), i.e. the vanilla ``4·L·I·O``;
- HOT GEMMs: g_x ``2·L·O·I`` (low-bit), g_W ``2·Lc·O·I`` (int8);
- HOT extras: g_x path ``2LO·log2 n + 2IO·log2 n + 2LO + 2IO``; g_W path
  ``2LI·log2 n + 2LO·log2 n + 2I·Lc + 2O·Lc``; dequantisation ``2LI`` (g_x) + ``2IO`` (g_W).

Bytes moved: every large tensor is counted once per pass that reads or writes it, at its
storage size (e = the site's float itemsize, q = 1 byte: 4-bit levels are carried in int8).
Scales, amax reductions and the bias gradient are small and left out.

- exact: g_x GEMM reads g_y (LO·e) and W (OI·e), writes g_x (LI·e); g_W GEMM reads g_y
  (LO·e) and the saved x (LI·e), writes g_W (OI·e).
- HOT, g_x path: HT+quantise g_y (read LO·e, write LO·q) and W (read OI·e, write OI·q),
  GEMM reads both low-bit operands and writes g_x (LI·e).
- HOT, g_W path: HLA projection of g_y (read LO·e, write Lc·O·q); GEMM reads it and the
  compressed buffer (Lc·I·q), writes g_W (OI·e).
- HOT, ABC: compress x once per buffer (read LI·e, write Lc·I·q; in the forward, or in
  the backward when x is needed there anyway); sites sharing a buffer count it once.

g_y is read once per transform pass (twice: HQ and HLA); a fused kernel that reads it once
for both (HOT_SPEC.md's design target) moves ``L·O·e`` less — ``gy_fused_saving`` says how
much. The model counts traffic, it is not a timing: the passes are memory-bound, the GEMMs
compute-bound.
"""
from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import math
import os
import socket
import threading
import time
from typing import Dict, Optional

import torch

from .saved import forward_producers, saved_uses

log = logging.getLogger("hotcompile")

_LOCK = threading.Lock()
_GRAPHS: Dict[tuple, "GraphDump"] = {}      # (abs dump dir, pid, graph index) -> state
_STARTED = time.strftime("%Y-%m-%dT%H:%M:%S")
_ATEXIT: set = set()                         # pids that registered the exit refresh

FLOAT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
HOT_TARGETS = {"hq": "hot.hq_grad_input.default", "hla": "hot.hla_grad_weight.default",
               "unit": "hot.linear_backward.default", "abc": "hot.abc_compress.default",
               "e4m3gx": "hot.e4m3_gx_backward.default"}


# --------------------------------------------------------------------------- cost model
def site_cost(rec, config) -> Optional[dict]:
    """FLOPs and bytes moved by one site's backward, before (exact) and after (as decided).

    ``rec`` is a SiteRecord (or its dict). None when a size is symbolic or the dtype unknown.
    """
    r = rec if isinstance(rec, dict) else dataclasses.asdict(rec)
    L, I, O = r["L"], r["I"], r["O"]
    e = FLOAT_BYTES.get(r["dtype"])
    if not all(isinstance(v, int) for v in (L, I, O)) or e is None:
        return None
    has_gx = not r["gx_path"].startswith("-")
    has_gw = not r["gw_path"].startswith("-")
    exact_flops = 2 * L * I * O * (has_gx + has_gw)
    exact_bytes = has_gx * (L * O + O * I + L * I) * e + has_gw * (L * O + L * I + O * I) * e
    cost = {"flops_before": exact_flops, "bytes_before": exact_bytes,
            "flops_after": exact_flops, "bytes_after": exact_bytes,
            "flops_detail": None, "bytes_detail": None, "gy_fused_saving": 0}
    if r["reason"] is not None:
        return cost
    n, q = config["block"], 1
    rank = r.get("rank") if isinstance(r.get("rank"), int) else n   # calibrating: full rank
    logn = math.log2(n)
    Lc = -(-L // n) * rank
    fl = {"gemm_gw": 2 * Lc * O * I,
          "hla_gw": 2 * L * I * logn + 2 * L * O * logn + 2 * I * Lc + 2 * O * Lc,
          "dequant_gw": 2 * I * O}
    by = {"hla_gy": L * O * e + Lc * O * q, "gemm_gw": Lc * O * q + Lc * I * q + O * I * e}
    if not r["abc"].split(" (")[-1].startswith("shares"):
        by["abc_x"] = L * I * e + Lc * I * q
    hq_gx = r["gx_path"].startswith("HQ")          # else exact (exact_gx) or none
    if hq_gx:
        fl.update(gemm_gx=2 * L * O * I, hq_gx=2 * L * O * logn + 2 * I * O * logn + 2 * L * O
                  + 2 * I * O, dequant_gx=2 * L * I)
        by.update(hq_gy=L * O * e + L * O * q, hq_w=O * I * e + O * I * q,
                  gemm_gx=L * O * q + O * I * q + L * I * e)
    elif r["gx_path"].startswith("FP8"):          # exact_gx_gemm="e4m3"
        fl.update(gemm_gx=2 * L * O * I)
        by.update(g8_gy=L * O * e + L * O * q, gemm_gx=L * O * q + O * I * q + L * I * e)
    elif has_gx:
        fl.update(gemm_gx_exact=2 * L * O * I)
        by.update(gemm_gx_exact=(L * O + O * I + L * I) * e)
    fl = {k: int(v) for k, v in fl.items()}
    cost.update(flops_after=sum(fl.values()), bytes_after=sum(by.values()), flops_detail=fl,
                bytes_detail=by, gy_fused_saving=L * O * e if hq_gx else 0)
    return cost


# --------------------------------------------------------------------------- per-graph state
@dataclasses.dataclass
class GraphDump:
    """What this process knows about one compiled graph; serialised as graph.json."""

    root: str
    index: int
    folder: str
    config: dict
    records: list = dataclasses.field(default_factory=list)   # SiteRecord objects (live)
    nodes: dict = dataclasses.field(default_factory=dict)     # site key -> node names
    compiled: dict = dataclasses.field(default_factory=dict)  # "forward"/"backward" -> info
    joint: bool = False

    @property
    def path(self) -> str:
        return os.path.join(self.root, self.folder)

    def to_dict(self) -> dict:
        sites = []
        for rec in self.records:
            rec.refresh_lqs()
            d = dataclasses.asdict(rec)
            d["rewritten"] = rec.rewritten
            d["lqs_source"] = _lqs_source(rec)
            d["cost"] = site_cost(d, self.config)
            d["nodes"] = self.nodes.get(rec.key, {})
            sites.append(d)
        files = sorted(f for f in os.listdir(self.path)) if os.path.isdir(self.path) else []
        return {"graph": self.index, "folder": self.folder,
                "process": {"pid": os.getpid(), "host": socket.gethostname(),
                            "rank": os.environ.get("RANK"), "started": _STARTED},
                "torch": torch.__version__, "updated": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "joint_dumped": self.joint, "config": self.config, "sites": sites,
                "compiled": self.compiled, "files": files}


def _lqs_source(rec) -> Optional[str]:
    from ..runtime.lqs import TABLE
    c = TABLE.sites.get(rec.runtime_key or rec.key)
    return c.source if c is not None and rec.rewritten and rec.gx_path.startswith("HQ") else None


def _state(config, graph_index: int) -> GraphDump:
    """The graph's state, creating its folder on first use (atomic mkdir: no collisions)."""
    root = os.path.abspath(config.dump_dir)
    key = (root, os.getpid(), graph_index)
    with _LOCK:
        st = _GRAPHS.get(key)
        if st is not None:
            return st
        os.makedirs(root, exist_ok=True)
        rank = os.environ.get("RANK")
        base = f"graph{graph_index:03d}" + (f"_r{rank}" if rank else "") + f"_p{os.getpid()}"
        name, k = base, 1
        while True:
            try:
                os.mkdir(os.path.join(root, name))
                break
            except FileExistsError:         # an earlier process with the same pid, same dir
                k += 1
                name = f"{base}.{k}"
        st = _GRAPHS[key] = GraphDump(root=root, index=graph_index, folder=name,
                                      config=config.to_dict())
        if os.getpid() not in _ATEXIT:
            _ATEXIT.add(os.getpid())
            atexit.register(flush)
    return st


def _write(path: str, text: str) -> None:
    """Write atomically: a reader (or another process's report) never sees half a file."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _unique(folder: str, stem: str, ext: str) -> str:
    """``stem.ext``, or ``stem_1.ext``... if Inductor compiles the same kind twice."""
    path, k = os.path.join(folder, f"{stem}.{ext}"), 0
    while os.path.exists(path):
        k += 1
        path = os.path.join(folder, f"{stem}_{k}.{ext}")
    return path


def _save(st: GraphDump) -> None:
    _write(os.path.join(st.path, "graph.json"), json.dumps(st.to_dict(), indent=1, default=str))
    write_report(st.root)


def write_report(root: str) -> dict:
    """Rebuild DIR/report.json and report.md from every graph folder in DIR."""
    from .summary import load_dump, render_markdown
    data = load_dump(root, from_report=False)
    _write(os.path.join(root, "report.json"), json.dumps(data, indent=1, default=str))
    _write(os.path.join(root, "report.md"), render_markdown(data))
    return data


def flush() -> None:
    """Rewrite this process's graph.json files and the reports (LQS choices move at run time).

    Registered with atexit; call it by hand to get an up-to-date report mid-run.
    """
    pid = os.getpid()
    roots = set()
    for (root, p, _), st in list(_GRAPHS.items()):
        if p != pid or not os.path.isdir(st.path):    # the dump dir was removed meanwhile
            continue
        try:
            _write(os.path.join(st.path, "graph.json"),
                   json.dumps(st.to_dict(), indent=1, default=str))
            roots.add(root)
        except Exception as e:  # noqa: BLE001 - never fail a user's exit over a debug file
            log.warning("hotcompile: could not refresh %s: %s", st.path, e)
    for root in roots:
        try:
            write_report(root)
        except Exception as e:  # noqa: BLE001
            log.warning("hotcompile: could not rewrite the report in %s: %s", root, e)


# --------------------------------------------------------------------------- Graphviz
_COLORS = {"hq": "#e76f51", "hla": "#f4a261", "abc": "#2a9d8f", "buffer": "#e9c46a",
           "exact": "#d9d9d9", "core": "#a8dadc"}


def _meta_str(v) -> str:
    from .report import hint
    if isinstance(v, torch.Tensor):
        return str(v.dtype).replace("torch.", "") + str([hint(s) for s in v.shape])
    if isinstance(v, (tuple, list)):
        return "(" + ", ".join(_meta_str(x) for x in v) + ")"
    return ""


def _label(node, extra: str = "") -> str:
    """Node name, op, dtype[shape] (and why a site stayed exact), one per line."""
    t = node.target
    what = node.op if node.op != "call_function" else \
        (str(t) if isinstance(t, torch._ops.OpOverload) else getattr(t, "__name__", str(t)))
    lines = [node.name, what.replace(".default", ""), _meta_str(node.meta.get("val")), extra]
    return "\n".join(x for x in lines if x)


def site_graph(graph: torch.fx.Graph, sites: list):
    """A networkx DiGraph of the joint graph around every linear site, with DOT attributes.

    Core nodes of a rewritten site: forward GEMM, X, abc_compress, its getitems (the buffer),
    the hot:: GEMM ops — plus every direct input and user of those. The hot:: nodes carry
    ``hot="hq"|"hla"|"abc"``, buffer getitems ``buffer="true"`` and, when the forward makes
    them (so the partitioner saves them for backward), ``saved="true"``. An exact site shows
    its forward GEMM and remaining backward GEMMs with ``exact="<reason>"``.
    """
    import networkx as nx
    alive = set(graph.nodes)
    g = nx.DiGraph()
    core: Dict[torch.fx.Node, dict] = {}

    def mark(n, site, **attrs):
        if n is None or n not in alive:
            return
        a = core.setdefault(n, {"site": []})
        if site.key not in a["site"]:
            a["site"].append(site.key)
        a.update(attrs)

    for s in sites:
        if s.rewritten_gw is not None:
            mark(s.fwd, s, role="forward_gemm", fillcolor=_COLORS["core"])
            mark(s.x, s, role="x", fillcolor=_COLORS["core"])
            if s.rewritten_gw not in alive:     # spliced: its kernels stand in the graph
                continue
            unit = s.rewritten_gx is s.rewritten_gw      # one op: the site's whole backward
            mark(s.rewritten_gw, s, hot="hq+hla (linear_backward)" if unit else
                 "fp8 g_x + hla (e4m3_gx_backward)" if s.gx_e4m3 else "hla",
                 fillcolor=_COLORS["hla"])
            if not unit:
                mark(s.rewritten_gx, s, hot="hq", fillcolor=_COLORS["hq"])
            buf = s.rewritten_gw.args[1:3]
            comp = buf[0].args[0]
            mark(comp, s, hot="abc", fillcolor=_COLORS["abc"])
            fwd_side = buf[0].meta.get("partitioner_tag") == "is_forward"
            for b in buf:
                mark(b, s, buffer="true", saved="true" if fwd_side else "false",
                     fillcolor=_COLORS["buffer"], peripheries="2" if fwd_side else "1")
        else:
            why = s.reason or "not rewritten"
            for n in (s.fwd, s.gx, s.gw):
                mark(n, s, exact=why, tooltip=why, fillcolor=_COLORS["exact"],
                     style="filled,dashed")
    for n, attrs in core.items():
        note = f"exact ({attrs['site'][0]}): {attrs['exact'][:60]}" if "exact" in attrs else ""
        g.add_node(n.name, **dict(attrs, site=",".join(attrs["site"])), label=_label(n, note),
                   side=_side(n))
    for n in core:
        for m in list(n.all_input_nodes) + list(n.users):
            if m.name not in g:
                g.add_node(m.name, label=_label(m), side=_side(m), fillcolor="white")
    for n in graph.nodes:
        if n.name in g:
            for m in n.all_input_nodes:
                if m.name in g:
                    g.add_edge(m.name, n.name)
    return g


def _side(n) -> str:
    return "backward" if n.meta.get("partitioner_tag") == "is_backward" else "forward"


def _q(v) -> str:
    """A quoted DOT ID; a newline in the text becomes DOT's ``\\n`` line break."""
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def to_dot(g, name: str) -> str:
    """DOT text of a networkx DiGraph whose node/edge attributes are DOT attributes.

    Written by hand: networkx's DOT writers need pydot or pygraphviz, which this project
    does not depend on. Labels use DOT's ``\\n`` for line breaks.
    """
    lines = [f"digraph {_q(name)} {{",
             '  graph [rankdir=TB, fontname="monospace", label=' + _q(
                 f"{name}: HOT rewrite (hq/hla/abc coloured; saved buffers double-framed; "
                 f"exact sites dashed grey)") + "];",
             '  node [shape=box, style=filled, fontname="monospace", fontsize=10];']
    for n, attrs in g.nodes(data=True):
        body = ", ".join(f"{k}={_q(v)}" for k, v in sorted(attrs.items()))
        lines.append(f"  {_q(n)} [{body}];")
    for a, b in g.edges():
        lines.append(f"  {_q(a)} -> {_q(b)};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def sites_dot(graph: torch.fx.Graph, sites: list, name: str) -> str:
    return to_dot(site_graph(graph, sites), name)


# --------------------------------------------------------------------------- joint graph
def _site_nodes(site, alive: set) -> dict:
    """Names of a site's nodes in the joint graph after the pass (for graph.json / the .dot).
    A spliced op (``passes/splice.py``) is gone from the graph, its arguments cleared: its
    name is kept with ``"spliced": true``, and its kernels are the graph's
    ``triton_kernel_wrapper_functional`` nodes."""
    out = {"fwd": site.fwd.name, "x": site.x.name}
    gw = site.rewritten_gw
    if gw is not None and gw not in alive:
        out["hla"] = gw.name
        out["spliced"] = True
        if site.rewritten_gx is not None:
            out["hq"] = site.rewritten_gx.name
        return out
    if gw is not None:
        out["hla"] = gw.name
        buf = gw.args[1]
        out["abc"] = buf.args[0].name
        out["buffer"] = [a.name for a in gw.args[1:3]]
        out["buffer_side"] = "forward" if buf.meta.get("partitioner_tag") == "is_forward" \
            else "backward"
    if site.rewritten_gx is not None:
        out["hq"] = site.rewritten_gx.name
    if gw is None:
        for k in ("gx", "gw"):
            n = getattr(site, k)
            if n is not None and n in alive:
                out[k] = n.name
    return out


def dump_joint(config, graph_index: int, before_text: Optional[str], graph: torch.fx.Graph,
               sites: list, records: list) -> None:
    """Called by the backend right after HOT's joint-graph pass (``graph`` is the result)."""
    try:
        st = _state(config, graph_index)
        alive = set(graph.nodes)
        st.records = list(records)
        st.nodes = {s.key: _site_nodes(s, alive) for s in sites}
        st.joint = True
        head = f"# graph {graph_index}, joint forward+backward graph, %s HOT's pass\n"
        _write(os.path.join(st.path, "joint_before.txt"),
               head % "before" + (before_text or "(not captured)\n"))
        _write(os.path.join(st.path, "joint_after.txt"), head % "after" + str(graph))
        _write(os.path.join(st.path, "sites.dot"), sites_dot(graph, sites, st.folder))
        _save(st)
    except Exception as e:  # noqa: BLE001 - a debug dump must never break the compile
        log.warning("hotcompile: graph dump failed for graph %d: %s", graph_index, e)


def add_records(config, graph_index: int, records: list) -> None:
    """Rows added at run time (modules that run a graph compiled for another one)."""
    try:
        st = _state(config, graph_index)
        st.records.extend(records)
        _save(st)
    except Exception as e:  # noqa: BLE001 - a debug dump must never break a step
        log.warning("hotcompile: graph dump failed for graph %d: %s", graph_index, e)


# --------------------------------------------------------------------------- fw / bw graphs
try:
    from torch._inductor.custom_graph_pass import CustomInferenceAwareGraphPass as _PassBase
except ImportError:  # older torch: a plain callable (no is_inference argument)
    _PassBase = object


def _val_info(node) -> dict:
    from .report import hint
    v = node.meta.get("val")
    if not isinstance(v, torch.Tensor):
        return {"name": node.name}
    shape = [hint(s) for s in v.shape]
    nbytes = math.prod(shape) * v.element_size() if all(isinstance(s, int) for s in shape) \
        else None
    return {"name": node.name, "shape": shape, "dtype": str(v.dtype).replace("torch.", ""),
            "bytes": nbytes}


def _compiled_info(graph: torch.fx.Graph) -> dict:
    """Op counts and, for a backward graph, what the forward saved for it."""
    counts = {k: 0 for k in HOT_TARGETS}
    hot_inputs = set()
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        for k, t in HOT_TARGETS.items():
            if str(n.target) == t:
                counts[k] += 1
                if k in ("hla", "unit", "e4m3gx"):  # hla_grad_weight's arguments first
                    hot_inputs.update(a.name for a in n.args[1:3])
    gemms = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
    info = {"hot_ops": counts, "exact_mm": sum(1 for n in graph.nodes
                                               if n.op == "call_function" and n.target in gemms)}
    phs = [n for n in graph.nodes if n.op == "placeholder"]
    if any("tangents" in n.name for n in phs):
        uses = saved_uses(graph)
        saved = [dict(_val_info(n), hot=n.name in hot_inputs, **uses[n.name]) for n in phs
                 if "tangents" not in n.name]
        info["saved"] = saved
        # primals_* are the graph's inputs (weights, user inputs): not extra activation memory
        act = [s for s in saved if not s["name"].startswith("primals_")]
        info["saved_activation_bytes"] = sum(s.get("bytes") or 0 for s in act)
        info["saved_hot_bytes"] = sum(s.get("bytes") or 0 for s in act if s["hot"])
    else:
        info["outputs"] = forward_producers(graph)
    return info


class _PostGradDump(_PassBase):
    """Inductor's ``post_grad_custom_post_pass``: run the user's hook (if any), then dump.

    A ``CustomInferenceAwareGraphPass`` so Inductor tells us (and a hook of the user's that
    wants it) whether the graph is an inference graph. ``uuid()`` is None: Inductor then
    bypasses its caches for this graph, which a dump wants (a cache hit would skip the pass).
    """

    def __init__(self, config, graph_index: int, user_hook):
        self.config, self.graph_index, self.user_hook = config, graph_index, user_hook

    def uuid(self):
        return None

    def __call__(self, graph: torch.fx.Graph, is_inference: Optional[bool] = None) -> None:
        hooks = self.user_hook if isinstance(self.user_hook, (list, tuple)) else \
            ([self.user_hook] if self.user_hook is not None else [])
        for h in hooks:
            if _PassBase is not object and isinstance(h, _PassBase):
                h(graph, is_inference=bool(is_inference))
            else:
                h(graph)
        try:
            self._dump(graph, is_inference)
        except Exception as e:  # noqa: BLE001
            log.warning("hotcompile: post-grad dump failed for graph %d: %s", self.graph_index, e)

    def _dump(self, graph: torch.fx.Graph, is_inference: Optional[bool]) -> None:
        st = _state(self.config, self.graph_index)
        if any(n.op == "placeholder" and "tangents" in n.name for n in graph.nodes):
            kind = "backward"
        else:
            kind = "inference" if is_inference else "forward"
        gm = graph.owning_module
        text = gm.print_readable(print_output=False) if gm is not None else str(graph)
        path = _unique(st.path, kind, "txt")
        _write(path, f"# graph {self.graph_index}, {kind} graph as compiled by Inductor "
                     f"(post-grad)\n" + text)
        info = _compiled_info(graph)
        info["file"] = os.path.basename(path)
        st.compiled[os.path.splitext(info["file"])[0]] = info
        _save(st)


def fw_bw_dump_patches(config, graph_index: int) -> dict:
    """Inductor config patches that dump the compiled forward/backward graphs of this graph.

    Chains to a ``post_grad_custom_post_pass`` already set in the Inductor config when the
    backend is called (globally or by a ``config.patch`` around the compile), so it keeps
    working. A hook passed through ``torch.compile(options=...)`` is replaced, because the
    backend applies these patches after the options.
    """
    user = torch._inductor.config.post_grad_custom_post_pass
    return {"post_grad_custom_post_pass": _PostGradDump(config, graph_index, user)}
