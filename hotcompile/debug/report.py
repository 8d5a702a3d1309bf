"""What the backend did to each linear layer, as records and a readable table.

Why records first: tests, ``explain()``, dumps and the ``python -m hotcompile.debug``
summary all read the same :class:`SiteRecord` list; the table is just one rendering.
"""
from __future__ import annotations

import dataclasses
import math
from typing import List, Optional

from ..passes.find import LinearSite
from ..passes.lqs import TABLE as LQS

_ITEMSIZE = {"torch.float32": 4, "torch.bfloat16": 2, "torch.float16": 2}


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

    @property
    def rewritten(self) -> bool:
        return self.reason is None

    def refresh_lqs(self) -> None:
        """Pull the site's current LQS state (choices change at run time)."""
        c = LQS.sites.get(self.key)
        if c is None or not self.rewritten or not self.gx_path.startswith("HQ"):
            return
        self.lqs_choice = c.choice
        if c.window:
            self.lqs_err_token, self.lqs_err_tensor = c.errors()


def _ints(*vals) -> bool:
    return all(isinstance(v, int) for v in vals)


def record_site(site: LinearSite, graph_index: int, config) -> SiteRecord:
    dtype = str(site.dtype) if site.dtype is not None else "?"
    before = after = None
    if _ints(site.L, site.I) and dtype in _ITEMSIZE and site.gw is not None:
        # x is saved for backward only for g_W (a frozen layer saves nothing)
        before = site.L * site.I * _ITEMSIZE[dtype]
        after = before
        if site.eligible and site.abc == "forward":
            # int8 levels (4-bit levels are carried in int8 too) + one fp32 scale
            after = math.ceil(site.L / config.block) * config.rank * site.I + 4
        elif site.eligible and "shares" in site.abc:
            before = after = 0
    if site.eligible:
        scale = "lqs" if config.gx_scale == "lqs" else config.gx_scale
        gx = f"HQ int{config.gx_bits} ({scale})" if site.gx is not None else "- (x needs no grad)"
        gw = f"HLA r={config.rank}/{config.block} int{config.gw_bits}"
    else:
        gx = "exact" if site.gx is not None else "-"
        gw = "exact" if site.gw is not None else "-"
    rec = SiteRecord(graph=graph_index, name=site.name, key=site.key, L=site.L, I=site.I,
                     O=site.O, dtype=dtype.replace("torch.", ""), gx_path=gx, gw_path=gw,
                     abc=site.abc if site.eligible else "-", saved_before=before,
                     saved_after=after, reason=site.reason)
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

    @property
    def rewritten(self) -> List[SiteRecord]:
        return [r for r in self.layers if r.rewritten]

    @property
    def exact(self) -> List[SiteRecord]:
        return [r for r in self.layers if not r.rewritten]

    def saved_bytes(self) -> tuple[int, int]:
        b = sum(r.saved_before or 0 for r in self.layers)
        a = sum(r.saved_after or 0 for r in self.layers)
        return b, a

    def to_dict(self) -> dict:
        for r in self.layers:
            r.refresh_lqs()
        return {"layers": [dataclasses.asdict(r) for r in self.layers], "errors": self.errors}

    def __str__(self) -> str:
        for r in self.layers:
            r.refresh_lqs()
        head = ("graph", "layer", "L", "I", "O", "dtype", "g_x", "g_W", "ABC", "saved x",
                "LQS", "why exact")
        rows = [head]
        for r in self.layers:
            saved = "-" if r.saved_before is None else \
                f"{_fmt_bytes(r.saved_before)} -> {_fmt_bytes(r.saved_after)}"
            lqs = r.lqs_choice or "-"
            if r.lqs_err_token is not None:
                lqs += f" (e_tok {r.lqs_err_token:.3f}, e_ten {r.lqs_err_tensor:.3f})"
            rows.append((str(r.graph), r.name, str(r.L), str(r.I), str(r.O), r.dtype,
                         r.gx_path, r.gw_path, r.abc.split(" (")[0], saved, lqs,
                         r.reason or ""))
        widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        b, a = self.saved_bytes()
        lines.append(f"{len(self.rewritten)}/{len(self.layers)} linear layers rewritten; "
                     f"linear inputs saved for backward: {_fmt_bytes(b)} -> {_fmt_bytes(a)}"
                     + (f" ({b / a:.1f}x smaller)" if a else ""))
        lines += [f"pass failed, left to Inductor: {e}" for e in self.errors]
        return "\n".join(lines)

    __repr__ = __str__
