"""Read a HOT dump directory back: the data of report.json, and its text / markdown renderings.

Why it works from the files alone: the person reading a dump is often not on the machine
the job ran on. Nothing here imports torch or needs the process that compiled; ``load_dump``
gathers every graph folder's ``graph.json`` (and, for folders that were not copied, the
graphs listed in ``report.json``), so ``python -m hotcompile.debug DIR`` summarises a
directory several processes wrote into, or a lone report.json.
"""
from __future__ import annotations

import json
import os
import time
from collections import OrderedDict
from typing import List, Optional


# --------------------------------------------------------------------------- loading
def _read_json(path: str) -> Optional[dict]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def load_dump(path: str, from_report: bool = True) -> dict:
    """All graphs of a dump directory (or of one report.json), with totals and warnings.

    ``from_report``: also take the graphs report.json lists whose folders are absent (a
    reader given only report.json); the writer passes False, the folders being the truth.
    """
    graphs = OrderedDict()
    root = path
    if os.path.isfile(path):
        root = os.path.dirname(os.path.abspath(path))
        report = _read_json(path) or {}
        for g in report.get("graphs", []):
            graphs[g["folder"]] = g
    else:
        report = (_read_json(os.path.join(path, "report.json")) or {}) if from_report else {}
        for g in report.get("graphs", []):
            graphs[g["folder"]] = g
        for name in sorted(os.listdir(path)) if os.path.isdir(path) else []:
            g = _read_json(os.path.join(path, name, "graph.json"))
            if g is not None:                   # the folder's own file is the freshest copy
                graphs[name] = g
    ordered = sorted(graphs.values(), key=lambda g: (g["process"].get("started", ""),
                                                      g["process"].get("pid", 0), g["graph"]))
    return {"version": 1, "dump_dir": os.path.abspath(root),
            "written": time.strftime("%Y-%m-%dT%H:%M:%S"), "graphs": ordered,
            "totals": _totals(ordered), "fallbacks": _fallbacks(ordered), "lqs": _lqs(ordered),
            "saved": saved_by_producer(ordered),
            "warnings": _warnings(ordered)}


def is_inference(g: dict) -> bool:
    """A graph compiled without grad (no backward): its sites are listed, never counted."""
    return bool(g["sites"]) and all(s.get("inference") for s in g["sites"]) or (
        not g["sites"] and any(k.startswith("inference") for k in g.get("compiled", {})))


def _totals(graphs: List[dict]) -> dict:
    inference = [g for g in graphs if is_inference(g)]
    graphs = [g for g in graphs if not is_inference(g)]
    sites = [s for g in graphs for s in g["sites"]]
    costs = [s["cost"] for s in sites if s.get("cost")]
    t = {"graphs": len(graphs), "sites": len(sites),
         "inference_graphs": len(inference),
         "inference_sites": sum(len(g["sites"]) for g in inference),
         "rewritten": sum(s["rewritten"] for s in sites),
         "saved_before": sum(s["saved_before"] or 0 for s in sites),
         "saved_after": sum(s["saved_after"] or 0 for s in sites),
         "processes": len({(g["process"].get("host"), g["process"].get("pid"),
                            g["process"].get("started")) for g in graphs + inference})}
    for k in ("flops_before", "flops_after", "bytes_before", "bytes_after", "gy_fused_saving"):
        t[k] = sum(c[k] for c in costs)
    t["sites_without_cost"] = len(sites) - len(costs)
    return t


def _forward_of(g: dict, backward_key: str) -> dict:
    """The forward graph's outputs paired with a backward dump (``backward_1`` with
    ``forward_1``); any forward of the graph when the pair is missing."""
    comp = g.get("compiled", {})
    pair = comp.get("forward" + backward_key[len("backward"):], {}).get("outputs")
    if pair is not None:
        return pair
    merged: dict = {}
    for k, info in comp.items():
        if k.startswith("forward"):
            merged.update(info.get("outputs", {}))
    return merged


def saved_tensors(g: dict) -> List[dict]:
    """Every tensor a graph's forward kept for its backward: name, bytes, dtype, shape, what
    produced it and what backward uses it for (``debug/saved.py``)."""
    out = []
    for key, info in sorted(g.get("compiled", {}).items()):
        if "saved" not in info:
            continue
        producers = _forward_of(g, key)
        for t in info["saved"]:
            p = producers.get(t["name"], {})
            out.append(dict(t, graph=g["graph"], backward=key,
                            producer=p.get("producer", "?"), module=p.get("module")))
    return out


