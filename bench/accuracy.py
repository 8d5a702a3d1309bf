"""Accuracy of HOT training: a byte-level GPT on real text, a ViT on real digits, gradient fidelity.

    python bench/accuracy.py --suite smoke --out /tmp/r        # CPU, tiny sizes
    python bench/accuracy.py --suite gate --out $OUT            # the acceptance run (H100, ~9 min)
    python bench/accuracy.py --suite full --out $OUT            # the H100 run (< 9 min)
    python bench/accuracy.py --suite full --parts lm --lm-modes hot --out $OUT
    python bench/accuracy.py --suite full --parts lm --lm-corpora stdlib,torchsrc \\
        --hot-variants "default;rank=16;gx_bits=8" --out $OUT  # candidate defaults, side by side
    python bench/accuracy.py --docs-only bench/results           # refresh the docs section

Three parts, all on the same seed and the same batches for every mode:

* ``lm``: a byte-level GPT (57M parameters at full size) trained for a fixed number of steps
  on real Python source, split by file into train/validation, one run set per corpus
  (``--lm-corpora``): ``stdlib`` = the Python standard library's own ``.py`` files
  (``sysconfig.get_paths()["stdlib"]``, the default), ``torchsrc`` = the ``.py`` files of the
  installed ``torch`` package. Modes: ``inductor`` (torch.compile, bf16 autocast, trained once
  per corpus), ``hot`` (backend="hot" defaults, bf16 autocast) and its variants, and on
  request ``fp32`` (eager; TF32 matmuls at full size, see ``--no-tf32``). Validation-loss
  curves, final losses, the relative gap of every hot variant to inductor, per corpus.
* ``digits``: a ViT on scikit-learn's handwritten digits (8x8 upsampled to 32x32, patch 4),
  ``fp32`` eager vs ``hot`` (fp32 forward) and its variants: final test accuracy.
* ``fidelity``: per linear site of real models, cosine similarity and relative error of
  g_x and g_W of compiled HOT steps against an fp64 eager copy of the model on the same
  batch (and, for scale, of plain bf16 autocast). Before measuring, ``--fidelity-warmup``
  compiled fwd+bwd passes on the measurement batch without an optimizer step (weights stay
  those of the fp64 reference) let ``rank="auto"`` and LQS calibrate and the graph
  recompile; the HLA rank each site ended with is reported. g_W is the weight's ``.grad``;
  g_x is the gradient of a zero "probe" tensor added to each linear's input by a forward
  pre-hook, which keeps the compiled graph whole (a tensor hook would graph-break).

HOT variants: ``hot`` is ``HOTConfig()`` (what ``backend="hot"`` uses) plus the ``--hot
key=value`` overrides; ``--hot-variants "default;rank=16,gx_bits=8"`` replaces ``hot`` in the
mode lists by ``hot`` and ``hot[rank=16,gx_bits=8]`` (each variant's overrides on top of
``--hot``). A mode may also be named that way directly: ``--lm-modes "inductor,hot[rank=8]"``.

Runs are in-process (``torch._dynamo.reset()`` and a fresh LQS table between them).
Output: ``<out>/accuracy_<date>_<device>.{json,md}`` plus PNG curves;
``--update-docs`` rewrites the section between ``<!-- accuracy:begin -->`` and
``<!-- accuracy:end -->`` of docs/BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import shlex
import statistics
import sys
import time
import zlib
from typing import Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import common as C  # noqa: E402

_LM_FULL = dict(d=768, layers=8, heads=12, seq=512, batch=32, steps=1000, lr=1e-3,
                warmup=100, eval_every=100, val_windows=128, max_bytes=None, tf32=True,
                corpora=["stdlib"], modes=["inductor", "hot"], seeds=1)
_DIGITS_FULL = dict(img=32, patch=4, d=256, layers=6, heads=8, batch=128, steps=600,
                    lr=1e-3, warmup=50, eval_every=50, shift=2, seeds=3, modes=["fp32", "hot"])
SUITES = {
    # fp32 is not in the default LM modes any more (selectable: --lm-modes fp32,inductor,hot):
    # two corpora and hot variants did not fit the 9 minutes with it
    "full": dict(
        lm=dict(_LM_FULL),
        digits=dict(_DIGITS_FULL),
        fidelity=dict(models=["bytegpt", "vit_b16", "gpt2_linear"], avg=4, warmup=3, hot={}),
        parts=["lm", "digits", "fidelity"], budget_s=510.0),
    # exactly what the acceptance criteria need, in one call
    "gate": dict(
        lm=dict(_LM_FULL, corpora=["stdlib", "torchsrc"]),
        digits=dict(_DIGITS_FULL),
        fidelity=dict(models=["vit_b16", "gpt2_linear"], avg=4, warmup=3, hot={}),
        parts=["lm", "digits", "fidelity"], budget_s=520.0),
    "smoke": dict(
        # the LM has the very shapes of train.py's tiny_gpt, so the two smoke runs share
        # Inductor's compiled kernels through its on-disk cache
        lm=dict(d=64, layers=1, heads=4, seq=64, batch=8, steps=16, lr=3e-3, warmup=4,
                eval_every=8, val_windows=8, max_bytes=1_000_000, tf32=False,
                corpora=["stdlib"], modes=["fp32", "inductor", "hot"]),
        digits=dict(img=32, patch=8, d=64, layers=1, heads=4, batch=64, steps=16, lr=3e-3,
                    warmup=4, eval_every=8, shift=1, seeds=1, modes=["fp32", "hot"]),
        fidelity=dict(models=["tiny_gpt"], avg=2, warmup=2, hot={"lqs_calibration_steps": 1}),
        parts=["lm", "digits", "fidelity"], budget_s=None, cpu_amp="none"),
}

CORPORA = {
    "stdlib": "the Python standard library's .py sources",
    "torchsrc": "the installed torch package's .py sources",
    "stdlib-words": "the standard library's .py sources as word-level tokens: a "
                    f"{C.WORD_VOCAB}-token vocabulary (a large LM head, as Llama's 32000)",
    "torchsrc-words": "the installed torch package's .py sources as word-level tokens (the "
                      "same vocabulary rule; a longer corpus than stdlib-words)",
}

# Seconds on one H100 (torch 2.11), measured 2026-11-22 with the suite's full sizes; the
# budget logic and the printed estimate use them (hot: 78-105 s for 1000 LM steps, rank
# auto adds a recompile; digits hot: 98-123 s for 3 seeds).
H100_S = {
    "lm": {"fp32": 48.0, "bf16": 70.0, "inductor": 40.0, "hot": 100.0, "hot_ref": 160.0},
    "lm_compile": 12.0,           # part of the above that does not scale with the steps
    "corpus_load": {"stdlib": 2.0, "torchsrc": 3.0, "stdlib-words": 20.0,
                    "torchsrc-words": 40.0},
    "digits_seed": {"fp32": 6.5, "inductor": 12.0, "hot": 38.0, "hot_ref": 60.0},
    "fidelity": {"bytegpt": 25.0, "vit_b16": 50.0, "gpt2_linear": 60.0, "gpt2": 60.0,
                 "llama_d2048": 60.0},
    "fidelity_variant": 0.6,      # each extra hot variant: this share of the model's time
    "startup": 10.0,
}


def _schedule(step: int, steps: int, warmup: int) -> float:
    """Linear warm-up, then cosine decay to 10%."""
    if step < warmup:
        return (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))


def _adamw(model: nn.Module, lr: float, wd: float, device) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": wd},
                              {"params": other, "weight_decay": 0.0}], lr=lr,
                             betas=(0.9, 0.95),
                             **({"fused": True} if device.type == "cuda" else {}))


def _hot_kwargs(small: bool, extra: dict) -> dict:
    kw = {"min_features": 0} if small else {}
    kw.update(extra)
    return kw


# ----------------------------------------------------------------------------- modes / variants
def variant_modes(spec: Optional[str]) -> Optional[List[str]]:
    """``"default;rank=16,gx_bits=8"`` -> ["hot", "hot[rank=16,gx_bits=8]"]."""
    if not spec:
        return None
    out = []
    for v in (s.strip() for s in spec.split(";")):
        if not v:
            continue
        if v.startswith("hot[") or v.startswith("hot_ref["):
            name = v
        else:
            name = "hot" if v.lower() in ("default", "hot") else f"hot[{v.replace(' ', '')}]"
        if name not in out:
            out.append(name)
    return out or None


def expand_modes(modes: List[str], variants: Optional[List[str]]) -> List[str]:
    """Replace a bare ``hot`` in a mode list by the hot variants (keeping the list's order)."""
    out: List[str] = []
    for m in modes:
        for x in (variants if (variants and m == "hot") else [m]):
            if x not in out:
                out.append(x)
    return out


def is_hot(mode: str) -> bool:
    return C.split_mode(mode)[0] in ("hot", "hot_ref")


def check_modes(modes: List[str], hot_extra: dict, where: str) -> None:
    """Fail before any training when a mode or a HOTConfig override is wrong."""
    for mode in modes:
        base, var = C.split_mode(mode)
        if base not in C.MODE_INFO:
            raise SystemExit(f"{where}: unknown mode {mode!r} (one of {', '.join(C.MODE_INFO)})")
        if var and base not in ("hot", "hot_ref"):
            raise SystemExit(f"{where}: only hot modes take [overrides], got {mode!r}")
        if base in ("hot", "hot_ref"):
            try:
                import hotcompile  # noqa: F401
            except Exception:  # noqa: BLE001 - the runs will report it
                return
            try:
                C.hot_config("auto", **{**hot_extra, **var})
            except (TypeError, ValueError) as e:
                raise SystemExit(f"{where}: bad HOTConfig override in {mode!r}: {e}")


def _site_records(be) -> Dict[str, object]:
    """name -> the backend's latest record of that site (a recompile appends new ones)."""
    out: Dict[str, object] = {}
    for r in getattr(getattr(be, "report", None), "layers", []) or []:
        out[r.name] = r
    return out


def _rank_of(rec) -> object:
    r = getattr(rec, "rank", None) if rec is not None else None
    return r if r is None or isinstance(r, (int, str)) else str(r)


def hot_info(be) -> dict:
    """C.hot_summary plus what the accuracy tables need: the HOTConfig, HLA ranks, graphs."""
    if be is None:
        return {}
    info = C.hot_summary(be)
    try:
        info["hot_config"] = be.config.to_dict()
    except Exception:  # noqa: BLE001
        info["hot_config"] = None
    recs = _site_records(be)
    ranks = [_rank_of(r) for r in recs.values() if getattr(r, "rewritten", False)]
    if any(r is not None for r in ranks):
        hist: Dict[str, int] = {}
        for r in ranks:
            hist[str(r)] = hist.get(str(r), 0) + 1
        info["hot_ranks"] = dict(sorted(hist.items(), key=lambda kv: (len(kv[0]), kv[0])))
    info["hot_graphs"] = len({getattr(r, "graph", None)
                              for r in getattr(be.report, "layers", [])})
    return info


def unapplied(rec: dict) -> str:
    """What a run's HOTConfig asked for and its report says it did not get: an FP8 forward
    some rewritten sites kept in bf16 (row-wise FP8 needs a bf16 forward, so an fp32 model
    takes none), kept activations asked in FP8 with none stored as e4m3 (an fp32 graph has
    only bf16 narrowing). A gate row that passes without them says nothing about them."""
    cfg = rec.get("hot_config") or {}
    out = []
    n = rec.get("hot_sites_rewritten", 0)
    # "auto" (the default) asks for FP8 only where it applies (Hopper, a bf16 forward):
    # sites it kept in bf16 were not refused anything
    if cfg.get("forward", "bf16") not in ("bf16", "auto") and n \
            and rec.get("hot_forward_fp8", n) < n:
        why = "; ".join(rec.get("hot_forward_reasons") or []) or "reason not recorded"
        out.append(f"FP8 forward on {rec['hot_forward_fp8']}/{n} sites ({why})")
    if cfg.get("saved_activations") in ("fp8", "fp8_all") and rec.get("hot_saved_activations"):
        formats: Dict[str, int] = {}
        for g in rec["hot_saved_activations"].values():
            for f, k in (g.get("formats") or {}).items():
                formats[f] = formats.get(f, 0) + k
        if not formats.get("fp8"):
            got = ", ".join(f"{k} in {f}" for f, k in sorted(formats.items())) or "none narrowed"
            out.append(f"kept activations: none in e4m3 ({got})")
    return "; ".join(out)


def _ranks_text(hist: Optional[dict]) -> str:
    if not hist:
        return ""
    return "r " + " ".join(f"{k}x{v}" for k, v in hist.items())


_CFG_KEYS = ("rank", "block", "gx_bits", "gx_w_bits", "gw_bits", "gx_scale", "rank_tolerance",
             "rank_calibration_steps", "rank_calibration_start", "abc", "min_features", "kernels",
             "exclude", "exact_gx", "forward", "min_speedup")   # the head's treatment too


def _cfg_text(cfg: Optional[dict]) -> str:
    if not cfg:
        return "-"
    return ", ".join(f"{k}={cfg[k]}" for k in _CFG_KEYS if k in cfg)


# ----------------------------------------------------------------------------- LM part
def _py_sources(root: str, skip=("__pycache__",), val_every: int = 10):
    """(train, validation) ``.py`` files under root, deterministic order, split by file:
    a file goes to validation when crc32 of its path relative to root is divisible by
    ``val_every`` (the rule of ``C.stdlib_sources``)."""
    train, val = [], []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        for f in sorted(filenames):
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, root)
                (val if zlib.crc32(rel.encode()) % val_every == 0 else train).append(path)
    return train, val


