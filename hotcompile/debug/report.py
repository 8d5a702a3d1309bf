"""What the backend did to each linear layer, as records and a readable table.

Why records first: tests, ``explain()``, dumps and the ``python -m hotcompile.debug``
summary all read the same :class:`SiteRecord` list; the table is just one rendering.
"""
from __future__ import annotations

import collections
import dataclasses
import math
from typing import TYPE_CHECKING, List, Optional

from ..runtime import rank as RANK
from ..runtime.lqs import TABLE as LQS

if TYPE_CHECKING:                      # debug sits below passes: no import at run time
    from ..passes.find import LinearSite

_ITEMSIZE = {"torch.float32": 4, "torch.bfloat16": 2, "torch.float16": 2}


def hint(v) -> object:
    """A concrete int for a size without installing a guard (a SymInt's hint), or its text."""
    if isinstance(v, int):
        return v
    h = getattr(getattr(v, "node", None), "hint", None)
    return int(h) if h is not None else str(v)


@dataclasses.dataclass
class SiteRecord:
    graph: int
    name: str
    key: str
    L: object
    I: object
    O: object
    dtype: str
    gx_path: str
    gw_path: str
    abc: str
    saved_before: Optional[int]
    saved_after: Optional[int]
    reason: Optional[str]
    lqs_choice: Optional[str] = None
    lqs_err_token: Optional[float] = None
    lqs_err_tensor: Optional[float] = None
    rank: Optional[object] = None          # HLA rank used (int), "auto (calibrating)", or None
    rank_errors: Optional[dict] = None     # rank="auto": measured g_W error per rank
    layout: Optional[str] = None           # token layout of x's rows (or why unknown)
    predicted_ms: Optional[list] = None    # cost gate: [exact, HOT] backward ms (GPU only)
    cost_model: Optional[str] = None       # which calibration predicted it
    compiled_for: Optional[str] = None     # a module running the graph compiled for this key
    inference: bool = False                # from a graph compiled without grad (no backward)
    forward: str = "bf16"                  # forward GEMM: "bf16", "fp8" or "fp8_rowwise"
    forward_reason: str = ""               # why it stayed bf16 although FP8 was asked for
    forward_ms: Optional[list] = None      # forward cost gate: [bf16, FP8] ms (GPU only)
    forward_pad: int = 0                   # zero rows padding W's FP8 operand (O % 16 != 0)
    w_operand: str = ""                    # "fp32 parameter": g_x reads it (recompute_operands);
    #                                        "hot::weight_cast copy": W and its column maxima
    #                                        from one forward kernel (passes/weight_cast.py)
    launch: str = ""                       # "Inductor" (spliced) or "hot:: op (why not)"
    x_cast: str = ""                       # x made with its FP8 operand by one kernel of its
    #                                        producer's: "GELU (<how it launches>)"

    @property
    def rewritten(self) -> bool:
        return self.reason is None

    runtime_key: str = ""
    rank_key: str = ""

    def refresh_lqs(self) -> None:
        """Pull the site's current run-time state (LQS and rank choices change at run time)."""
        st = RANK.STATES.get(self.rank_key) if self.rank_key else None
        if st is not None and st.errors:
            self.rank_errors = dict(st.errors)
            if self.rank == "auto (calibrating)":
                self.rank = f"auto -> {st.chosen}"
        c = LQS.sites.get(self.runtime_key or self.key)
        if c is None or not self.rewritten or not self.gx_path.startswith("HQ"):
            return
        self.lqs_choice = c.choice
        if c.window:
            self.lqs_err_token, self.lqs_err_tensor = c.errors()


def _ints(*vals) -> bool:
    return all(isinstance(v, int) for v in vals)