def saved_by_producer(graphs: List[dict]) -> List[dict]:
    """Kept tensors grouped by (producer, use), largest first: count and bytes. Graph inputs
    (parameters, the user's inputs) are listed but live anyway; ``activation`` says which
    rows are memory the step adds."""
    by: "OrderedDict[tuple, dict]" = OrderedDict()
    for g in graphs:
        if is_inference(g):
            continue
        for t in saved_tensors(g):
            key = (t["producer"], ", ".join(t.get("use", [])) or "?")
            row = by.setdefault(key, {"producer": key[0], "use": key[1], "count": 0,
                                      "bytes": 0, "unknown": 0,
                                      "activation": t["producer"] != "graph input"})
            row["count"] += 1
            if t.get("bytes") is None:
                row["unknown"] += 1
            else:
                row["bytes"] += t["bytes"]
    return sorted(by.values(), key=lambda r: -r["bytes"])


def _fallbacks(graphs: List[dict]) -> List[dict]:
    """Exact sites grouped by reason: the first thing to read when a layer was not rewritten."""
    by = OrderedDict()
    for g in graphs:
        if is_inference(g):
            continue
        for s in g["sites"]:
            if not s["rewritten"]:
                by.setdefault(s["reason"], []).append(f"{s['name']} (graph {g['graph']})")
    return [{"reason": r, "count": len(v), "layers": v} for r, v in by.items()]


def _lqs(graphs: List[dict]) -> List[dict]:
    out = []
    for g in graphs:
        for s in g["sites"]:
            if s.get("lqs_choice"):
                out.append({"graph": g["graph"], "site": s["key"], "choice": s["lqs_choice"],
                            "source": s.get("lqs_source"), "err_token": s.get("lqs_err_token"),
                            "err_tensor": s.get("lqs_err_tensor")})
    return out


def _warnings(graphs: List[dict]) -> List[str]:
    out = []
    for g in graphs:
        where = f"graph {g['graph']} ({g['folder']})"
        if not g.get("joint_dumped"):
            out.append(f"{where}: no joint-graph dump: HOT's pass did not run or failed (look "
                       f"for 'joint-graph pass failed' in the job's log)")
        n_rw = sum(s["rewritten"] for s in g["sites"])
        n_hla = sum(s["rewritten"] and str(s.get("gw_path", "")).startswith("HLA")
                    for s in g["sites"])     # frozen weights: HQ only, no g_W
        for kind, info in g.get("compiled", {}).items():
            n_ops = info["hot_ops"]["hla"] + info["hot_ops"].get("unit", 0) \
                + info["hot_ops"].get("e4m3gx", 0)
            if kind.startswith("backward") and n_ops != n_hla:
                out.append(f"{where}: {info['file']} has {n_ops} hla_grad_weight / "
                           f"linear_backward ops but {n_hla} sites have an HLA g_W")
        if g.get("joint_dumped") and n_rw and not any(k.startswith("backward")
                                                      for k in g.get("compiled", {})):
            out.append(f"{where}: no backward graph dumped (backward not run yet, or the "
                       f"process ended first)")
    return out


# --------------------------------------------------------------------------- formatting
def fmt_bytes(n) -> str:
    if n is None:
        return "?"
    n = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def fmt_flops(n) -> str:
    if n is None:
        return "?"
    for unit, div in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} FLOP"


def _ratio(a, b) -> str:
    return f" ({a / b:.2f}x)" if a and b else ""


def _lqs_cell(s: dict) -> str:
    c = s.get("lqs_choice") or "-"
    if s.get("lqs_err_token") is not None:
        c += f" (e_tok {s['lqs_err_token']:.3f}, e_ten {s['lqs_err_tensor']:.3f})"
    return c