def corpus_sources(name: str):
    """(root, train files, validation files) of a named corpus."""
    if name in ("stdlib", "stdlib-words"):
        return C.stdlib_sources()
    if name in ("torchsrc", "torchsrc-words"):
        root = os.path.dirname(os.path.abspath(torch.__file__))
        return (root, *_py_sources(root))
    raise ValueError(f"unknown corpus {name!r} (one of {', '.join(CORPORA)})")


def _lm_kind(corpus: str) -> str:
    return "word-level" if corpus.endswith("-words") else "byte-level"


def lm_data(cfg: dict, device, corpus: str = "stdlib") -> dict:
    root, train_files, val_files = corpus_sources(corpus)
    limit = cfg.get("max_bytes")
    vocab = 256
    if corpus.endswith("-words"):
        train, val, vocab = C.word_tokens(train_files, val_files, C.WORD_VOCAB, limit)
    else:
        train = C.read_bytes(train_files, limit)
        val = C.read_bytes(val_files, limit // 10 if limit else None)
    need = cfg["seq"] + 2
    if train.numel() <= need or val.numel() <= need:
        raise ValueError(f"corpus {corpus}: {train.numel()} train / {val.numel()} val "
                         f"{'tokens' if vocab > 256 else 'bytes'}, "
                         f"fewer than a window of {need}")
    meta = {"corpus": corpus, "root": root, "python": sys.version.split()[0],
            "torch": torch.__version__, "max_bytes": limit,
            "train_files": len(train_files), "val_files": len(val_files),
            "train_bytes": int(train.numel()), "val_bytes": int(val.numel()), "vocab": vocab}
    if corpus == "stdlib":
        meta["stdlib"] = root
    return {"train": train.to(device), "val": val.to(device), "meta": meta}


def train_lm(mode: str, cfg: dict, data: dict, device, amp: Optional[str], hot_extra: dict,
             seed: int, keep_state: bool = False) -> dict:
    C.reset_compile_state()
    torch.manual_seed(seed)
    base_mode, variant = C.split_mode(mode)
    with torch.device(device):
        gpt = C.GPT(vocab=data["meta"].get("vocab", 256), d=cfg["d"], layers=cfg["layers"],
                    heads=cfg["heads"], seq=cfg["seq"])
    wrapper = C.LMLoss(gpt)
    amp = amp if C.MODE_INFO[base_mode][1] else None
    small = cfg["d"] < 256
    step_fn, be = C.compile_model(wrapper, base_mode,
                                  _hot_kwargs(small, {**hot_extra, **variant}))
    opt = _adamw(gpt, cfg["lr"], 0.1, device)
    steps, batch, seq = cfg["steps"], cfg["batch"], cfg["seq"]
    g = torch.Generator().manual_seed(seed + 1)          # the same windows for every mode
    starts = torch.randint(0, data["train"].numel() - seq - 1, (steps, batch),
                           generator=g).to(device)
    offs = torch.arange(seq + 1, device=device)
    val = data["val"]
    nval = cfg["val_windows"]
    vstarts = torch.linspace(0, val.numel() - seq - 2, nval).long()
    vidx = vstarts.to(device)[:, None] + offs
    tf32_before = torch.backends.cuda.matmul.allow_tf32
    tf32 = bool(cfg.get("tf32")) and base_mode == "fp32" and device.type == "cuda"
    torch.backends.cuda.matmul.allow_tf32 = tf32 or tf32_before

    def evaluate() -> float:
        total = 0.0
        with torch.no_grad(), C.amp_ctx(device, amp):
            for i in range(0, nval, batch):
                w = val[vidx[i:i + batch]].long()
                logits = gpt(w[:, :-1])
                total += float(F.cross_entropy(logits.flatten(0, 1).float(),
                                               w[:, 1:].flatten(), reduction="sum"))
        return total / (nval * seq)

    losses, val_curve = [], []
    t_run = time.perf_counter()
    t_timed, eval_s, skip = None, 0.0, min(5, steps - 1)   # time steps after the first few
    try:
        for step in range(steps):
            if step == skip:
                C.sync(device)
                t_timed, eval_s = time.perf_counter(), 0.0
            for grp in opt.param_groups:
                grp["lr"] = cfg["lr"] * _schedule(step, steps, cfg["warmup"])
            w = data["train"][starts[step][:, None] + offs].long()
            with C.amp_ctx(device, amp):
                loss = step_fn(w[:, :-1].contiguous(), w[:, 1:].contiguous())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(gpt.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
            if (step + 1) % cfg["eval_every"] == 0 or step + 1 == steps:
                C.sync(device)
                t_eval = time.perf_counter()
                val_curve.append([step + 1, evaluate()])
                eval_s += time.perf_counter() - t_eval
        C.sync(device)
        step_ms = ((time.perf_counter() - t_timed - eval_s) / (steps - skip) * 1e3
                   if t_timed is not None else None)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32_before
    train_losses = [float(x) for x in losses]
    tail = train_losses[-max(1, min(20, steps // 5)):]
    rec = {"mode": mode, "corpus": data["meta"]["corpus"], "status": "ok", "amp": amp or "none",
           "tf32": tf32, "variant": variant,
           "final_val_loss": val_curve[-1][1], "val_curve": val_curve,
           "final_train_loss": sum(tail) / len(tail),
           "train_curve": [[i + 1, v] for i, v in enumerate(train_losses)
                           if (i + 1) % max(1, steps // 100) == 0 or i == 0],
           "step_ms": step_ms,
           "seconds": time.perf_counter() - t_run,
           "params_m": round(C.count_params(gpt) / 1e6, 2)}
    rec.update(hot_info(be))
    if not all(math.isfinite(v) for v in train_losses) or not math.isfinite(rec["final_val_loss"]):
        rec["status"], rec["error"] = "error", "non-finite loss"
    if keep_state:
        rec["_state"] = {k: v.detach().clone() for k, v in gpt.state_dict().items()}
    return rec



# ----------------------------------------------------------------------------- digits part
def train_digits(mode: str, cfg: dict, data, device, hot_extra: dict, seed: int) -> dict:
    """Train from ``cfg["seeds"]`` initialisations (one compiled graph reused: the weights
    are re-initialised in place, LQS re-calibrates); report the mean test accuracy.
    ``cfg["amp"]`` (default none: the whole gate in fp32) puts the compiled modes under
    autocast, as the LM runs: what an FP8 forward or e4m3 kept activations need to engage."""
    C.reset_compile_state()
    xtr, ytr, xte, yte = (t.to(device) for t in data)
    seeds = [seed + i for i in range(cfg.get("seeds", 1))]

    def fresh(sd):
        torch.manual_seed(sd)
        with torch.device(device):
            return C.ViT(img=cfg["img"], patch=cfg["patch"], chans=1, classes=10, d=cfg["d"],
                         layers=cfg["layers"], heads=cfg["heads"])
    vit = fresh(seeds[0])
    wrapper = C.ClsLoss(vit)
    base_mode, variant = C.split_mode(mode)
    amp = cfg.get("amp") if C.MODE_INFO[base_mode][1] else None
    step_fn, be = C.compile_model(wrapper, base_mode,
                                  _hot_kwargs(cfg["d"] < 256, {**hot_extra, **variant}))
    steps, batch, s = cfg["steps"], cfg["batch"], cfg["shift"]

    def evaluate() -> float:
        with torch.no_grad(), C.amp_ctx(device, amp):
            return float((vit(xte).argmax(1) == yte).float().mean()) * 100

    curves, accs, finals, finite = [], [], [], True
    t_run = time.perf_counter()
    for i, sd in enumerate(seeds):
        if i:
            with torch.no_grad():
                for p, q in zip(vit.parameters(), fresh(sd).parameters()):
                    p.copy_(q)
            try:
                import hotcompile
                hotcompile.lqs_table.recalibrate()
            except Exception:  # noqa: BLE001
                pass
        opt = _adamw(vit, cfg["lr"], 0.05, device)
        g = torch.Generator().manual_seed(sd + 2)
        per_epoch = len(ytr) // batch
        order = torch.cat([torch.randperm(len(ytr), generator=g)[: per_epoch * batch]
                           for _ in range(steps // per_epoch + 1)]).view(-1, batch)[:steps]
        order = order.to(device)
        shifts = torch.randint(-s, s + 1, (steps, 2), generator=g).tolist()
        curve, losses = [], []
        for step in range(steps):
            for grp in opt.param_groups:
                grp["lr"] = cfg["lr"] * _schedule(step, steps, cfg["warmup"])
            idx = order[step]
            x = torch.roll(xtr[idx], shifts=tuple(shifts[step]), dims=(2, 3))
            with C.amp_ctx(device, amp):
                loss = step_fn(x, ytr[idx])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
            if (step + 1) % cfg["eval_every"] == 0 or step + 1 == steps:
                curve.append([step + 1, evaluate()])
        train_losses = [float(v) for v in losses]
        finite = finite and all(math.isfinite(v) for v in train_losses)
        curves.append(curve)
        accs.append(curve[-1][1])
        finals.append(sum(train_losses[-10:]) / len(train_losses[-10:]))
    n = len(accs)
    mean_curve = [[curves[0][j][0], sum(c[j][1] for c in curves) / n]
                  for j in range(len(curves[0]))]
    rec = {"mode": mode, "variant": variant, "status": "ok", "test_acc": sum(accs) / n,
           "test_acc_seeds": accs,
           "test_acc_std": statistics.pstdev(accs) if n > 1 else 0.0, "seeds": seeds,
           "acc_curve": mean_curve, "final_train_loss": sum(finals) / n, "amp": amp or "none",
           "seconds": time.perf_counter() - t_run,
           "params_m": round(C.count_params(vit) / 1e6, 2)}
    rec.update(hot_info(be))
    if not finite:
        rec["status"], rec["error"] = "error", "non-finite loss"
    return rec




# ----------------------------------------------------------------------------- fidelity part
def _attach_probes(model: nn.Module, shapes: Dict[str, tuple], device, dtype=None):
    """Zero tensors added to each linear site's input; their .grad is the site's g_x."""
    probes, handles = {}, []
    for name, mod in model.named_modules():
        if name not in shapes:
            continue
        shape, dt = shapes[name]
        p = torch.zeros(shape, dtype=dtype or dt, device=device, requires_grad=True)
        mod._hot_probe = p
        probes[name] = p
        handles.append(mod.register_forward_pre_hook(
            lambda m, args: (args[0] + m._hot_probe,) + tuple(args[1:])))
    return probes, handles


def _grads(model, probes, names):
    mods = dict(model.named_modules())
    return ({n: probes[n].grad.detach().double().clone() for n in names},
            {n: mods[n].weight.grad.detach().double().clone() for n in names})


def _site_grads(mods, probes, n):
    """(g_x, g_W) of one site in float64 (one site at a time keeps the peak memory low)."""
    return probes[n].grad.detach().double(), mods[n].weight.grad.detach().double()


def _cmp(a: torch.Tensor, b: torch.Tensor):
    a, b = a.flatten().double(), b.flatten().double()
    nb = float(b.norm())
    if nb == 0:
        return None, None
    cos = float(a @ b / (a.norm() * b.norm()).clamp_min(1e-300))
    return cos, float((a - b).norm() / nb)


def _med(vals):
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None


def _min(vals):
    vals = [v for v in vals if v is not None]
    return min(vals) if vals else None


def warmup_passes(cfg, requested: int) -> int:
    """Compiled fwd+bwd passes before measuring: at least ``requested``, and enough for the
    config's calibrations (``rank="auto"``: its calibration passes, then the recompile
    happens on the next call; LQS: its calibration passes)."""
    n = requested
    if getattr(cfg, "rank", None) == "auto":
        n = max(n, int(getattr(cfg, "rank_calibration_start", 0))
                + int(getattr(cfg, "rank_calibration_steps", 0)) + 1)
    if getattr(cfg, "gx_scale", None) == "lqs":
        n = max(n, int(getattr(cfg, "lqs_calibration_steps", 0)))
    return n


def fidelity_model(name: str, device, amp, hot_extra: dict, avg: int,
                   lm_state: Optional[dict], lm_cfg: dict, lm_data_: Optional[dict],
                   seed: int, variants: Optional[List[str]] = None,
                   warmup: int = 3) -> List[dict]:
    """One record per hot variant (default: just ``hot``); the fp64 reference and the
    plain-autocast baseline are computed once and shared."""
    import train as T
    variants = variants or ["hot"]
    C.reset_compile_state()
    torch.manual_seed(seed)
    gen = torch.Generator(device=device).manual_seed(seed + 3)
    note = ""
    if name == "bytegpt":
        with torch.device(device):
            gpt = C.GPT(vocab=256, d=lm_cfg["d"], layers=lm_cfg["layers"],
                        heads=lm_cfg["heads"], seq=lm_cfg["seq"])
        if lm_state is not None:
            gpt.load_state_dict(lm_state[0])
            note = (f"byte-level GPT after {lm_cfg['steps']} steps of the lm part's "
                    f"`{lm_state[1]}` run, on validation text")
        else:
            note = "byte-level GPT, random init (the lm part did not run in this process)"
        wrapper = C.LMLoss(gpt)
        seq, b = lm_cfg["seq"], min(lm_cfg["batch"], 16)
        if lm_data_ is not None:
            val = lm_data_["val"]
            st = torch.linspace(0, val.numel() - seq - 2, b).long()
            w = val[(st[:, None] + torch.arange(seq + 1)).to(device)].long()
            note += f" ({lm_data_['meta']['corpus']})"
        else:
            w = torch.randint(0, 256, (b, seq + 1), generator=gen, device=device)
        batch = (w[:, :-1], w[:, 1:])
        hot_kw = _hot_kwargs(lm_cfg["d"] < 256, hot_extra)
    else:
        key, bsz = {"vit_b16": ("vit_b16_bs64", 32), "gpt2": ("gpt2", 4),
                    "gpt2_linear": ("gpt2_linear", 4),
                    "llama_d2048": ("llama_d2048", 1), "tiny_gpt": ("tiny_gpt", None),
                    "tiny_vit": ("tiny_vit", None)}.get(name, (name, None))
        if key not in T.MODELS:
            raise ValueError(f"unknown fidelity model {name!r}")
        why = T.model_unavailable(key)
        if why:
            return [{"model": name, "variant": v, "status": "skipped", "error": why}
                    for v in variants]
        wl = T.MODELS[key](device)
        wrapper = wl.module
        batch = wl.make_batch(bsz or wl.batch, gen)
        note = wl.notes + " (random init)"
        # HOT's default config, as bench/train.py runs it (``wl.exclude`` is what torchao's
        # float8 keeps in bf16, not HOT's: the head is HOT's g_W site by default)
        hot_kw = {**wl.hot, **hot_extra}
    batch_size = int(batch[0].shape[0])
    note += f"; batch {batch_size}"
    sites = [n for n, m in wrapper.named_modules() if C.is_linear_site(m)]

    # input shape and dtype of every site, under the autocast the HOT step will use
    shapes, hs = {}, []
    mods = dict(wrapper.named_modules())
    for n in sites:
        hs.append(mods[n].register_forward_pre_hook(
            lambda m, a, n=n: shapes.__setitem__(n, (tuple(a[0].shape), a[0].dtype))))
    with torch.no_grad(), C.amp_ctx(device, amp):
        wrapper(*batch)
    for h in hs:
        h.remove()
    sites = [n for n in sites if n in shapes]

    # fp64 reference
    ref = copy.deepcopy(wrapper).double()
    probes, _ = _attach_probes(ref, shapes, device, torch.float64)
    b64 = tuple(t.double() if t.is_floating_point() else t for t in batch)
    ref(*b64).backward()
    gx_ref, gw_ref = _grads(ref, probes, sites)
    del ref, probes

    # plain autocast (what the HOT numbers should be read against)
    base = copy.deepcopy(wrapper)
    probes, _ = _attach_probes(base, shapes, device)
    with C.amp_ctx(device, amp):
        loss = base(*batch)
    loss.backward()
    bmods = dict(base.named_modules())
    base_cmp = {}
    for n in sites:
        gx, gw = _site_grads(bmods, probes, n)
        base_cmp[n] = (_cmp(gx, gx_ref[n]), _cmp(gw, gw_ref[n]))
    del base, probes, loss, bmods

    out = []
    for vi, mode in enumerate(variants):
        t0 = time.perf_counter()
        try:
            rec = _fidelity_hot(mode, wrapper, shapes, sites, batch, device, amp, hot_kw,
                                avg, warmup, gx_ref, gw_ref, base_cmp)
            rec.update({"model": name, "note": note, "batch": batch_size})
        except Exception as e:  # noqa: BLE001
            rec = _err(name, e, key="model")
            rec["variant"] = mode
        rec["seconds"] = time.perf_counter() - t0
        out.append(rec)
        C.reset_compile_state()
    return out


def _fidelity_hot(mode, wrapper, shapes, sites, batch, device, amp, hot_kw, avg, warmup,
                  gx_ref, gw_ref, base_cmp) -> dict:
    """HOT compiled whole: ``warmup`` passes (rank/LQS calibration and the recompile, no
    optimizer step so the weights stay the reference's), then ``avg`` measured passes."""
    C.reset_compile_state()
    base_mode, variant = C.split_mode(mode)
    hot = copy.deepcopy(wrapper)
    probes, _ = _attach_probes(hot, shapes, device)
    step_fn, be = C.compile_model(hot, base_mode, {**hot_kw, **variant})
    warm = warmup_passes(be.config, warmup)
    params = list(hot.parameters()) + list(probes.values())
    mods = dict(hot.named_modules())
    gx_sum: Dict[str, torch.Tensor] = {}
    gw_sum: Dict[str, torch.Tensor] = {}
    per_pass: Dict[str, List[tuple]] = {n: [] for n in sites}
    graphs_warm = None
    for i in range(warm + avg):
        for p in params:
            p.grad = None
        with C.amp_ctx(device, amp):
            loss = step_fn(*batch)
        loss.backward()
        if i < warm:
            continue
        if graphs_warm is None:     # a recompile replaces the graph's records
            graphs_warm = {id(r) for r in be.report.layers}
        for n in sites:
            gx, gw = _site_grads(mods, probes, n)
            per_pass[n].append(_cmp(gx, gx_ref[n]) + _cmp(gw, gw_ref[n]))
            if n in gx_sum:
                gx_sum[n].add_(gx)
                gw_sum[n].add_(gw)
            else:
                gx_sum[n], gw_sum[n] = gx.clone(), gw.clone()
            del gx, gw
    recompiled = len({getattr(r, "graph", None) for r in be.report.layers
                      if id(r) not in (graphs_warm or set())})
    recs = _site_records(be)
    for r in recs.values():
        if hasattr(r, "refresh_lqs"):
            r.refresh_lqs()

    def record_of(n):
        return recs.get(n) or next((r for k, r in recs.items()
                                    if k.endswith("." + n) or n.endswith("." + k)), None)

    rows = []
    for n in sites:
        w = mods[n].weight
        r = record_of(n)
        if r is None:
            st, info = "?", None
        elif r.rewritten:
            st, info = "hot", getattr(r, "lqs_choice", None)
        else:
            st, info = "exact", r.reason
        pp = per_pass[n]
        gxa_c, gxa_r = _cmp(gx_sum[n] / avg, gx_ref[n])
        gwa_c, gwa_r = _cmp(gw_sum[n] / avg, gw_ref[n])
        (bx_c, bx_r), (bw_c, bw_r) = base_cmp[n]
        io = (w.shape[1], w.shape[0]) if isinstance(mods[n], nn.Linear) else tuple(w.shape)
        rows.append({"site": n, "in": int(io[0]), "out": int(io[1]),
                     "kind": type(mods[n]).__name__, "path": st, "info": info,
                     "rank": _rank_of(r) if st == "hot" else None,
                     # first measured pass (comparable with older results)
                     "gx_cos": pp[0][0], "gx_rel": pp[0][1],
                     "gw_cos": pp[0][2], "gw_rel": pp[0][3],
                     # over the k measured passes (stochastic rounding differs per pass)
                     "gx_cos_med": _med([x[0] for x in pp]), "gx_cos_min": _min([x[0] for x in pp]),
                     "gw_cos_med": _med([x[2] for x in pp]), "gw_cos_min": _min([x[2] for x in pp]),
                     "gx_cos_avg": gxa_c, "gx_rel_avg": gxa_r,
                     "gw_cos_avg": gwa_c, "gw_rel_avg": gwa_r,
                     "base_gx_cos": bx_c, "base_gx_rel": bx_r,
                     "base_gw_cos": bw_c, "base_gw_rel": bw_r})
    del gx_sum, gw_sum

    hot_rows = [r for r in rows if r["path"] == "hot"]

    def med(key):
        return _med([r[key] for r in hot_rows])

    def worst(key):
        return _min([r[key] for r in hot_rows])
    ranks = [r["rank"] for r in hot_rows]
    hist = None
    if any(x is not None for x in ranks):
        hist = {}
        for x in ranks:
            hist[str(x)] = hist.get(str(x), 0) + 1
        hist = dict(sorted(hist.items(), key=lambda kv: (len(kv[0]), kv[0])))
    # over the sites HOT rewrote (the baseline over the same sites, for a like comparison)
    summary = {"sites": len(rows), "rewritten": len(hot_rows),
               "gx_cos_median": med("gx_cos"), "gx_cos_min": worst("gx_cos"),
               "gw_cos_median": med("gw_cos"), "gw_cos_min": worst("gw_cos"),
               "gx_rel_median": med("gx_rel"), "gw_rel_median": med("gw_rel"),
               "gw_cos_avg_median": med("gw_cos_avg"), "gx_cos_avg_median": med("gx_cos_avg"),
               "base_gx_cos_median": med("base_gx_cos"), "base_gx_cos_min": worst("base_gx_cos"),
               "base_gw_cos_median": med("base_gw_cos"), "base_gw_cos_min": worst("base_gw_cos"),
               "base_gx_rel_median": med("base_gx_rel"),
               "base_gw_rel_median": med("base_gw_rel"),
               "ranks": hist}
    return {"variant": mode, "status": "ok", "amp": amp or "none", "avg": avg,
            "warmup": warm, "recompiled_while_measuring": recompiled,
            "sites": rows, "summary": summary, **hot_info(be)}


# ----------------------------------------------------------------------------- estimate
def _lm_scale(cfg: dict) -> float:
    """Work of an LM run relative to the full-size 1000-step run."""
    return (cfg["steps"] / 1000 * cfg["batch"] * cfg["seq"] / (32 * 512)
            * cfg["layers"] * cfg["d"] ** 2 / (8 * 768 ** 2))


def estimate_lm_run(mode: str, cfg: dict) -> float:
    base = C.split_mode(mode)[0]
    full = H100_S["lm"].get(base, 100.0)
    fixed = H100_S["lm_compile"] if C.MODE_INFO.get(base, (False,))[0] else 2.0
    return fixed + (full - fixed) * _lm_scale(cfg)


def estimate_digits_run(mode: str, cfg: dict) -> float:
    base = C.split_mode(mode)[0]
    per_seed = H100_S["digits_seed"].get(base, 40.0) * cfg["steps"] / 600
    return per_seed * cfg.get("seeds", 1)


def estimate_fidelity(model: str, n_variants: int) -> float:
    t = H100_S["fidelity"].get(model, 15.0)
    return t * (1 + H100_S["fidelity_variant"] * (n_variants - 1))


def estimate(parts, lm_cfg, dg_cfg, fi_cfg, fi_variants) -> dict:
    """H100 seconds per part (figures of ``H100_S``)."""
    est = {"startup": H100_S["startup"]}
    if "lm" in parts:
        per = {}
        for c in lm_cfg["corpora"]:
            per[c] = (H100_S["corpus_load"].get(c, 3.0)
                      + sum(estimate_lm_run(m, lm_cfg) for m in lm_cfg["modes"])
                      * lm_cfg.get("seeds", 1))
        est["lm"] = per
    if "digits" in parts:
        est["digits"] = sum(estimate_digits_run(m, dg_cfg) for m in dg_cfg["modes"])
    if "fidelity" in parts:
        est["fidelity"] = {m: estimate_fidelity(m, len(fi_variants)) for m in fi_cfg["models"]}
    total = 0.0
    for v in est.values():
        total += sum(v.values()) if isinstance(v, dict) else v
    est["total"] = total
    return est


def _estimate_line(est: dict, budget) -> str:
    bits = []
    if "lm" in est:
        bits.append("lm " + " + ".join(f"{c} {s:.0f}" for c, s in est["lm"].items()))
    if "digits" in est:
        bits.append(f"digits {est['digits']:.0f}")
    if "fidelity" in est:
        bits.append("fidelity " + " + ".join(f"{m} {s:.0f}" for m, s in est["fidelity"].items()))
    line = (f"estimate (H100 figures): {est['total']:.0f} s = startup {est['startup']:.0f}, "
            + ", ".join(bits))
    if budget:
        line += f"; budget {budget:.0f} s" + (" (runs past it will be skipped)"
                                              if est["total"] > budget else "")
    return line


# ----------------------------------------------------------------------------- driver
def _corpus_list(text: Optional[str], default: List[str]) -> List[str]:
    out = [c.strip() for c in text.split(",") if c.strip()] if text else list(default)
    for c in out:
        if c not in CORPORA:
            raise SystemExit(f"--lm-corpora: unknown corpus {c!r} (one of {', '.join(CORPORA)})")
    return out


def run_suite(args) -> dict:
    preset = copy.deepcopy(SUITES["smoke" if args.suite == "smoke" else
                                  ("gate" if args.suite == "gate" else "full")])
    device = C.pick_device(args.device)
    C.configure_cpu_compile(device)
    parts = args.parts.split(",") if args.parts else preset["parts"]
    lm_cfg, dg_cfg, fi_cfg = preset["lm"], preset["digits"], preset["fidelity"]
    for k, v in (("steps", args.lm_steps), ("batch", args.lm_batch)):
        if v is not None:
            lm_cfg[k] = v
    if args.lm_max_bytes is not None:
        lm_cfg["max_bytes"] = args.lm_max_bytes or None
    lm_cfg["corpora"] = _corpus_list(args.lm_corpora, lm_cfg["corpora"])
    if args.lm_seeds is not None:
        if args.lm_seeds < 1:
            raise SystemExit("--lm-seeds must be >= 1")
        lm_cfg["seeds"] = args.lm_seeds
    if args.digits_steps is not None:
        dg_cfg["steps"] = args.digits_steps
    if args.digits_seeds is not None:
        dg_cfg["seeds"] = args.digits_seeds
    if args.digits_amp not in (None, "none"):
        dg_cfg["amp"] = args.digits_amp
    if args.no_tf32:
        lm_cfg["tf32"] = False
    if args.lm_modes:
        lm_cfg["modes"] = C.mode_list(args.lm_modes)
    if args.digits_modes:
        dg_cfg["modes"] = C.mode_list(args.digits_modes)
    if args.fidelity_models:
        fi_cfg["models"] = args.fidelity_models.split(",")
    if args.fidelity_warmup is not None:
        fi_cfg["warmup"] = args.fidelity_warmup
    if args.fidelity_avg is not None:
        fi_cfg["avg"] = max(1, args.fidelity_avg)
    variants = variant_modes(args.hot_variants)
    lm_cfg["modes"] = expand_modes(lm_cfg["modes"], variants)
    dg_cfg["modes"] = expand_modes(dg_cfg["modes"], variants)
    fi_variants = (variants or ["hot"]) if args.fidelity_variants == "all" else ["hot"]
    fi_cfg["variants"] = fi_variants
    amp = args.amp or (preset.get("cpu_amp", "bf16") if device.type == "cpu" else "bf16")
    amp = None if amp == "none" else amp
    # accuracy measures HOT's numerics wherever it is eligible: the cost gate would leave
    # these model sizes (d <= 768) exact on a GPU, and the gates would then measure Inductor
    hot_extra = {"min_speedup": 0, **C.parse_overrides(args.hot)}
    for where, modes in (("lm", lm_cfg["modes"]), ("digits", dg_cfg["modes"]),
                         ("fidelity", fi_variants)):
        if where in parts:
            check_modes(modes, {**(fi_cfg.get("hot", {}) if where == "fidelity" else {}),
                                **hot_extra}, where)
    budget = args.budget_s if args.budget_s is not None else preset.get("budget_s")
    est = estimate(parts, lm_cfg, dg_cfg, fi_cfg, fi_variants)
    if getattr(args, "estimate", False):
        C.log(f"{args.suite}: lm corpora {','.join(lm_cfg['corpora'])}, lm modes "
              f"{','.join(lm_cfg['modes'])}; digits modes {','.join(dg_cfg['modes'])}; "
              f"fidelity {','.join(fi_cfg['models'])} x {','.join(fi_variants)}")
        C.log(_estimate_line(est, budget))
        return {"estimate_only": True, "estimate_s": est}
    out_dir = args.out or C.RESULTS_DIR
    base = C.result_base(out_dir, "accuracy", device, args.tag)
    result = {"kind": "accuracy", "suite": args.suite, "env": C.environment(device),
              "options": {"parts": parts, "amp": amp or "none", "seed": args.seed,
                          "hot": hot_extra, "hot_variants": variants, "budget_s": budget},
              "estimate_s": est, "targets": []}
    t_suite = time.perf_counter()
    C.log(f"accuracy bench ({args.suite}): parts {','.join(parts)} on "
          f"{C.device_name(device)} -> {base}.*")
    C.log(_estimate_line(est, budget))
    on_gpu = device.type == "cuda"

    def over_budget(expect_s: float) -> bool:
        return bool(budget) and time.perf_counter() - t_suite + expect_s > budget

    def save():
        C.write_json(base + ".json", result)

    def skipped(key, name, extra=None):
        rec = {key: name, "status": "skipped", "error": f"time budget {budget} s"}
        rec.update(extra or {})
        return rec

    lm_state = lm_data_ = None
    if "lm" in parts:
        result["lm"] = {"config": dict(lm_cfg), "corpora": {}}
        measured: Dict[str, float] = {}          # mode -> seconds of its run on a corpus
        keep_mode = "inductor" if "inductor" in lm_cfg["modes"] else lm_cfg["modes"][0]
        for ci, corpus in enumerate(lm_cfg["corpora"]):
            entry = {"corpus": corpus, "data": {"corpus": corpus}, "runs": []}
            result["lm"]["corpora"][corpus] = entry
            try:
                data = lm_data(lm_cfg, device, corpus)
                entry["data"] = data["meta"]
                m = data["meta"]
                C.log(f"lm      corpus {corpus}: {m['train_files']} / {m['val_files']} files, "
                      f"{m['train_bytes']} / {m['val_bytes']} "
                      f"{'tokens' if m['vocab'] > 256 else 'bytes'} (train / val)")
            except Exception as e:  # noqa: BLE001
                data = None
                entry["error"] = f"{type(e).__name__}: {e}"
                C.log(f"lm      corpus {corpus}: skipped: {entry['error']}")
            seeds = lm_seeds(lm_cfg, args.seed)
            for seed, mode in [(sd, m) for sd in seeds for m in lm_cfg["modes"]] \
                    if data is not None else []:
                expect = measured.get(mode, estimate_lm_run(mode, lm_cfg) if on_gpu else 0.0)
                if over_budget(0.8 * expect):
                    rec = skipped("mode", mode, {"corpus": corpus})
                else:
                    t0 = time.perf_counter()
                    try:
                        rec = train_lm(mode, lm_cfg, data, device, amp, hot_extra, seed,
                                       keep_state=(ci == 0 and mode == keep_mode
                                                   and seed == seeds[0]))
                    except Exception as e:  # noqa: BLE001
                        rec = _err(mode, e)
                        rec["corpus"] = corpus
                    measured[mode] = time.perf_counter() - t0
                rec["seed"] = seed
                if "_state" in rec:
                    lm_state = (rec.pop("_state"), f"{mode}, {corpus}")
                entry["runs"].append(rec)
                C.log(_lm_line(rec, lm_cfg, corpus, len(seeds) > 1))
                save()
            entry["gap"] = lm_gap(entry["runs"])
            entry["gap_spread"] = lm_gap_spread(entry["runs"])
            if ci == 0:
                lm_data_ = data
            else:
                del data
            save()
    if "digits" in parts:
        try:
            data = C.load_digits_images(dg_cfg["img"])
            result["digits"] = {"config": dict(dg_cfg), "runs": []}
        except Exception as e:  # noqa: BLE001
            data = None
            result["digits"] = {"config": dict(dg_cfg), "runs": [],
                                "error": f"{type(e).__name__}: {e}"}
            C.log(f"digits: skipped: {e}")
        for mode in dg_cfg["modes"] if data is not None else []:
            if over_budget(0.8 * estimate_digits_run(mode, dg_cfg) if on_gpu else 0.0):
                rec = skipped("mode", mode)
            else:
                try:
                    rec = train_digits(mode, dg_cfg, data, device, hot_extra, args.seed)
                except Exception as e:  # noqa: BLE001
                    rec = _err(mode, e)
            result["digits"]["runs"].append(rec)
            C.log(_digits_line(rec, dg_cfg))
            save()
    if "fidelity" in parts:
        result["fidelity"] = {"config": dict(fi_cfg), "models": []}
        for name in fi_cfg["models"]:
            expect = estimate_fidelity(name, len(fi_variants)) if on_gpu else 0.0
            if over_budget(0.8 * expect):
                recs = [skipped("model", name, {"variant": v}) for v in fi_variants]
            else:
                t0 = time.perf_counter()
                try:
                    recs = fidelity_model(name, device, amp,
                                          {**fi_cfg.get("hot", {}), **hot_extra},
                                          fi_cfg["avg"], lm_state, lm_cfg, lm_data_, args.seed,
                                          variants=fi_variants, warmup=fi_cfg["warmup"])
                except Exception as e:  # noqa: BLE001
                    recs = [dict(_err(name, e, key="model"), variant=v) for v in fi_variants]
                total = time.perf_counter() - t0
                for rec in recs:
                    rec.setdefault("seconds", total / len(recs))
                    rec["model_seconds"] = total
            for rec in recs:
                result["fidelity"]["models"].append(rec)
                C.log(_fid_line(rec))
            save()
        C.reset_compile_state()
    result["targets"] = targets(result)
    result["suite_s"] = time.perf_counter() - t_suite
    resume = resume_commands(args, result)
    if resume:
        result["resume_commands"] = resume
    write_outputs(result, base)
    C.log(f"suite took {result['suite_s']:.0f} s (estimate {est['total']:.0f} s on an H100)")
    return result


def _common_flags(args, seed: bool = True) -> List[str]:
    """The command-line options a resume command must repeat (``seed``: also ``--seed``)."""
    out = []
    for flag, val in (("--lm-steps", args.lm_steps), ("--lm-batch", args.lm_batch),
                      ("--lm-max-bytes", args.lm_max_bytes),
                      ("--digits-steps", args.digits_steps),
                      ("--digits-seeds", args.digits_seeds), ("--amp", args.amp),
                      ("--digits-amp", args.digits_amp),
                      ("--fidelity-warmup", args.fidelity_warmup),
                      ("--fidelity-avg", args.fidelity_avg), ("--device", args.device),
                      ("--cache-dir", args.cache_dir)):
        if val is not None:
            out += [flag, str(val)]
    if args.seed and seed:
        out += ["--seed", str(args.seed)]
    if args.no_tf32:
        out.append("--no-tf32")
    if args.hot:
        out += ["--hot", *args.hot]
    if args.tag:
        out += ["--tag", args.tag + "-resume"]
    return out


def resume_commands(args, result: dict) -> List[str]:
    suite = ["--suite", args.suite] if args.suite != "custom" else []
    cmds = []

    def budget_skipped(recs, key):
        names = []
        for r in recs:
            if r.get("status") == "skipped" and "budget" in r.get("error", ""):
                if r[key] not in names:
                    names.append(r[key])
        return names

    def cmd(*extra, seed=None):
        """``seed``: the run's own --seed, instead of the suite's (one seed of several)."""
        tail = (_common_flags(args, seed=seed is None)
                + ([] if seed is None else ["--seed", str(seed), "--lm-seeds", "1"]))
        return " ".join(["python", "bench/accuracy.py", *suite, *[shlex.quote(x) for x in (
            *extra, *tail, "--out", "$OUT")]]).replace("'$OUT'", "$OUT")
    for corpus, ent in (result.get("lm") or {}).get("corpora", {}).items():
        seeds = {r.get("seed") for r in ent["runs"]}
        if len(seeds) <= 1:
            modes = budget_skipped(ent["runs"], "mode")
            if modes:
                cmds.append(cmd("--parts", "lm", "--lm-corpora", corpus, "--lm-modes",
                                ",".join(modes)))
            continue
        for sd in sorted(seeds):
            modes = budget_skipped([r for r in ent["runs"] if r.get("seed") == sd], "mode")
            if modes:
                cmds.append(cmd("--parts", "lm", "--lm-corpora", corpus, "--lm-modes",
                                ",".join(modes), seed=sd))
    modes = budget_skipped((result.get("digits") or {}).get("runs", []), "mode")
    if modes:
        cmds.append(cmd("--parts", "digits", "--digits-modes", ",".join(modes)))
    fi = result.get("fidelity") or {}
    models = budget_skipped(fi.get("models", []), "model")
    if models:
        extra = ["--parts", "fidelity", "--fidelity-models", ",".join(models)]
        variants = (fi.get("config") or {}).get("variants") or ["hot"]
        if variants != ["hot"]:
            extra += ["--hot-variants", ";".join(v if v != "hot" else "default"
                                                 for v in variants),
                      "--fidelity-variants", "all"]
        cmds.append(cmd(*extra))
    return cmds


def _err(mode, e, key="mode") -> dict:
    import traceback
    return {key: mode, "status": "error", "error": f"{type(e).__name__}: {str(e)[:400]}",
            "traceback": traceback.format_exc()[-3000:]}


def lm_seeds(cfg: dict, seed: int) -> List[int]:
    return [seed + i for i in range(cfg.get("seeds", 1))]


def _paired_gaps(runs: List[dict]) -> Dict[str, List[float]]:
    """pair name -> relative final-val-loss gaps, one per seed that both modes ran: every
    hot variant vs inductor and fp32, inductor vs fp32. Why paired by seed: a seed fixes the
    initial weights and the batches of both runs, so their difference is HOT's effect plus
    the run-to-run spread of one training (Inductor's own final loss at one seed: std 0.60%
    over 20 runs, bench/README), not the spread between initialisations too. Runs written
    before seeds were recorded count as one seed."""
    by: Dict[str, Dict[object, dict]] = {}
    for r in runs:
        if r.get("status") == "ok":
            by.setdefault(r["mode"], {})[r.get("seed")] = r
    pairs = [(m, ref) for m in by if is_hot(m) for ref in ("inductor", "fp32")]
    pairs.append(("inductor", "fp32"))
    out = {}
    for a, b in pairs:
        common = [sd for sd in by.get(a, {}) if sd in by.get(b, {})]
        if common:
            out[f"{a}_vs_{b}"] = [(by[a][sd]["final_val_loss"] - by[b][sd]["final_val_loss"])
                                  / by[b][sd]["final_val_loss"] for sd in common]
    return out


def lm_gap(runs: List[dict]) -> dict:
    """Relative final-val-loss gaps (``_paired_gaps``), the mean over seeds."""
    return {k: sum(v) / len(v) for k, v in _paired_gaps(runs).items()}


def lm_gap_spread(runs: List[dict]) -> dict:
    """pair name -> {"n": seeds, "std": sample std of the per-seed gaps, "sem": std / sqrt(n)}
    (n >= 2 only): how far the gate's mean may be from HOT's true effect."""
    out = {}
    for k, v in _paired_gaps(runs).items():
        if len(v) >= 2:
            std = statistics.stdev(v)
            out[k] = {"n": len(v), "std": std, "sem": std / math.sqrt(len(v))}
    return out


def lm_corpora(lm: Optional[dict]) -> Dict[str, dict]:
    """corpus -> {"data", "runs", "gap"}; results written before corpora were keyed
    (one stdlib run set at ``lm.runs``) read as one corpus."""
    if not lm:
        return {}
    if "corpora" in lm:
        return lm["corpora"]
    if "runs" in lm:
        name = (lm.get("data") or {}).get("corpus", "stdlib")
        return {name: {"corpus": name, "data": lm.get("data", {}), "runs": lm["runs"],
                       "gap": lm.get("gap") or lm_gap(lm["runs"])}}
    return {}


def gated_mode(modes) -> str:
    """The mode the gates judge: ``hot`` when it ran, else the one hot variant that ran (a
    run of ``hot[forward=fp8_rowwise]`` alone is gated too, and says so), else ``hot``."""
    variants = [m for m in dict.fromkeys(modes) if is_hot(m)]
    return "hot" if "hot" in modes or len(variants) != 1 else variants[0]


_ONE_SEED = ("one seed: two Inductor runs of one seed differed by up to 1.9% on the H200 "
             "(2026-11-29), so pool several with bench/gate_pool.py")


def targets(result: dict) -> List[dict]:
    out = []
    corpora = lm_corpora(result.get("lm"))
    for corpus, ent in corpora.items() or [("stdlib", {})]:
        hot = gated_mode([r["mode"] for r in ent.get("runs", [])])
        v = (ent.get("gap") or {}).get(f"{hot}_vs_inductor")
        sp = (ent.get("gap_spread") or lm_gap_spread(ent.get("runs", []))).get(
            f"{hot}_vs_inductor")
        measured = None if v is None else f"{v * 100:+.2f}%"
        if sp and measured:
            measured += f" (mean of {sp['n']} seeds, each vs its Inductor run; +-{sp['sem'] * 100:.2f}% s.e.)"
        elif measured:
            measured += f" ({_ONE_SEED})"
        out.append({"what": f"{_lm_kind(corpus)} GPT on {corpus}: final val loss, {hot} vs "
                            "Inductor (same autocast)",
                    "goal": "within 1%", "measured": measured,
                    "verdict": "n/a" if v is None else ("PASS" if v <= 0.01 else "FAIL")})
    by = {r["mode"]: r for r in result.get("digits", {}).get("runs", []) if r.get("status") == "ok"}
    hot = gated_mode(list(by))
    d = by["fp32"]["test_acc"] - by[hot]["test_acc"] if {"fp32", hot} <= set(by) else None
    out.append({"what": f"digits ViT test accuracy, fp32 minus {hot}",
                "goal": "<= 0.5 point", "measured": None if d is None else f"{d:+.2f} points",
                "verdict": "n/a" if d is None else ("PASS" if d <= 0.5 else "FAIL")})
    return out


def _lm_line(r, cfg, corpus: str = "", show_seed: bool = False) -> str:
    tag = f"lm {corpus}"[:16]
    if show_seed:
        tag = f"{tag} s{r.get('seed')}"[:16]
    if r.get("status") != "ok":
        return f"{tag:<16} {r['mode']:<9} {r['status'].upper()}: {r.get('error', '')}"
    hot = (f", HOT {r['hot_sites_rewritten']}/{r['hot_sites_total']} sites"
           if "hot_sites_total" in r else "")
    if r.get("hot_ranks"):
        hot += f" ({_ranks_text(r['hot_ranks'])})"
    miss = unapplied(r)
    return (f"{tag:<16} {r['mode']:<9} val loss {r['final_val_loss']:.4f}  train "
            f"{r['final_train_loss']:.4f}  {cfg['steps']} steps in {r['seconds']:.0f} s "
            f"({C.fmt(r['step_ms'])} ms/step){hot}" + (f"  NOT APPLIED: {miss}" if miss else ""))


def _digits_line(r, cfg) -> str:
    if r.get("status") != "ok":
        return f"digits  {r['mode']:<9} {r['status'].upper()}: {r.get('error', '')}"
    miss = unapplied(r)
    return (f"digits  {r['mode']:<9} test acc {r['test_acc']:.2f}% (seeds: "
            f"{', '.join(f'{a:.2f}' for a in r.get('test_acc_seeds', []))})  train loss "
            f"{r['final_train_loss']:.4f}  ({cfg['steps']} steps, {r['seconds']:.0f} s)"
            + (f"  NOT APPLIED: {miss}" if miss else ""))


def _fid_line(r) -> str:
    name = r["model"] + ("" if r.get("variant", "hot") == "hot" else f" {r['variant']}")
    if r.get("status") != "ok":
        return f"grads   {name:<9} {r['status'].upper()}: {r.get('error', '')}"
    s = r["summary"]
    return (f"grads   {name:<9} {s['rewritten']}/{s['sites']} sites HOT"
            f"{' (' + _ranks_text(s.get('ranks')) + ')' if s.get('ranks') else ''}; "
            f"median (min) cos g_x {C.fmt(s['gx_cos_median'], 4)} "
            f"({C.fmt(s['gx_cos_min'], 3)}) g_W {C.fmt(s['gw_cos_median'], 4)} "
            f"({C.fmt(s['gw_cos_min'], 3)}); no HOT ({r.get('amp')}): g_x "
            f"{C.fmt(s.get('base_gx_cos_median'), 4)} g_W {C.fmt(s.get('base_gw_cos_median'), 4)}"
            f" ({r.get('seconds', 0):.0f} s)")


# ----------------------------------------------------------------------------- output
def _merge_runs(dst: List[dict], src: List[dict], key: str) -> List[dict]:
    """Later runs win, except that an ok run is not replaced by a failed or skipped one.
    Runs are told apart by ``key`` and their seed (LM runs of several seeds)."""
    def k(x):
        return x.get(key), x.get("seed")
    for rec in src:
        dst = [x for x in dst if k(x) != k(rec)
               or (x.get("status") == "ok" and rec.get("status") != "ok")]
        if not any(k(x) == k(rec) for x in dst):
            dst.append(rec)
    return dst


def _has_baseline(runs: List[dict]) -> bool:
    return any(r.get("mode") == "inductor" and r.get("status") == "ok" for r in runs)


def merge_results(results: List[dict]) -> dict:
    """Several accuracy JSONs (a suite split over calls) -> one; later parts/runs win."""
    out: dict = {"kind": "accuracy", "env": results[-1].get("env", {}),
                 "sources": [r.get("env", {}).get("date") for r in results]}
    for r in results:
        if "lm" in r:
            dst = out.setdefault("lm", {"corpora": {}})
            if r["lm"].get("config"):
                dst["config"] = r["lm"]["config"]
            date = r.get("env", {}).get("date")
            for corpus, ent in lm_corpora(r["lm"]).items():
                key, n = corpus, 1
                # a second run with its own baseline stays apart: a hot figure is only ever
                # compared with the Inductor run of its own process (run-to-run spread of
                # Inductor's final loss on one seed: ~1.5%)
                while (key in dst["corpora"] and _has_baseline(dst["corpora"][key]["runs"])
                       and _has_baseline(ent.get("runs", []))
                       and dst["corpora"][key].get("date") != date):
                    n += 1
                    key = f"{corpus} (run {n})"
                d = dst["corpora"].setdefault(key, {"corpus": corpus, "data": {}, "runs": [],
                                                    "date": date})
                if ent.get("data", {}).get("train_bytes") is not None or not d["data"]:
                    d["data"] = ent.get("data", {})
                d["runs"] = _merge_runs(d["runs"], ent.get("runs", []), "mode")
        if "digits" in r:
            dst = out.setdefault("digits", {"runs": []})
            dst.update({k: v for k, v in r["digits"].items() if k != "runs"})
            dst["runs"] = _merge_runs(dst["runs"], r["digits"]["runs"], "mode")
        if "fidelity" in r:
            dst = out.setdefault("fidelity", {"models": []})
            dst["config"] = r["fidelity"].get("config") or dst.get("config")
            for rec in r["fidelity"]["models"]:
                k = (rec["model"], rec.get("variant", "hot"))
                dst["models"] = [x for x in dst["models"]
                                 if (x["model"], x.get("variant", "hot")) != k
                                 or (x.get("status") == "ok" and rec.get("status") != "ok")]
                if not any((x["model"], x.get("variant", "hot")) == k for x in dst["models"]):
                    dst["models"].append(rec)
    for ent in (out.get("lm") or {}).get("corpora", {}).values():
        ent["gap"] = lm_gap(ent["runs"])
        ent["gap_spread"] = lm_gap_spread(ent["runs"])
    out["targets"] = targets(out)
    return out


def _lm_section(corpus: str, ent: dict, c: Optional[dict]) -> List[str]:
    L = []
    d = ent.get("data", {}) or {}
    runs = ent.get("runs", [])
    params = next((r.get("params_m") for r in runs if r.get("params_m")), None)
    where = CORPORA.get(corpus, corpus)
    if corpus == "stdlib":
        where = f"Python {d.get('python', '?')}'s standard library .py sources"
    elif corpus == "torchsrc":
        where = f"the .py sources of the installed torch {d.get('torch', '?')} package"
    when = f", run of {ent['date']}" if ent.get("date") else ""
    L.append(f"\n### Byte-level GPT on `{corpus}` ({where}{when})\n")
    cap = f", capped at {d['max_bytes']} bytes" if d.get("max_bytes") else ""
    desc = ""
    if c:
        desc = (f"{params}M parameters (d={c['d']}, {c['layers']} layers, {c['heads']} heads), "
                f"{c['batch']}x{c['seq']} bytes per step, {c['steps']} steps, AdamW lr {c['lr']} "
                f"with warm-up {c['warmup']} and cosine decay, clip 1.0. ")
    desc += (f"Data: {d.get('train_files')} train / {d.get('val_files')} validation files "
             f"({d.get('train_bytes')} / {d.get('val_bytes')} bytes, split by file{cap}); "
             f"validation loss over {c['val_windows'] if c else '?'} fixed windows, nats per "
             f"byte. Every mode sees the same batches.\n")
    L.append(desc)
    if ent.get("error"):
        L.append(f"Skipped: {ent['error']}\n")
    ref = {(r["mode"], r.get("seed")): r for r in runs if r.get("status") == "ok"}
    refs = [m for m in ("inductor", "fp32") if any(k[0] == m for k in ref)]
    many = len({r.get("seed") for r in runs}) > 1
    rows = []
    for r in runs:
        seed_col = [str(r.get("seed", "-"))] if many else []
        if r.get("status") != "ok":
            rows.append([r["mode"], *seed_col, "-", *["-" for _ in refs], "-", "-", "-",
                         f"{r['status']}: {r.get('error', '')}"[:100]])
            continue
        vs = [f"{(r['final_val_loss'] / ref[(m, r.get('seed'))]['final_val_loss'] - 1) * 100:+.2f}%"
              if (m, r.get("seed")) in ref else "-" for m in refs]
        note = "TF32 matmuls" if r.get("tf32") else ""
        if "hot_sites_total" in r:
            note = f"HOT {r['hot_sites_rewritten']}/{r['hot_sites_total']} sites"
            miss = unapplied(r)
            note += f"; not applied: {miss}" if miss else ""
        rows.append([r["mode"], *seed_col, C.fmt(r["final_val_loss"], 4), *vs,
                     C.fmt(r["final_train_loss"], 4), C.fmt(r.get("step_ms")),
                     _ranks_text(r.get("hot_ranks")) or "-", note])
    L.append(C.md_table(["mode", *(["seed"] if many else []), "final val loss",
                         *[f"vs {m}" for m in refs],
                         "final train loss", "ms/step", "HLA ranks (sites)", "note"], rows))
    gap = ent.get("gap") or lm_gap(runs)
    spread = ent.get("gap_spread") or lm_gap_spread(runs)
    gaps = [f"`{k.rsplit('_vs_', 1)[0]}` {v * 100:+.2f}%"
            + (f" (mean of {spread[k]['n']} seeds, std {spread[k]['std'] * 100:.2f}%)"
               if k in spread else "")
            for k, v in gap.items() if k.endswith("_vs_inductor")]
    if gaps:
        L.append(f"\nFinal val loss vs Inductor bf16 on `{corpus}`: " + ", ".join(gaps)
                 + " (goal for `hot`: within +1%).")
    cfgs = list({r["mode"]: (r["mode"], r["hot_config"]) for r in runs
                 if r.get("hot_config")}.values())
    if cfgs:
        L.append("\nHOTConfig of the hot runs: " + "; ".join(f"`{m}`: {_cfg_text(cf)}"
                                                             for m, cf in cfgs) + ".")
    return L


def markdown(result: dict, title: bool = True, per_site: bool = True) -> str:
    env = result.get("env", {})
    L = []
    if title:
        L.append(f"# Accuracy: {env.get('device', '?')}\n")
    L.append(f"Device {env.get('device', '?')}, torch {env.get('torch')}, hotcompile "
             f"{env.get('hotcompile')}, git {env.get('git')}, {env.get('date')}.\n")
    L.append(C.md_table(["target", "goal", "measured", "verdict"],
                        [[t["what"], t["goal"], t["measured"] or "-", t["verdict"]]
                         for t in result.get("targets", [])]))
    lm = result.get("lm")
    if lm:
        for corpus, ent in lm_corpora(lm).items():
            L += _lm_section(ent.get("corpus", corpus), ent, lm.get("config"))
    dg = result.get("digits")
    if dg:
        c = dg["config"]
        L.append(f"\n### ViT on scikit-learn digits\n\n8x8 digits upsampled to {c['img']}x"
                 f"{c['img']}, patch {c['patch']}, d={c['d']}, {c['layers']} layers, batch "
                 f"{c['batch']}, {c['steps']} steps, random shifts of up to {c['shift']} px, "
                 f"{c.get('seeds', 1)} seeds (same seeds for every mode); "
                 f"80/20 split (1437 train / 360 test). `hot` keeps the fp32 forward.\n")
        if dg.get("error"):
            L.append(f"Skipped: {dg['error']}")
        ref = {r["mode"]: r for r in dg["runs"] if r.get("status") == "ok"}
        rows = []
        for r in dg["runs"]:
            if r.get("status") != "ok":
                rows.append([r["mode"], "-", "-", "-", "-", "-",
                             f"{r['status']}: {r.get('error', '')}"[:100]])
                continue
            dd = (f"{r['test_acc'] - ref['fp32']['test_acc']:+.2f}" if "fp32" in ref else "-")
            per = ", ".join(f"{a:.2f}" for a in r.get("test_acc_seeds", []))
            miss = unapplied(r)
            amp = f"{r['amp']} autocast" if r.get("amp", "none") != "none" else ""
            note = "; ".join(x for x in (amp, miss and f"not applied: {miss}") if x)
            rows.append([r["mode"], f"{C.fmt(r['test_acc'])} ± {C.fmt(r.get('test_acc_std'))}",
                         dd, per, C.fmt(r["final_train_loss"], 4),
                         _ranks_text(r.get("hot_ranks")) or "-", note])
        L.append(C.md_table(["mode", "test accuracy % (mean ± sd)", "vs fp32 (points)",
                             "per seed", "final train loss", "HLA ranks (sites)", "note"], rows))
    fi = result.get("fidelity")
    if fi:
        fc = fi.get("config") or {}
        amp = next((r.get("amp") for r in fi["models"] if r.get("amp")), "bf16")
        bl = f"{amp} autocast" if amp in ("bf16", "fp16") else "fp32 (no HOT)"
        L.append("\n### Gradient fidelity per linear site (HOT steps vs fp64)\n\n"
                 f"Cosine similarity of each site's g_x and g_W with an fp64 eager copy of the "
                 f"model on the same batch, after at least {fc.get('warmup', '?')} compiled "
                 "warm-up passes on that batch without an optimizer step (as many as "
                 "rank=\"auto\" / LQS need to calibrate and the graph to recompile; the "
                 "weights stay the reference's). Median (min) over the sites HOT rewrote, "
                 f"first measured pass; `{bl}` = the same step without HOT, over the same "
                 "sites; `mean of k` averages k HOT passes (stochastic rounding averages out, "
                 "a low-rank g_W bias does not).\n")
        rows = []
        for r in fi["models"]:
            v = r.get("variant", "hot")
            if r.get("status") != "ok":
                rows.append([r["model"], v, "-", "-", "-", "-", "-", "-", "-", "-",
                             f"{r['status']}: {r.get('error', '')}"[:100]])
                continue
            s = r["summary"]

            def mm(key):
                return f"{C.fmt(s.get(key + '_median'), 4)} ({C.fmt(s.get(key + '_min'), 3)})"
            rows.append([r["model"], v, f"{s['rewritten']}/{s['sites']}",
                         _ranks_text(s.get("ranks")) or "-", mm("gx_cos"), mm("gw_cos"),
                         mm("base_gx_cos"), mm("base_gw_cos"),
                         C.fmt(s["gw_cos_avg_median"], 4),
                         f"{C.fmt(s['gx_rel_median'], 3)} / {C.fmt(s['gw_rel_median'], 3)}",
                         r.get("note", "")])
        L.append(C.md_table(["model", "variant", "HOT sites", "HLA ranks (sites)",
                             "hot g_x cos median (min)", "hot g_W cos median (min)",
                             f"{bl} g_x cos median (min)",
                             f"{bl} g_W cos median (min)", "hot g_W cos, mean of k",
                             "hot rel err median g_x / g_W", "note"], rows))
        if per_site:
            for r in fi["models"]:
                if r.get("status") != "ok":
                    continue
                v = r.get("variant", "hot")
                L.append(f"\n#### {r['model']} ({v}): per site (k={r['avg']} measured passes "
                         f"after {r.get('warmup', '?')} warm-up)\n")
                if r.get("recompiled_while_measuring"):
                    L.append(f"Warning: {r['recompiled_while_measuring']} graph(s) compiled "
                             "during the measured passes (raise --fidelity-warmup).\n")

                def cm(s, key):
                    med = s.get(key + "_med", s.get(key))
                    return f"{C.fmt(med, 4)} ({C.fmt(s.get(key + '_min', med), 3)})"
                L.append(C.md_table(
                    ["site", "in->out", "path", "HLA rank", "g_x cos median (min) of k",
                     "g_W cos median (min) of k", "g_W cos, mean of k", "g_x rel", "g_W rel",
                     f"{bl} g_x cos", f"{bl} g_W cos", "LQS / why exact"],
                    [[s["site"], f"{s['in']}->{s['out']}", s["path"],
                      C.fmt(s.get("rank")) if s.get("rank") is not None else "-",
                      cm(s, "gx_cos"), cm(s, "gw_cos"), C.fmt(s["gw_cos_avg"], 4),
                      C.fmt(s["gx_rel"], 3), C.fmt(s["gw_rel"], 3),
                      C.fmt(s.get("base_gx_cos"), 4), C.fmt(s.get("base_gw_cos"), 4),
                      (s.get("info") or "")[:60]] for s in r["sites"]]))
    return "\n".join(L) + "\n"


def charts(result: dict, base: str) -> List[str]:
    if not C.have_matplotlib():
        return []
    import matplotlib.pyplot as plt
    paths = []
    corpora = [(c, [r for r in ent.get("runs", []) if r.get("status") == "ok"])
               for c, ent in lm_corpora(result.get("lm")).items()]
    corpora = [(c, ok) for c, ok in corpora if ok]
    if corpora:
        fig, axes = plt.subplots(1, len(corpora), figsize=(6.5 * len(corpora), 4),
                                 squeeze=False)
        for ax, (c, ok) in zip(axes[0], corpora):
            for r in ok:
                xs, ys = zip(*r["val_curve"])
                ax.plot(xs, ys, marker="o", ms=3, label=f"{r['mode']} ({ys[-1]:.4f})")
            ax.set_xlabel("step")
            ax.set_ylabel("validation loss (nats/byte)")
            ax.set_title(f"{_lm_kind(c)} GPT on {c}")
            ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(f"{base}_lm.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    ok = [r for r in (result.get("digits") or {}).get("runs", []) if r.get("status") == "ok"]
    if ok:
        fig, ax = plt.subplots(figsize=(6.5, 4))
        for r in ok:
            xs, ys = zip(*r["acc_curve"])
            ax.plot(xs, ys, marker="o", ms=3, label=f"{r['mode']} ({ys[-1]:.2f}%)")
        ax.set_xlabel("step")
        ax.set_ylabel("test accuracy %")
        ax.set_title("ViT on digits")
        ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(f"{base}_digits.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    fi = result.get("fidelity")
    ok = [r for r in (fi or {}).get("models", []) if r.get("status") == "ok"]
    if ok:
        fig, axes = plt.subplots(len(ok), 1, figsize=(8, 2.6 * len(ok)), squeeze=False)
        for ax, r in zip(axes[:, 0], ok):
            xs = range(len(r["sites"]))
            for key, label in (("gx_cos", "g_x cos"), ("gw_cos", "g_W cos"),
                               ("gw_cos_avg", "g_W cos (mean of k)"),
                               ("base_gx_cos", "no-HOT g_x cos"), ("base_gw_cos", "no-HOT g_W cos")):
                vals = [s.get(key) for s in r["sites"]]
                if all(v is None for v in vals):
                    continue
                ax.plot(xs, [v if v is not None else float("nan") for v in vals],
                        marker=".", label=label, ls=":" if key.startswith("base") else "-")
            v = r.get("variant", "hot")
            ax.set_title(f"{r['model']} ({v}): per linear site (x: site index, forward order)",
                         fontsize=9)
            ax.set_ylabel("cosine vs fp64")
            ax.xaxis.get_major_locator().set_params(integer=True)
            ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(f"{base}_fidelity.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def write_outputs(result: dict, base: str) -> None:
    C.write_json(base + ".json", result)
    C.write_text(base + ".md", markdown(result))
    pngs = charts(result, base)
    C.log("")
    for t in result["targets"]:
        C.log(f"  {t['verdict']:4}  {t['what']}: {t['measured'] or '-'} (goal {t['goal']})")
    for corpus, ent in lm_corpora(result.get("lm")).items():
        for k, v in (ent.get("gap") or {}).items():
            gated = gated_mode([r["mode"] for r in ent.get("runs", [])])
            if k.endswith("_vs_inductor") and k != f"{gated}_vs_inductor":
                C.log(f"        {corpus}: {k.rsplit('_vs_', 1)[0]} vs inductor {v * 100:+.2f}%")
    if result.get("resume_commands"):
        C.log("not run (time budget); to finish:\n  " + "\n  ".join(result["resume_commands"]))
    C.log(f"wrote {base}.json, {base}.md" + "".join(f", {p}" for p in pngs))


def update_docs(results: List[dict], path: str) -> str:
    merged = merge_results(results) if len(results) > 1 else results[0]
    body = ("Written by `python bench/accuracy.py --update-docs` (or `--docs-only "
            "RESULT.json ...`). Do not edit by hand; per-site tables are in the results "
            "markdown.\n\n" + markdown(merged, title=False, per_site=False))
    return C.update_docs_section("accuracy", "Accuracy (bench/accuracy.py)", body, path)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", default="custom", choices=["smoke", "full", "gate", "custom"],
                   help="preset sizes (custom = full sizes, then your overrides; gate = what "
                        "the acceptance criteria need: lm on stdlib+torchsrc, digits, "
                        "fidelity vit_b16+gpt2_linear)")
    p.add_argument("--parts", help="comma list of lm,digits,fidelity")
    p.add_argument("--lm-corpora", help=f"comma list of {','.join(CORPORA)} (default: stdlib; "
                                        "gate: both)")
    p.add_argument("--lm-modes", help="comma list of fp32,inductor,hot,hot_ref,bf16 or "
                                      "hot[key=value,...] (full: inductor,hot)")
    p.add_argument("--digits-modes", help="comma list of fp32,hot,inductor,hot_ref, hot[...]")
    p.add_argument("--fidelity-models",
                   help="bytegpt,vit_b16,gpt2_linear,gpt2,llama_d2048,tiny_gpt,tiny_vit")
    p.add_argument("--lm-steps", type=int)
    p.add_argument("--lm-batch", type=int)
    p.add_argument("--lm-max-bytes", type=int,
                   help="cap of the train text per corpus (validation: a tenth); 0 = no cap")
    p.add_argument("--lm-seeds", type=int,
                   help="LM runs per mode, seeds --seed, --seed+1, ...: the gate takes the mean "
                        "of the per-seed gaps, each against Inductor's run of the same seed "
                        "(default 1)")
    p.add_argument("--digits-steps", type=int)
    p.add_argument("--digits-seeds", type=int, help="initialisations per mode (full: 3)")
    p.add_argument("--fidelity-warmup", type=int,
                   help="compiled fwd+bwd passes on the measurement batch, no optimizer step, "
                        "before measuring (default 3; raised to what rank=auto / LQS need)")
    p.add_argument("--fidelity-avg", type=int, help="measured HOT passes per site (default 4)")
    p.add_argument("--fidelity-variants", choices=["default", "all"], default="default",
                   help="measure fidelity for `hot` only (default) or every --hot-variants entry")
    p.add_argument("--digits-amp", choices=["bf16", "fp16", "none"],
                   help="autocast of the digits ViT's compiled modes (default none: fp32, where "
                        "a row-wise FP8 forward and e4m3 kept activations do not engage; fp32 "
                        "stays the reference)")
    p.add_argument("--no-tf32", action="store_true", help="strict fp32 matmuls in the fp32 LM")
    p.add_argument("--amp", choices=["bf16", "fp16", "none"],
                   help="autocast of the LM's inductor/hot modes and of the fidelity step "
                        "(default bf16; the smoke suite on a CPU: none, CPU bf16 is slow)")
    p.add_argument("--hot", nargs="*", help="HOTConfig overrides for every hot run, key=value "
                                            "(rank=auto, rank=16, gx_bits=8, gx_w_bits=8, ...)")
    p.add_argument("--hot-variants",
                   help='";"-separated hot variants trained side by side, each a ","-list of '
                        'key=value on top of --hot, "default" = no override: '
                        '"default;rank=16,gx_bits=8;gx_w_bits=4" -> modes hot, '
                        'hot[rank=16,gx_bits=8], hot[gx_w_bits=4] (in place of hot)')
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device")
    p.add_argument("--out", help="output folder (default bench/results)")
    p.add_argument("--tag", default="")
    p.add_argument("--budget-s", type=float,
                   help="skip what would not fit (full: 510, gate: 520; 0 = no budget)")
    p.add_argument("--estimate", action="store_true",
                   help="print the H100 time estimate of the selected runs and exit")
    p.add_argument("--cache-dir", help="Inductor/Triton cache folder (e.g. .carry/inductor)")
    p.add_argument("--update-docs", nargs="?", const=C.DOCS_FILE, default=None, metavar="PATH")
    p.add_argument("--docs-only", nargs="+", metavar="JSON_OR_DIR")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.docs_only:
        files, results = C.load_results(args.docs_only, "accuracy")
        C.log(f"updated {update_docs(results, args.update_docs or C.DOCS_FILE)} from "
              f"{', '.join(files)}")
        return 0
    C.use_cache_dir(args.cache_dir)
    result = run_suite(args)
    if result.get("estimate_only"):
        return 0
    if args.update_docs:
        C.log(f"updated {update_docs([result], args.update_docs)}")
    recs = (result.get("fidelity", {}).get("models", [])
            + result.get("digits", {}).get("runs", []))
    for ent in lm_corpora(result.get("lm")).values():
        recs += ent.get("runs", [])
    return 1 if any(r.get("status") == "error" for r in recs) else 0


if __name__ == "__main__":
    sys.exit(main())