def record_site(site: "LinearSite", graph_index: int, config, plan=None) -> SiteRecord:
    dtype = str(site.dtype) if site.dtype is not None else "?"
    before = after = None
    rank = site.rank if site.eligible and site.gw is not None else None
    if _ints(site.L, site.I) and dtype in _ITEMSIZE and site.gw is not None:
        # x is saved for backward only for g_W (a frozen layer saves nothing)
        before = site.L * site.I * _ITEMSIZE[dtype]
        after = before
        if site.eligible and site.abc == "forward" and isinstance(rank, int):
            # 8-bit values (int8 levels, 4-bit ones carried in int8 too, or e4m3) + one fp32 scale
            # (per-sequence padding of a known layout adds at most block-1 tokens/sequence)
            after = math.ceil(site.L / config.block) * rank * site.I + 4
        elif site.eligible and "shares" in site.abc:
            before = after = 0
        elif site.eligible and site.abc.startswith("rebuilt"):
            after = 0           # recompute_operands: nothing kept for it (passes/recompute.py)
    measuring = bool(site.rewritten_gw is not None and site.rewritten_gw.args[8])
    if site.eligible:
        scale = "lqs" if config.gx_scale == "lqs" else config.gx_scale
        gx = (f"HQ g{config.gx_bits}/w{config.gx_w_bits} ({scale})" if site.gx is not None
              else f"FP8 e4m3 g/W, no Hadamard ({site.gx_kept})" if site.gx_e4m3
              else f"exact ({site.gx_kept})" if site.gx_kept else "- (x needs no grad)")
        fmt = "e4m3" if site.gw_format == "e4m3" else f"int{config.gw_bits}"
        gw = f"HLA r={rank}/{config.block} {fmt}" if site.gw is not None else "- (frozen weight)"
        if site.gw_fp32:        # the GEMM writes the fp32 parameter's gradient (grad_cast.py)
            gw += " -> fp32"
    else:       # exact_gx moved a kept site's g_x mm to ``gx_exact``: still computed
        gx = "exact" if site.gx is not None or site.gx_exact is not None else "-"
        gw = "exact" if site.gw is not None else "-"
    prefix = plan.prefix if plan is not None else ""
    rec = SiteRecord(graph=graph_index, name=site.name, key=site.key, L=site.L, I=site.I,
                     O=site.O, dtype=dtype.replace("torch.", ""), gx_path=gx, gw_path=gw,
                     abc=site.abc if site.eligible else "-", saved_before=before,
                     saved_after=after, reason=site.reason,
                     rank="auto (calibrating)" if measuring else rank,
                     forward=site.forward, forward_reason=site.forward_reason,
                     forward_pad=site.forward_pad,
                     w_operand="fp32 parameter" if site.eligible and site.w_chain else
                     "hot::weight_cast copy" if site.eligible and site.w_cast is not None else "",
                     launch=site.launch if site.eligible else "",
                     x_cast=f"GELU ({site.x_cast_launch})" if site.x_cast is not None else "",
                     forward_ms=[round(v, 4) for v in site.forward_ms]
                     if site.forward_ms else None,
                     layout=site.layout.describe() if site.layout is not None else None,
                     predicted_ms=[round(site.cost[0], 4), round(site.cost[1], 4)]
                     if site.cost and site.cost[0] is not None else None,
                     cost_model=site.cost[2] if site.cost else None,
                     runtime_key=f"{prefix}/{site.key}" if prefix else site.key,
                     rank_key=site.rewritten_gw.args[8] if measuring else
                     (f"{prefix}/{site.group}" if prefix and site.group else ""))
    rec.refresh_lqs()
    return rec


def _fmt_bytes(n: Optional[int]) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