def site_rows(g: dict) -> List[List[str]]:
    head = ["layer", "L", "I", "O", "dtype", "g_x", "g_W", "ABC", "saved x", "bwd FLOPs",
            "bwd bytes", "LQS"]
    rows = [head]
    for s in g["sites"]:
        c = s.get("cost") or {}
        saved = "-" if s["saved_before"] is None else \
            f"{fmt_bytes(s['saved_before'])} -> {fmt_bytes(s['saved_after'])}"
        fl = f"{fmt_flops(c.get('flops_before'))} -> {fmt_flops(c.get('flops_after'))}" \
            if c else "?"
        by = f"{fmt_bytes(c.get('bytes_before'))} -> {fmt_bytes(c.get('bytes_after'))}" \
            if c else "?"
        rows.append([s["key"], str(s["L"]), str(s["I"]), str(s["O"]), s["dtype"], s["gx_path"],
                     s["gw_path"], s["abc"].split(" (")[0], saved, fl, by, _lqs_cell(s)])
    return rows


def saved_rows(saved: List[dict]) -> List[List[str]]:
    """The by-producer table; graph inputs (parameters, user inputs) marked, as they are
    held whether or not backward keeps them."""
    total = sum(r["bytes"] for r in saved if r["activation"]) or None
    rows = [["producer", "used by", "tensors", "bytes", "share"]]
    for r in saved:
        b = fmt_bytes(r["bytes"]) + (f" + {r['unknown']} symbolic" if r["unknown"] else "")
        share = f"{100 * r['bytes'] / total:.1f}%" if r["activation"] and total else "(held anyway)"
        rows.append([r["producer"], r["use"], str(r["count"]), b, share])
    return rows


def _table(rows: List[List[str]], indent: str = "  ") -> List[str]:
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = [indent + "  ".join(c.ljust(x) for c, x in zip(r, w)).rstrip() for r in rows]
    out.insert(1, indent + "  ".join("-" * x for x in w))
    return out


def _md_table(rows: List[List[str]]) -> List[str]:
    esc = [[c.replace("|", "\\|") for c in r] for r in rows]
    return (["| " + " | ".join(esc[0]) + " |", "|" + "---|" * len(esc[0])]
            + ["| " + " | ".join(r) + " |" for r in esc[1:]])


def _config_line(cfg: dict) -> str:
    keys = ("rank", "block", "gx_bits", "gw_bits", "gx_w_bits", "gx_scale", "kernels",
            "min_features", "include", "exclude", "abc")
    return " ".join(f"{k}={cfg.get(k)!r}" for k in keys if k in cfg)


def _compiled_lines(g: dict) -> List[str]:
    out = []
    for kind, info in sorted(g.get("compiled", {}).items()):
        ops = ", ".join(f"{k} {v}" for k, v in info["hot_ops"].items())
        line = f"{info['file']}: hot ops: {ops}; exact mm/addmm {info['exact_mm']}"
        if "saved" in info:
            line += (f"; saved for backward: {len(info['saved'])} tensors, activations "
                     f"{fmt_bytes(info['saved_activation_bytes'])} (HOT buffers "
                     f"{fmt_bytes(info['saved_hot_bytes'])})")
        out.append(line)
    return out


def _process(g: dict) -> str:
    p = g["process"]
    rank = f" rank {p['rank']}" if p.get("rank") else ""
    return f"pid {p.get('pid')}{rank} on {p.get('host')}, started {p.get('started')}"


def _totals_lines(t: dict) -> List[str]:
    out = [f"{t['rewritten']}/{t['sites']} linear sites rewritten in {t['graphs']} training "
           f"graph(s) from {t['processes']} process(es)"]
    if t.get("inference_graphs"):
        out.append(f"{t['inference_graphs']} inference graph(s) (compiled without grad): "
                   f"{t['inference_sites']} linear sites, not rewritten: no backward")
    return out + [
        f"linear inputs saved for backward: {fmt_bytes(t['saved_before'])} -> "
        f"{fmt_bytes(t['saved_after'])}{_ratio(t['saved_before'], t['saved_after'])}",
        f"backward FLOPs (cost model): {fmt_flops(t['flops_before'])} -> "
        f"{fmt_flops(t['flops_after'])}",
        f"backward bytes moved (cost model): {fmt_bytes(t['bytes_before'])} -> "
        f"{fmt_bytes(t['bytes_after'])}; a fused g_y read would save "
        f"{fmt_bytes(t['gy_fused_saving'])} more"
        + (f"; {t['sites_without_cost']} site(s) with symbolic sizes not counted"
           if t["sites_without_cost"] else "")]


