"""Accuracy of HOT training: a byte-level GPT on real text, a ViT on real digits, gradient fidelity.

    python bench/accuracy.py --suite smoke --out /tmp/r        # CPU, tiny sizes
    python bench/accuracy.py --suite full --out $OUT            # the H100 run (< 9 min)
    python bench/accuracy.py --suite full --parts lm --lm-modes hot --out $OUT
    python bench/accuracy.py --docs-only bench/results           # refresh the docs section

Three parts, all on the same seed and the same batches for every mode:

* ``lm``: a byte-level GPT (57M parameters at full size) trained for a fixed number of steps
  on the Python standard library's own ``.py`` sources (``sysconfig.get_paths()["stdlib"]``,
  split by file into train/validation), in ``fp32`` (eager; TF32 matmuls at full size, see
  ``--no-tf32``), ``inductor`` (torch.compile, bf16 autocast) and ``hot`` (backend=hot, bf16
  autocast). Validation-loss curves, final losses, the relative gap of hot to inductor.
* ``digits``: a ViT on scikit-learn's handwritten digits (8x8 upsampled to 32x32, patch 4),
  ``fp32`` eager vs ``hot`` (fp32 forward): final test accuracy.
* ``fidelity``: per linear site of real models, cosine similarity and relative error of
  g_x and g_W from one compiled HOT step against an fp64 eager copy of the model on the same
  batch (and, for scale, of plain bf16 autocast). g_W is the weight's ``.grad``; g_x is the
  gradient of a zero "probe" tensor added to each linear's input by a forward pre-hook,
  which keeps the compiled graph whole (a tensor hook would graph-break at every layer).

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
import statistics
import sys
import time
from typing import Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import common as C  # noqa: E402

SUITES = {
    "full": dict(
        lm=dict(d=768, layers=8, heads=12, seq=512, batch=32, steps=1000, lr=1e-3,
                warmup=100, eval_every=100, val_windows=128, max_bytes=None, tf32=True,
                modes=["fp32", "inductor", "hot"]),
        digits=dict(img=32, patch=4, d=256, layers=6, heads=8, batch=128, steps=600,
                    lr=1e-3, warmup=50, eval_every=50, shift=2, seeds=3,
                    modes=["fp32", "hot"]),
        fidelity=dict(models=["bytegpt", "vit_b16", "gpt2_linear"], avg=4, hot={}),
        parts=["lm", "digits", "fidelity"], budget_s=510.0),
    "smoke": dict(
        # the LM has the very shapes of train.py's tiny_gpt, so the two smoke runs share
        # Inductor's compiled kernels through its on-disk cache
        lm=dict(d=64, layers=1, heads=4, seq=64, batch=8, steps=16, lr=3e-3, warmup=4,
                eval_every=8, val_windows=8, max_bytes=1_000_000, tf32=False,
                modes=["fp32", "inductor", "hot"]),
        digits=dict(img=32, patch=8, d=64, layers=1, heads=4, batch=64, steps=16, lr=3e-3,
                    warmup=4, eval_every=8, shift=1, seeds=1, modes=["fp32", "hot"]),
        fidelity=dict(models=["tiny_gpt"], avg=2, hot={"lqs_calibration_steps": 1}),
        parts=["lm", "digits", "fidelity"], budget_s=None, cpu_amp="none"),
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


# ----------------------------------------------------------------------------- LM part
def lm_data(cfg: dict, device) -> dict:
    root, train_files, val_files = C.stdlib_sources()
    limit = cfg.get("max_bytes")
    train = C.read_bytes(train_files, limit)
    val = C.read_bytes(val_files, limit // 10 if limit else None)
    return {"train": train.to(device), "val": val.to(device),
            "meta": {"stdlib": root, "python": sys.version.split()[0],
                     "train_files": len(train_files), "val_files": len(val_files),
                     "train_bytes": int(train.numel()), "val_bytes": int(val.numel())}}


def train_lm(mode: str, cfg: dict, data: dict, device, amp: Optional[str], hot_extra: dict,
             seed: int, keep_state: bool = False) -> dict:
    C.reset_compile_state()
    torch.manual_seed(seed)
    with torch.device(device):
        gpt = C.GPT(vocab=256, d=cfg["d"], layers=cfg["layers"], heads=cfg["heads"],
                    seq=cfg["seq"])
    wrapper = C.LMLoss(gpt)
    amp = amp if C.MODE_INFO[mode][1] else None
    small = cfg["d"] < 256
    step_fn, be = C.compile_model(wrapper, mode, _hot_kwargs(small, hot_extra))
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
    tf32 = bool(cfg.get("tf32")) and mode == "fp32" and device.type == "cuda"
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
    rec = {"mode": mode, "status": "ok", "amp": amp or "none", "tf32": tf32,
           "final_val_loss": val_curve[-1][1], "val_curve": val_curve,
           "final_train_loss": sum(tail) / len(tail),
           "train_curve": [[i + 1, v] for i, v in enumerate(train_losses)
                           if (i + 1) % max(1, steps // 100) == 0 or i == 0],
           "step_ms": step_ms,
           "seconds": time.perf_counter() - t_run,
           "params_m": round(C.count_params(gpt) / 1e6, 2)}
    rec.update(C.hot_summary(be))
    if not all(math.isfinite(v) for v in train_losses) or not math.isfinite(rec["final_val_loss"]):
        rec["status"], rec["error"] = "error", "non-finite loss"
    if keep_state:
        rec["_state"] = {k: v.detach().clone() for k, v in gpt.state_dict().items()}
    return rec


# ----------------------------------------------------------------------------- digits part
def train_digits(mode: str, cfg: dict, data, device, hot_extra: dict, seed: int) -> dict:
    """Train from ``cfg["seeds"]`` initialisations (one compiled graph reused: the weights
    are re-initialised in place, LQS re-calibrates); report the mean test accuracy."""
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
    step_fn, be = C.compile_model(wrapper, mode, _hot_kwargs(cfg["d"] < 256, hot_extra))
    steps, batch, s = cfg["steps"], cfg["batch"], cfg["shift"]

    def evaluate() -> float:
        with torch.no_grad():
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
    rec = {"mode": mode, "status": "ok", "test_acc": sum(accs) / n, "test_acc_seeds": accs,
           "test_acc_std": statistics.pstdev(accs) if n > 1 else 0.0, "seeds": seeds,
           "acc_curve": mean_curve, "final_train_loss": sum(finals) / n,
           "seconds": time.perf_counter() - t_run,
           "params_m": round(C.count_params(vit) / 1e6, 2)}
    rec.update(C.hot_summary(be))
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


def _cmp(a: torch.Tensor, b: torch.Tensor):
    a, b = a.flatten().double(), b.flatten().double()
    nb = float(b.norm())
    if nb == 0:
        return None, None
    cos = float(a @ b / (a.norm() * b.norm()).clamp_min(1e-300))
    return cos, float((a - b).norm() / nb)


def fidelity_model(name: str, device, amp, hot_extra: dict, avg: int,
                   lm_state: Optional[dict], lm_cfg: dict, lm_data_: Optional[dict],
                   seed: int) -> dict:
    import train as T
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
            return {"model": name, "status": "skipped", "error": why}
        wl = T.MODELS[key](device)
        wrapper = wl.module
        batch = wl.make_batch(bsz or wl.batch, gen)
        note = wl.notes + " (random init)"
        hot_kw = {"exclude": wl.exclude, **wl.hot, **hot_extra}
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
    gx_base, gw_base = _grads(base, probes, sites)
    del base, probes, loss

    # HOT: compiled whole; LQS calibrates on the first passes, then `avg` measured passes
    hot = copy.deepcopy(wrapper)
    probes, _ = _attach_probes(hot, shapes, device)
    step_fn, be = C.compile_model(hot, "hot", hot_kw)
    calib = be.config.lqs_calibration_steps
    params = list(hot.parameters()) + list(probes.values())
    gx_sum: Dict[str, torch.Tensor] = {}
    gw_sum: Dict[str, torch.Tensor] = {}
    first = None
    for i in range(calib + avg):
        for p in params:
            p.grad = None
        with C.amp_ctx(device, amp):
            loss = step_fn(*batch)
        loss.backward()
        if i < calib:
            continue
        gx, gw = _grads(hot, probes, sites)
        if first is None:
            first = (gx, gw)
        for n in sites:
            gx_sum[n] = gx_sum.get(n, 0) + gx[n]
            gw_sum[n] = gw_sum.get(n, 0) + gw[n]
    rewritten = {r.name: r for r in be.report.layers}
    for r in be.report.layers:
        r.refresh_lqs()

    def status(n):
        r = rewritten.get(n) or next((r for k, r in rewritten.items()
                                      if k.endswith("." + n) or n.endswith("." + k)), None)
        if r is None:
            return "?", None
        return ("hot" if r.rewritten else "exact"), (r.lqs_choice if r.rewritten else r.reason)

    rows = []
    for n in sites:
        w = mods[n].weight
        st, info = status(n)
        gx_c, gx_r = _cmp(first[0][n], gx_ref[n])
        gw_c, gw_r = _cmp(first[1][n], gw_ref[n])
        gxa_c, gxa_r = _cmp(gx_sum[n] / avg, gx_ref[n])
        gwa_c, gwa_r = _cmp(gw_sum[n] / avg, gw_ref[n])
        _, bx_r = _cmp(gx_base[n], gx_ref[n])
        _, bw_r = _cmp(gw_base[n], gw_ref[n])
        io = (w.shape[1], w.shape[0]) if isinstance(mods[n], nn.Linear) else tuple(w.shape)
        rows.append({"site": n, "in": int(io[0]), "out": int(io[1]),
                     "kind": type(mods[n]).__name__, "path": st, "info": info,
                     "gx_cos": gx_c, "gx_rel": gx_r, "gw_cos": gw_c, "gw_rel": gw_r,
                     "gx_cos_avg": gxa_c, "gx_rel_avg": gxa_r,
                     "gw_cos_avg": gwa_c, "gw_rel_avg": gwa_r,
                     "base_gx_rel": bx_r, "base_gw_rel": bw_r})

    def med(key, only="hot"):
        vals = [r[key] for r in rows if r["path"] == only and r[key] is not None]
        return statistics.median(vals) if vals else None

    def worst(key, fn=min):
        vals = [r[key] for r in rows if r["path"] == "hot" and r[key] is not None]
        return fn(vals) if vals else None
    summary = {"sites": len(rows), "rewritten": sum(r["path"] == "hot" for r in rows),
               "gx_cos_median": med("gx_cos"), "gx_cos_min": worst("gx_cos"),
               "gw_cos_median": med("gw_cos"), "gw_cos_min": worst("gw_cos"),
               "gx_rel_median": med("gx_rel"), "gw_rel_median": med("gw_rel"),
               "gw_cos_avg_median": med("gw_cos_avg"), "gx_cos_avg_median": med("gx_cos_avg"),
               "base_gx_rel_median": med("base_gx_rel"),
               "base_gw_rel_median": med("base_gw_rel")}
    return {"model": name, "status": "ok", "note": note, "amp": amp or "none", "avg": avg,
            "sites": rows, "summary": summary, **C.hot_summary(be)}


# ----------------------------------------------------------------------------- driver
def run_suite(args) -> dict:
    preset = copy.deepcopy(SUITES["full" if args.suite == "full" else "smoke"])
    if args.suite == "custom":
        preset = copy.deepcopy(SUITES["full"])
    device = C.pick_device(args.device)
    C.configure_cpu_compile(device)
    parts = args.parts.split(",") if args.parts else preset["parts"]
    lm_cfg, dg_cfg, fi_cfg = preset["lm"], preset["digits"], preset["fidelity"]
    for k, v in (("steps", args.lm_steps), ("batch", args.lm_batch)):
        if v is not None:
            lm_cfg[k] = v
    if args.digits_steps is not None:
        dg_cfg["steps"] = args.digits_steps
    if args.digits_seeds is not None:
        dg_cfg["seeds"] = args.digits_seeds
    if args.no_tf32:
        lm_cfg["tf32"] = False
    if args.lm_modes:
        lm_cfg["modes"] = args.lm_modes.split(",")
    if args.digits_modes:
        dg_cfg["modes"] = args.digits_modes.split(",")
    if args.fidelity_models:
        fi_cfg["models"] = args.fidelity_models.split(",")
    amp = args.amp or (preset.get("cpu_amp", "bf16") if device.type == "cpu" else "bf16")
    amp = None if amp == "none" else amp
    hot_extra = C.parse_overrides(args.hot)
    budget = args.budget_s if args.budget_s is not None else preset.get("budget_s")
    out_dir = args.out or C.RESULTS_DIR
    base = C.result_base(out_dir, "accuracy", device, args.tag)
    result = {"kind": "accuracy", "suite": args.suite, "env": C.environment(device),
              "options": {"parts": parts, "amp": amp or "none", "seed": args.seed,
                          "hot": hot_extra, "budget_s": budget},
              "targets": []}
    t_suite = time.perf_counter()
    C.log(f"accuracy bench: parts {','.join(parts)} on {C.device_name(device)} -> {base}.*")

    def over_budget(expect_s: float) -> bool:
        return bool(budget) and time.perf_counter() - t_suite + expect_s > budget

    def save():
        C.write_json(base + ".json", result)

    lm_state = lm_data_ = None
    if "lm" in parts:
        lm_data_ = lm_data(lm_cfg, device)
        result["lm"] = {"config": {k: v for k, v in lm_cfg.items()}, "data": lm_data_["meta"],
                        "runs": []}
        last = 0.0
        for mode in lm_cfg["modes"]:
            if over_budget(last * 0.8):
                rec = {"mode": mode, "status": "skipped", "error": f"time budget {budget} s"}
            else:
                t0 = time.perf_counter()
                try:
                    keep = mode == ("inductor" if "inductor" in lm_cfg["modes"]
                                    else lm_cfg["modes"][0])
                    rec = train_lm(mode, lm_cfg, lm_data_, device, amp, hot_extra, args.seed,
                                   keep_state=keep)
                except Exception as e:  # noqa: BLE001
                    rec = _err(mode, e)
                last = time.perf_counter() - t0
            if "_state" in rec:
                lm_state = (rec.pop("_state"), mode)
            result["lm"]["runs"].append(rec)
            C.log(_lm_line(rec, lm_cfg))
            save()
        result["lm"]["gap"] = lm_gap(result["lm"]["runs"])
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
            if over_budget(40.0):
                rec = {"mode": mode, "status": "skipped", "error": f"time budget {budget} s"}
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
            if over_budget(45.0):
                rec = {"model": name, "status": "skipped", "error": f"time budget {budget} s"}
            else:
                t0 = time.perf_counter()
                try:
                    rec = fidelity_model(name, device, amp, {**fi_cfg.get("hot", {}), **hot_extra},
                                         fi_cfg["avg"],
                                         lm_state, lm_cfg, lm_data_, args.seed)
                except Exception as e:  # noqa: BLE001
                    rec = _err(name, e, key="model")
                rec["seconds"] = time.perf_counter() - t0
            result["fidelity"]["models"].append(rec)
            C.log(_fid_line(rec))
            save()
        C.reset_compile_state()
    result["targets"] = targets(result)
    result["suite_s"] = time.perf_counter() - t_suite
    resume = []
    suite_arg = f"--suite {args.suite} " if args.suite != "custom" else ""
    for part, key, flag in (("lm", "runs", "--lm-modes"), ("digits", "runs", "--digits-modes"),
                            ("fidelity", "models", "--fidelity-models")):
        names = [r.get("mode", r.get("model")) for r in result.get(part, {}).get(key, [])
                 if r.get("status") == "skipped" and "budget" in r.get("error", "")]
        if names:
            resume.append(f"python bench/accuracy.py {suite_arg}--parts {part} {flag} "
                          f"{','.join(names)} --out $OUT")
    if resume:
        result["resume_commands"] = resume
    write_outputs(result, base)
    return result


def _err(mode, e, key="mode") -> dict:
    import traceback
    return {key: mode, "status": "error", "error": f"{type(e).__name__}: {str(e)[:400]}",
            "traceback": traceback.format_exc()[-3000:]}


def lm_gap(runs: List[dict]) -> dict:
    by = {r["mode"]: r for r in runs if r.get("status") == "ok"}
    gap = {}
    for a, b in (("hot", "inductor"), ("hot", "fp32"), ("inductor", "fp32")):
        if a in by and b in by:
            gap[f"{a}_vs_{b}"] = (by[a]["final_val_loss"] - by[b]["final_val_loss"]) \
                / by[b]["final_val_loss"]
    return gap


def targets(result: dict) -> List[dict]:
    out = []
    gap = result.get("lm", {}).get("gap", {})
    v = gap.get("hot_vs_inductor")
    out.append({"what": "byte-level GPT final val loss, hot vs Inductor (same autocast)",
                "goal": "within 1%", "measured": None if v is None else f"{v * 100:+.2f}%",
                "verdict": "n/a" if v is None else ("PASS" if v <= 0.01 else "FAIL")})
    by = {r["mode"]: r for r in result.get("digits", {}).get("runs", []) if r.get("status") == "ok"}
    d = by["fp32"]["test_acc"] - by["hot"]["test_acc"] if {"fp32", "hot"} <= set(by) else None
    out.append({"what": "digits ViT test accuracy, fp32 minus hot",
                "goal": "<= 0.5 point", "measured": None if d is None else f"{d:+.2f} points",
                "verdict": "n/a" if d is None else ("PASS" if d <= 0.5 else "FAIL")})
    return out


def _lm_line(r, cfg) -> str:
    if r.get("status") != "ok":
        return f"lm      {r['mode']:<9} {r['status'].upper()}: {r.get('error', '')}"
    hot = (f", HOT {r['hot_sites_rewritten']}/{r['hot_sites_total']} sites"
           if "hot_sites_total" in r else "")
    return (f"lm      {r['mode']:<9} val loss {r['final_val_loss']:.4f}  train "
            f"{r['final_train_loss']:.4f}  {cfg['steps']} steps in {r['seconds']:.0f} s "
            f"({C.fmt(r['step_ms'])} ms/step){hot}")


def _digits_line(r, cfg) -> str:
    if r.get("status") != "ok":
        return f"digits  {r['mode']:<9} {r['status'].upper()}: {r.get('error', '')}"
    return (f"digits  {r['mode']:<9} test acc {r['test_acc']:.2f}% (seeds: "
            f"{', '.join(f'{a:.2f}' for a in r.get('test_acc_seeds', []))})  train loss "
            f"{r['final_train_loss']:.4f}  ({cfg['steps']} steps, {r['seconds']:.0f} s)")


def _fid_line(r) -> str:
    if r.get("status") != "ok":
        return f"grads   {r['model']:<9} {r['status'].upper()}: {r.get('error', '')}"
    s = r["summary"]
    return (f"grads   {r['model']:<9} {s['rewritten']}/{s['sites']} sites HOT; median cos "
            f"g_x {C.fmt(s['gx_cos_median'], 4)} g_W {C.fmt(s['gw_cos_median'], 4)}; "
            f"median rel err g_x {C.fmt(s['gx_rel_median'], 3)} g_W "
            f"{C.fmt(s['gw_rel_median'], 3)} (no HOT: "
            f"{C.fmt(s['base_gx_rel_median'], 3)} / {C.fmt(s['base_gw_rel_median'], 3)})"
            f" ({r.get('seconds', 0):.0f} s)")


# ----------------------------------------------------------------------------- output
def merge_results(results: List[dict]) -> dict:
    """Several accuracy JSONs (a suite split over calls) -> one; later parts/runs win."""
    out: dict = {"kind": "accuracy", "env": results[-1].get("env", {}),
                 "sources": [r.get("env", {}).get("date") for r in results]}
    for r in results:
        for part, key in (("lm", "mode"), ("digits", "mode")):
            if part in r:
                dst = out.setdefault(part, {"runs": []})
                dst.update({k: v for k, v in r[part].items() if k != "runs"})
                for rec in r[part]["runs"]:
                    dst["runs"] = [x for x in dst["runs"] if x[key] != rec[key]
                                   or (x.get("status") == "ok" and rec.get("status") != "ok")]
                    if not any(x[key] == rec[key] for x in dst["runs"]):
                        dst["runs"].append(rec)
        if "fidelity" in r:
            dst = out.setdefault("fidelity", {"config": r["fidelity"].get("config"),
                                              "models": []})
            for rec in r["fidelity"]["models"]:
                dst["models"] = [x for x in dst["models"] if x["model"] != rec["model"]]
                dst["models"].append(rec)
    if "lm" in out:
        out["lm"]["gap"] = lm_gap(out["lm"]["runs"])
    out["targets"] = targets(out)
    return out


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
        c, d = lm["config"], lm.get("data", {})
        params = next((r.get("params_m") for r in lm["runs"] if r.get("params_m")), None)
        L.append(f"\n### Byte-level GPT on the Python standard library\n\n{params}M parameters "
                 f"(d={c['d']}, {c['layers']} layers, {c['heads']} heads), {c['batch']}x"
                 f"{c['seq']} bytes per step, {c['steps']} steps, AdamW lr {c['lr']} with "
                 f"warm-up {c['warmup']} and cosine decay, clip 1.0. Data: {d.get('train_files')} "
                 f"train / {d.get('val_files')} validation files of Python {d.get('python')}'s "
                 f"stdlib ({d.get('train_bytes')} / {d.get('val_bytes')} bytes, split by file); "
                 f"validation loss over {c['val_windows']} fixed windows, nats per byte.\n")
        ref = {r["mode"]: r for r in lm["runs"] if r.get("status") == "ok"}
        rows = []
        for r in lm["runs"]:
            if r.get("status") != "ok":
                rows.append([r["mode"], "-", "-", "-", "-", "-", f"{r['status']}: "
                             f"{r.get('error', '')}"[:100]])
                continue
            vs = lambda m: (f"{(r['final_val_loss'] / ref[m]['final_val_loss'] - 1) * 100:+.2f}%"  # noqa: E731
                            if m in ref else "-")
            note = "TF32 matmuls" if r.get("tf32") else ""
            if "hot_sites_total" in r:
                note = f"HOT {r['hot_sites_rewritten']}/{r['hot_sites_total']} sites"
            rows.append([r["mode"], C.fmt(r["final_val_loss"], 4), vs("inductor"), vs("fp32"),
                         C.fmt(r["final_train_loss"], 4), C.fmt(r.get("step_ms")), note])
        L.append(C.md_table(["mode", "final val loss", "vs inductor", "vs fp32",
                             "final train loss", "ms/step", "note"], rows))
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
                rows.append([r["mode"], "-", "-", "-", f"{r['status']}: {r.get('error', '')}"])
                continue
            dd = (f"{r['test_acc'] - ref['fp32']['test_acc']:+.2f}" if "fp32" in ref else "-")
            per = ", ".join(f"{a:.2f}" for a in r.get("test_acc_seeds", []))
            rows.append([r["mode"], f"{C.fmt(r['test_acc'])} ± {C.fmt(r.get('test_acc_std'))}",
                         dd, per, C.fmt(r["final_train_loss"], 4)])
        L.append(C.md_table(["mode", "test accuracy % (mean ± sd)", "vs fp32 (points)",
                             "per seed", "final train loss"], rows))
    fi = result.get("fidelity")
    if fi:
        L.append("\n### Gradient fidelity per linear site (one HOT step vs fp64)\n\n"
                 "cos / rel = cosine similarity and ||hot - fp64|| / ||fp64|| of the site's "
                 "g_x and g_W; `mean of k` averages k HOT steps on the same batch (stochastic "
                 "rounding averages out, the low-rank g_W bias does not); `baseline` is the "
                 "same step without HOT (same autocast), for scale.\n")
        rows = []
        for r in fi["models"]:
            if r.get("status") != "ok":
                rows.append([r["model"], "-", "-", "-", "-", "-", "-", "-",
                             f"{r['status']}: {r.get('error', '')}"[:100]])
                continue
            s = r["summary"]
            rows.append([r["model"], f"{s['rewritten']}/{s['sites']}",
                         f"{C.fmt(s['gx_cos_median'], 4)} ({C.fmt(s['gx_cos_min'], 3)})",
                         f"{C.fmt(s['gw_cos_median'], 4)} ({C.fmt(s['gw_cos_min'], 3)})",
                         C.fmt(s["gx_rel_median"], 3), C.fmt(s["gw_rel_median"], 3),
                         C.fmt(s["gw_cos_avg_median"], 4),
                         f"{C.fmt(s['base_gx_rel_median'], 4)} / "
                         f"{C.fmt(s['base_gw_rel_median'], 4)}", r.get("note", "")])
        L.append(C.md_table(["model", "HOT sites", "g_x cos median (min)",
                             "g_W cos median (min)", "g_x rel median", "g_W rel median",
                             "g_W cos, mean of k", "baseline rel g_x / g_W", "note"], rows))
        if per_site:
            for r in fi["models"]:
                if r.get("status") != "ok":
                    continue
                L.append(f"\n#### {r['model']}: per site (k={r['avg']})\n")
                L.append(C.md_table(
                    ["site", "in->out", "path", "g_x cos", "g_x rel", "g_W cos", "g_W rel",
                     "g_x cos (k)", "g_W cos (k)", "baseline g_x rel", "baseline g_W rel",
                     "LQS / why exact"],
                    [[s["site"], f"{s['in']}->{s['out']}", s["path"], C.fmt(s["gx_cos"], 4),
                      C.fmt(s["gx_rel"], 3), C.fmt(s["gw_cos"], 4), C.fmt(s["gw_rel"], 3),
                      C.fmt(s["gx_cos_avg"], 4), C.fmt(s["gw_cos_avg"], 4),
                      C.fmt(s["base_gx_rel"], 4), C.fmt(s["base_gw_rel"], 4),
                      (s.get("info") or "")[:60]] for s in r["sites"]]))
    return "\n".join(L) + "\n"


def charts(result: dict, base: str) -> List[str]:
    if not C.have_matplotlib():
        return []
    import matplotlib.pyplot as plt
    paths = []
    for part, curve, ylabel, title, fmt in (
            ("lm", "val_curve", "validation loss (nats/byte)", "byte-level GPT on stdlib sources",
             "{:.4f}"),
            ("digits", "acc_curve", "test accuracy %", "ViT on digits", "{:.2f}%")):
        ok = [r for r in (result.get(part) or {}).get("runs", []) if r.get("status") == "ok"]
        if not ok:
            continue
        fig, ax = plt.subplots(figsize=(6.5, 4))
        for r in ok:
            xs, ys = zip(*r[curve])
            ax.plot(xs, ys, marker="o", ms=3, label=f"{r['mode']} ({fmt.format(ys[-1])})")
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend()
        fig.tight_layout()
        paths.append(f"{base}_{part}.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    fi = result.get("fidelity")
    ok = [r for r in (fi or {}).get("models", []) if r.get("status") == "ok"]
    if ok:
        fig, axes = plt.subplots(len(ok), 1, figsize=(8, 2.6 * len(ok)), squeeze=False)
        for ax, r in zip(axes[:, 0], ok):
            xs = range(len(r["sites"]))
            for key, label in (("gx_cos", "g_x cos"), ("gw_cos", "g_W cos"),
                               ("gw_cos_avg", "g_W cos (mean of k)")):
                ax.plot(xs, [s[key] if s[key] is not None else float("nan") for s in r["sites"]],
                        marker=".", label=label)
            ax.set_title(f"{r['model']}: per linear site (x: site index, forward order)",
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
    p.add_argument("--suite", default="custom", choices=["smoke", "full", "custom"],
                   help="preset sizes (custom = full sizes, then your overrides)")
    p.add_argument("--parts", help="comma list of lm,digits,fidelity")
    p.add_argument("--lm-modes", help="comma list of fp32,inductor,hot,hot_ref,bf16")
    p.add_argument("--digits-modes", help="comma list of fp32,hot,inductor,hot_ref")
    p.add_argument("--fidelity-models",
                   help="bytegpt,vit_b16,gpt2_linear,gpt2,llama_d2048,tiny_gpt,tiny_vit")
    p.add_argument("--lm-steps", type=int)
    p.add_argument("--lm-batch", type=int)
    p.add_argument("--digits-steps", type=int)
    p.add_argument("--digits-seeds", type=int, help="initialisations per mode (full: 3)")
    p.add_argument("--no-tf32", action="store_true", help="strict fp32 matmuls in the fp32 LM")
    p.add_argument("--amp", choices=["bf16", "fp16", "none"],
                   help="autocast of the LM's inductor/hot modes and of the fidelity step "
                        "(default bf16; the smoke suite on a CPU: none, CPU bf16 is slow)")
    p.add_argument("--hot", nargs="*", help="HOTConfig overrides, key=value")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device")
    p.add_argument("--out", help="output folder (default bench/results)")
    p.add_argument("--tag", default="")
    p.add_argument("--budget-s", type=float, help="skip what would not fit (full: 510)")
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
    if args.update_docs:
        C.log(f"updated {update_docs([result], args.update_docs)}")
    recs = (result.get("lm", {}).get("runs", []) + result.get("digits", {}).get("runs", [])
            + result.get("fidelity", {}).get("models", []))
    return 1 if any(r.get("status") == "error" for r in recs) else 0


if __name__ == "__main__":
    sys.exit(main())