@dataclasses.dataclass
class Report:
    """All linear sites of one or more compiled graphs."""

    layers: List[SiteRecord] = dataclasses.field(default_factory=list)
    errors: List[str] = dataclasses.field(default_factory=list)  # graphs the pass gave up on
    notes: List[str] = dataclasses.field(default_factory=list)   # run-time decisions worth knowing
    # per graph: what ``saved_activations="fp8"`` did to the tensors kept for backward
    # (``passes.saved.SavedSummary.to_dict()``)
    saved: dict = dataclasses.field(default_factory=dict)

    @property
    def training(self) -> List[SiteRecord]:
        """Sites of graphs with a backward: what the totals count."""
        return [r for r in self.layers if not r.inference]

    @property
    def inference(self) -> List[SiteRecord]:
        """Sites of graphs compiled without grad (eval / no_grad forwards): reported apart."""
        return [r for r in self.layers if r.inference]

    @property
    def rewritten(self) -> List[SiteRecord]:
        return [r for r in self.training if r.rewritten]

    @property
    def exact(self) -> List[SiteRecord]:
        return [r for r in self.training if not r.rewritten]

    def saved_bytes(self) -> tuple[int, int]:
        b = sum(r.saved_before or 0 for r in self.training)
        a = sum(r.saved_after or 0 for r in self.training)
        return b, a

    def to_dict(self) -> dict:
        for r in self.layers:
            r.refresh_lqs()
        return {"layers": [dataclasses.asdict(r) for r in self.layers], "errors": self.errors,
                "notes": self.notes, "saved": {str(g): d for g, d in self.saved.items()}}

    def _saved_lines(self) -> List[str]:
        """One line per graph whose kept activations ``saved_activations`` looked at: what it
        narrowed, or why nothing (an fp32 graph under the default ``"auto"``)."""
        lines = []
        for g, d in sorted(self.saved.items()):
            formats = d.get("formats", {"fp8": d["compressed"]})    # older stores: all FP8
            narrowed = ", ".join(
                f"{n} rebuilt from another in backward" if f == "rebuilt"
                else f"{n} in {'FP8' if f == 'fp8' else f}" for f, n in sorted(formats.items()) if n)
            line = (f"graph {g}: activations kept for backward {_fmt_bytes(d['bytes_before'])} "
                    f"-> {_fmt_bytes(d['bytes_after'])} ({narrowed or 'none narrowed'}, "
                    f"{d['kept']} exact")
            if d["reasons"]:
                line += ": " + ", ".join(f"{n} {w}" for w, n in list(d["reasons"].items())[:4])
            lines.append(line + ")")
        return lines

    def _launch_lines(self) -> List[str]:
        """How the rewritten layers' kernels launch (``HOTConfig.splice``), on GPU graphs:
        by Inductor, or through ``hot::`` ops with the reasons counted."""
        how = [r.launch for r in self.rewritten if r.launch]
        gpu = [h for h in how if "not on a CUDA device" not in h]
        if not gpu:
            return []
        ops = collections.Counter(h for h in gpu if not h.startswith("Inductor"))
        line = (f"kernels launched by Inductor at {len(gpu) - sum(ops.values())}/{len(gpu)} "
                f"rewritten layers")
        if ops:
            line += "; through hot:: ops at " + ", ".join(f"{n} ({h})" for h, n in ops.items())
        return [line]

    def __str__(self) -> str:
        for r in self.layers:
            r.refresh_lqs()
        head = ("graph", "layer", "L", "I", "O", "dtype", "fwd", "g_x", "g_W", "ABC", "saved x",
                "LQS", "pred. ms exact/HOT", "why exact")
        rows = [head]
        for r in self.training:
            saved = "-" if r.saved_before is None else \
                f"{_fmt_bytes(r.saved_before)} -> {_fmt_bytes(r.saved_after)}"
            lqs = r.lqs_choice or "-"
            if r.lqs_err_token is not None:
                lqs += f" (e_tok {r.lqs_err_token:.3f}, e_ten {r.lqs_err_tensor:.3f})"
            rows.append((str(r.graph), r.key, str(r.L), str(r.I), str(r.O), r.dtype,
                         r.forward + (" (x from GELU's kernel)" if r.x_cast else "")
                         + (f" (W padded to {r.O + r.forward_pad} rows)" if r.forward_pad
                            else ""),
                         r.gx_path, r.gw_path, r.abc.split(" (")[0], saved, lqs,
                         "-" if not r.predicted_ms else
                         f"{r.predicted_ms[0]:.3f}/{r.predicted_ms[1]:.3f}",
                         r.reason or (r.forward_reason and f"forward bf16: {r.forward_reason}")))
        widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        b, a = self.saved_bytes()
        lines.append(f"{len(self.rewritten)}/{len(self.training)} linear layers rewritten; "
                     f"linear inputs saved for backward: {_fmt_bytes(b)} -> {_fmt_bytes(a)}"
                     + (f" ({b / a:.1f}x smaller)" if a else ""))
        forward_only = [r for r in self.exact if r.forward != "bf16"]
        if forward_only:
            lines.append(f"{len(forward_only)} more with an FP8 forward and an exact backward "
                         f"(the cost gate kept HOT's backward, not the forward's FP8 GEMM)")
        lines += self._launch_lines()
        lines += self._saved_lines()
        ungated = sorted({r.cost_model for r in self.layers
                          if r.cost_model and r.cost_model.startswith("not gated")})
        lines += [f"cost gate not applied: {u.split(': ', 1)[1]} (min_speedup applies on GPUs)"
                  for u in ungated]
        per_graph: dict = {}
        for r in self.inference:
            per_graph[r.graph] = per_graph.get(r.graph, 0) + 1
        lines += [f"inference graph {g} (compiled without grad): {n} linear layer"
                  f"{'s' if n != 1 else ''}, not rewritten: no backward"
                  for g, n in per_graph.items()]
        shared: dict = {}
        for r in self.layers:
            if r.compiled_for:
                shared.setdefault((r.graph, r.compiled_for), []).append(r.key)
        lines += [f"graph {g}: {', '.join(keys)} run{'s' if len(keys) == 1 else ''} the code "
                  f"compiled for {orig} (Dynamo reuses one graph for modules it cannot tell "
                  f"apart)" for (g, orig), keys in shared.items()]
        lines += [f"pass failed, left to Inductor: {e}" for e in self.errors]
        lines += self.notes
        return "\n".join(lines)

    __repr__ = __str__