# --------------------------------------------------------------------------- renderings
def render_text(data: dict) -> str:
    """The CLI's summary: graphs, sites, paths, fallbacks with reasons, bytes, LQS."""
    L = [f"HOT dump {data['dump_dir']}"]
    if not data["graphs"]:
        return "\n".join(L + ["no graphs found (no graph*/graph.json and no report.json)"])
    procs = OrderedDict((_process(g), None) for g in data["graphs"])
    L += [f"process: {p}" for p in procs]
    for g in data["graphs"]:
        n_rw = sum(s["rewritten"] for s in g["sites"])
        what = (f"inference graph (compiled without grad): {len(g['sites'])} linear sites, not "
                f"rewritten: no backward" if is_inference(g) else
                f"{len(g['sites'])} linear sites, {n_rw} rewritten, {len(g['sites']) - n_rw} exact")
        L += ["", f"graph {g['graph']} [{g['folder']}]: {what}",
              f"  config: {_config_line(g['config'])}"]
        if g["sites"]:
            L += _table(site_rows(g))
        for s in g["sites"]:
            if not s["rewritten"]:
                L.append(f"  exact: {s['key']}: {s['reason']}")
        L += [f"  {line}" for line in _compiled_lines(g)]
        L.append(f"  files: {' '.join(g.get('files', []))}")
    L += ["", "totals:"] + [f"  {x}" for x in _totals_lines(data["totals"])]
    if data.get("saved"):
        L += ["", "kept for backward, by producer and use (all graphs):"] + \
            _table(saved_rows(data["saved"]))
    if data["fallbacks"]:
        L += ["", "fallbacks (sites left exact, by reason):"]
        for f in data["fallbacks"]:
            L.append(f"  {f['count']}x {f['reason']}: {', '.join(f['layers'])}")
    if data["lqs"]:
        L += ["", "LQS (g_x scale per site):"]
        for q in data["lqs"]:
            err = "" if q["err_token"] is None else \
                f", e_tok {q['err_token']:.4f} e_ten {q['err_tensor']:.4f}"
            L.append(f"  graph {q['graph']} {q['site']}: {q['choice']} ({q['source']}{err})")
    if data["warnings"]:
        L += ["", "warnings:"] + [f"  {w}" for w in data["warnings"]]
    return "\n".join(L)


def render_markdown(data: dict) -> str:
    """report.md: the same content as the CLI, as markdown tables."""
    L = [f"# HOT report: `{data['dump_dir']}`", "", f"written {data['written']}", ""]
    L += [f"- {x}" for x in _totals_lines(data["totals"])]
    for g in data["graphs"]:
        title = " (inference: compiled without grad, no backward)" if is_inference(g) else ""
        L += ["", f"## graph {g['graph']} (`{g['folder']}`){title}", "",
              f"{_process(g)}; torch {g.get('torch')}", "",
              f"config: `{_config_line(g['config'])}`", ""]
        if g["sites"]:
            L += _md_table(site_rows(g))
        exact = [s for s in g["sites"] if not s["rewritten"]]
        if exact:
            L += ["", "Left exact:", ""] + [f"- `{s['key']}`: {s['reason']}" for s in exact]
        comp = _compiled_lines(g)
        if comp:
            L += ["", "Compiled graphs:", ""] + [f"- {c}" for c in comp]
        L += ["", "Files: " + ", ".join(f"`{f}`" for f in g.get("files", []))]
    if data.get("saved"):
        L += ["", "## Kept for backward, by producer and use", ""] + \
            _md_table(saved_rows(data["saved"]))
    if data["fallbacks"]:
        L += ["", "## Fallbacks by reason", ""]
        L += [f"- {f['count']}x {f['reason']}: {', '.join(f['layers'])}" for f in data["fallbacks"]]
    if data["lqs"]:
        L += ["", "## LQS choices", ""]
        rows = [["graph", "site", "choice", "source", "e_tok", "e_ten"]]
        for q in data["lqs"]:
            rows.append([str(q["graph"]), q["site"], q["choice"], str(q["source"]),
                         "-" if q["err_token"] is None else f"{q['err_token']:.4f}",
                         "-" if q["err_tensor"] is None else f"{q['err_tensor']:.4f}"])
        L += _md_table(rows)
    if data["warnings"]:
        L += ["", "## Warnings", ""] + [f"- {w}" for w in data["warnings"]]
    return "\n".join(L) + "\n"
