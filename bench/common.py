"""Helpers shared by bench/train.py and bench/accuracy.py.

Why one module: both suites need the same plumbing (device description, dated result
file names, markdown tables, the marked sections of docs/BENCHMARKS.md, charts when
matplotlib is there), the same built-in models (a GPT, a ViT and a Llama-style block
used whenever timm/transformers are absent and for the CPU smoke runs), and the same
definition of a "mode" (which backend, which autocast) so that "hot" means the same
thing in the speed and the accuracy numbers.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import math
import os
import platform
import re
import subprocess
import sys
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH_DIR)
RESULTS_DIR = os.path.join(BENCH_DIR, "results")
DOCS_FILE = os.path.join(REPO, "docs", "BENCHMARKS.md")


# ----------------------------------------------------------------------------- environment
def pick_device(name: Optional[str] = None) -> torch.device:
    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu-{platform.machine()}-{os.cpu_count()}c"


def device_slug(device: torch.device) -> str:
    s = device_name(device).lower()
    s = re.sub(r"^nvidia\s+", "", s)
    return re.sub(r"[^a-z0-9]+", "-", s).strip("-")


def file_part(name: str) -> str:
    """``name`` (a mode such as ``hot[saved_activations=exact]``) as a file-name part of
    letters, digits, ``.``, ``_`` and ``-`` only: files with brackets or ``=`` in their names
    do not come back from the device tool."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-")


def git_commit() -> Optional[str]:
    """HEAD's short hash, with "+dirty" when tracked files differ from it, and then the
    digest of the package's code that ran (``code_digest``): the device machines get a
    copy of the working tree next to a .git that can be older, and a result must not name
    a commit whose code it did not run. ``python bench/common.py --which DIGEST`` names the
    commits whose package has that digest."""
    try:
        out = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10)
        head = out.stdout.strip()
        if not head:
            return None
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True,
                               timeout=30).stdout.strip()
        # a new module of the package that git does not track yet runs too
        dirty = dirty or subprocess.run(
            ["git", "-C", REPO, "ls-files", "--others", "--exclude-standard", _CODE_DIR],
            capture_output=True, text=True, timeout=30).stdout.strip()
    except Exception:  # noqa: BLE001 - a missing git is not an error for a benchmark
        return None
    if not dirty:
        return head
    try:
        return f"{head}+dirty, code {code_digest()}"
    except OSError as e:
        return f"{head}+dirty (no code digest: {e})"


_CODE_DIR = "hotcompile"


def _digest(files: Iterable[Tuple[str, bytes]]) -> str:
    h = hashlib.sha1()
    for path, data in sorted(files):
        h.update(path.encode() + b"\0" + str(len(data)).encode() + b"\0" + data)
    return h.hexdigest()[:10]


def code_digest() -> str:
    """A digest of the package's ``.py`` files as they are on disk (paths and bytes): the
    same for a working tree and for a commit whose package it equals
    (``commits_with_code``)."""
    root = os.path.join(REPO, _CODE_DIR)
    files = []
    for d, _, names in os.walk(root):
        for n in names:
            if n.endswith(".py"):
                path = os.path.join(d, n)
                with open(path, "rb") as f:
                    files.append((os.path.relpath(path, REPO).replace(os.sep, "/"), f.read()))
    return _digest(files)


def _tree_files(rev: str) -> List[Tuple[str, str]]:
    """(path, blob id) of the package's ``.py`` files at ``rev``."""
    out = subprocess.run(["git", "-C", REPO, "ls-tree", "-r", "-z", rev, _CODE_DIR],
                         capture_output=True, text=True, check=True).stdout
    rows = [entry.split("\t", 1) for entry in out.split("\0") if entry]
    return [(path, meta.split()[2]) for meta, path in rows if path.endswith(".py")]


def _blobs(ids: Iterable[str]) -> Dict[str, bytes]:
    """Blob contents by id, from one ``git cat-file --batch``."""
    ids = sorted(set(ids))
    out = subprocess.run(["git", "-C", REPO, "cat-file", "--batch"], check=True,
                         input="".join(i + "\n" for i in ids).encode(),
                         capture_output=True).stdout
    blobs, pos = {}, 0
    for i in ids:
        end = out.index(b"\n", pos)
        header = out[pos:end].split()
        if len(header) != 3:        # "<id> missing": a partial or shallow clone
            raise RuntimeError(f"git has no object {i} ({out[pos:end].decode()!r})")
        size = int(header[2])
        blobs[i] = out[end + 1:end + 1 + size]
        pos = end + 2 + size
    return blobs


def commits_with_code(digest: str, limit: int = 200) -> List[str]:
    """The commits (of the last ``limit`` from HEAD) whose package has ``code_digest``
    ``digest``: which code a "+dirty" result ran."""
    revs = subprocess.run(["git", "-C", REPO, "rev-list", f"--max-count={limit}", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.split()
    trees = {r: _tree_files(r) for r in revs}
    blobs = _blobs(b for files in trees.values() for _, b in files)
    return [r[:7] for r, files in trees.items()
            if _digest((p, blobs[b]) for p, b in files) == digest]


def optional_version(mod: str) -> Optional[str]:
    try:
        m = __import__(mod)
    except Exception:  # noqa: BLE001
        return None
    return getattr(m, "__version__", "?")


def environment(device: torch.device) -> dict:
    env = {"device": device_name(device), "device_type": device.type,
           "torch": torch.__version__, "python": platform.python_version(),
           "cuda": torch.version.cuda, "git": git_commit(),
           "date": _dt.datetime.now().isoformat(timespec="seconds"),
           "host_cpus": os.cpu_count()}
    for m in ("hotcompile", "triton", "timm", "transformers", "torchao"):
        env[m] = optional_version(m)
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env["device_memory_gib"] = round(p.total_memory / 2 ** 30, 1)
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
    return env


def stamp() -> str:
    return _dt.datetime.now().strftime("%Y-%m-%dT%H%M%S")


def result_base(out_dir: str, suite: str, device: torch.device, tag: str = "") -> str:
    """``<out>/<suite>_<date>_<device>[_tag]`` (no extension)."""
    os.makedirs(out_dir, exist_ok=True)
    name = f"{suite}_{stamp()}_{device_slug(device)}" + (f"_{tag}" if tag else "")
    return os.path.join(out_dir, name)


def configure_cpu_compile(device: torch.device) -> None:
    """On a small CPU box, Inductor's worker pool costs more than it saves for tiny graphs."""
    if device.type == "cpu" and "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:
        torch._inductor.config.compile_threads = 1


def use_cache_dir(path: Optional[str]) -> None:
    """Point Inductor's and Triton's on-disk caches (this process and its workers) at path."""
    if path:
        path = os.path.abspath(path)
        os.makedirs(path, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
        os.environ["TRITON_CACHE_DIR"] = os.path.join(path, "triton")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def amp_ctx(device: torch.device, amp: Optional[str]):
    """autocast for ``amp`` in {"bf16", "fp16"}; a null context for None / "none"."""
    if not amp or amp == "none":
        return contextlib.nullcontext()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[amp]
    return torch.autocast(device.type, dtype=dtype)


def finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def json_safe(obj):
    """Recursively replace non-finite floats by None so the JSON stays standard."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def write_json(path: str, data) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(json_safe(data), f, indent=1)
    os.replace(tmp, path)


def write_text(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


# ----------------------------------------------------------------------------- modes
MODE_INFO = {
    # name: (compiled?, amp?, description)
    "fp32": (False, False, "eager fp32"),
    "bf16": (False, True, "eager bf16 autocast"),
    "inductor": (True, True, "torch.compile Inductor, bf16 autocast"),
    "hot": (True, True, "backend=hot, kernels='auto' (fused Triton on CUDA)"),
    "hot_ref": (True, True, "backend=hot, kernels='reference'"),
    "fp8_tensorwise": (True, True, "torchao float8 tensorwise + Inductor, bf16 autocast"),
    "fp8_rowwise": (True, True, "torchao float8 rowwise + Inductor, bf16 autocast"),
    # torchao's row-wise recipe with g_W in bf16: the forward and g_x GEMMs in FP8, their
    # casts plain ops Inductor fuses with the producers; what HOT's FP8 forward would give
    # a site whose backward stays exact (issue 12 on ViT-B)
    "fp8_rowwise_with_gw_hp": (True, True, "torchao float8 rowwise, g_W in bf16 + Inductor, "
                                           "bf16 autocast"),
}


def hot_config(kernels: str = "auto", **overrides):
    """A HOTConfig for a mode; a ``kernels=`` override (``--hot kernels=reference``) wins."""
    import hotcompile
    kernels = overrides.pop("kernels", kernels)
    return hotcompile.HOTConfig(kernels=kernels, **overrides)


def parse_overrides(items: Optional[Sequence[str]]) -> dict:
    """``["rank=8", "gx_scale=token", "exclude=head,lm_head"]`` -> HOTConfig keyword arguments."""
    out: dict = {}
    for item in items or ():
        if "=" not in item:
            raise SystemExit(f"--hot expects key=value, got {item!r}")
        k, v = item.split("=", 1)
        if k in ("include", "exclude", "exact_gx"):
            out[k] = tuple(s for s in v.split(",") if s)
        elif v.lower() in ("true", "false"):
            out[k] = v.lower() == "true"
        else:
            try:
                out[k] = int(v)
            except ValueError:
                try:
                    out[k] = float(v)
                except ValueError:
                    out[k] = v
    return out


def parse_variant(text: str) -> dict:
    """``"rank=16,gx_bits=8"`` -> HOTConfig overrides. A comma-separated piece without ``=``
    continues the previous value (``exclude=head,lm_head``)."""
    items: List[str] = []
    for piece in (s.strip() for s in text.split(",")):
        if not piece:
            continue
        if "=" in piece or not items:
            items.append(piece)
        else:
            items[-1] += "," + piece
    return parse_overrides(items)


def split_mode(mode: str) -> Tuple[str, dict]:
    """``"hot[rank=16,gx_bits=8]"`` -> ("hot", {"rank": 16, "gx_bits": 8});
    ``"hot"`` -> ("hot", {})."""
    m = re.fullmatch(r"\s*([A-Za-z0-9_]+)\s*\[(.*)\]\s*", mode)
    if m:
        return m.group(1), parse_variant(m.group(2))
    return mode.strip(), {}


def mode_list(text: str) -> List[str]:
    """Comma list of modes; commas inside ``[...]`` belong to the mode."""
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            if cur.strip():
                out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def compile_model(module: nn.Module, mode: str, hot_kwargs: Optional[dict] = None,
                  compile_mode: Optional[str] = None):
    """(callable, hot backend or None) for a mode; eager modes return the module itself."""
    mode, variant = split_mode(mode)
    compiled, _, _ = MODE_INFO[mode]
    if not compiled:
        return module, None
    kw = {"mode": compile_mode} if compile_mode else {}
    if mode in ("hot", "hot_ref"):
        import hotcompile
        # the mode's own variant (``hot[exclude=]``) wins over the workload's and --hot's keys
        cfg = hot_config("auto" if mode == "hot" else "reference",
                         **{**(hot_kwargs or {}), **variant})
        be = hotcompile.backend(cfg)
        return torch.compile(module, backend=be, **kw), be
    return torch.compile(module, **kw), None


def reset_compile_state() -> None:
    """Forget compiled graphs and LQS choices between in-process runs."""
    torch._dynamo.reset()
    try:
        import hotcompile
        hotcompile.lqs_table.clear()
    except Exception:  # noqa: BLE001
        pass


def hot_summary(be) -> dict:
    """Counts from a HotBackend's report: rewritten sites, failures, saved-x estimate."""
    if be is None:
        return {}
    rep = be.report
    before, after = rep.saved_bytes()
    return {"hot_sites_rewritten": len(rep.rewritten), "hot_sites_total": len(rep.layers),
            "hot_exact_reasons": sorted({r.reason for r in rep.exact if r.reason}),
            "hot_errors": list(rep.errors), "hot_report_saved_x_before": before,
            # which cost table gated the sites (per chip), or why none did
            "hot_cost_models": sorted({r.cost_model for r in rep.layers if r.cost_model}),
            "hot_report_saved_x_after": after,
            "hot_forward": sorted({r.forward for r in rep.rewritten}),
            "hot_forward_fp8": sum(r.forward.startswith("fp8") for r in rep.rewritten),
            # sites whose backward the cost gate kept exact, with the FP8 forward alone
            "hot_forward_fp8_only": sum(r.forward.startswith("fp8") for r in rep.exact),
            "hot_forward_reasons": sorted({r.forward_reason for r in rep.rewritten
                                           if r.forward_reason}),
            # the g_x of rewritten exact_gx sites (the head: exact, or FP8 without HQ), by name
            "hot_gx_not_hq": {r.name: r.gx_path for r in rep.rewritten
                              if r.gx_path.startswith(("exact", "FP8"))},
            # saved_activations="fp8": per graph, what the kept activations became
            "hot_saved_activations": {str(g): d for g, d in rep.saved.items()}}


# ----------------------------------------------------------------------------- saved bytes
class SavedBytes:
    """Sum of distinct non-parameter storages autograd saves for backward during a forward;
    ``first[ptr]`` is (dtype, shape) of the first tensor saved on each storage."""

    def __init__(self, params: Iterable[torch.Tensor]):
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in params}
        self.storages: Dict[int, int] = {}
        self.first: Dict[int, tuple] = {}
        self.count = 0
        self._cm = None

    def _pack(self, t):
        self.count += 1
        try:
            st = t.untyped_storage()
            ptr, nb = st.data_ptr(), st.nbytes()
        except Exception:  # noqa: BLE001 - fake / sparse tensors: count their logical size
            ptr, nb = id(t), t.numel() * t.element_size()
        if ptr not in self.param_ptrs:
            self.storages[ptr] = max(self.storages.get(ptr, 0), nb)
            self.first.setdefault(ptr, (str(t.dtype).replace("torch.", ""), tuple(t.shape)))
        return t

    def __enter__(self):
        self._cm = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._cm.__enter__()
        return self

    def __exit__(self, *exc):
        self._cm.__exit__(*exc)

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())


# ----------------------------------------------------------------------------- models
def _init_linear(m: nn.Module, std: float = 0.02) -> None:
    for mod in m.modules():
        if isinstance(mod, nn.Linear):
            nn.init.normal_(mod.weight, std=std)
            if mod.bias is not None:
                nn.init.zeros_(mod.bias)
        elif isinstance(mod, nn.Embedding):
            nn.init.normal_(mod.weight, std=std)


class Attention(nn.Module):
    def __init__(self, d: int, heads: int, causal: bool):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=self.causal)
        return self.proj(a.transpose(1, 2).reshape(b, t, d))


class Mlp(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm transformer block (GPT-2 / ViT layout: qkv, proj, fc1, fc2)."""

    def __init__(self, d: int, heads: int, causal: bool, mlp_ratio: int = 4):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads, causal)
        self.mlp = Mlp(d, mlp_ratio * d)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """A plain GPT (learned positions, pre-norm, GELU MLP); ``head`` stays exact under HOT."""

    def __init__(self, vocab: int = 256, d: int = 768, layers: int = 8, heads: int = 12,
                 seq: int = 512):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(seq, d))
        self.blocks = nn.ModuleList(Block(d, heads, causal=True) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        _init_linear(self)
        nn.init.normal_(self.pos, std=0.01)
        for blk in self.blocks:     # GPT-2's residual scaling
            nn.init.normal_(blk.attn.proj.weight, std=0.02 / math.sqrt(2 * layers))
            nn.init.normal_(blk.mlp.fc2.weight, std=0.02 / math.sqrt(2 * layers))

    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


class ViT(nn.Module):
    """A plain ViT: linear patch embedding, class token, learned positions, pre-norm blocks."""

    def __init__(self, img: int = 32, patch: int = 4, chans: int = 1, classes: int = 10,
                 d: int = 256, layers: int = 6, heads: int = 8, mlp_ratio: int = 4):
        super().__init__()
        self.patch = patch
        n = (img // patch) ** 2
        self.patch_embed = nn.Linear(chans * patch * patch, d)
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        self.pos = nn.Parameter(torch.zeros(1, n + 1, d))
        self.blocks = nn.ModuleList(Block(d, heads, causal=False, mlp_ratio=mlp_ratio)
                                    for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)
        _init_linear(self)
        nn.init.normal_(self.pos, std=0.02)
        nn.init.normal_(self.cls, std=0.02)

    def forward(self, x):
        b, c, h, w = x.shape
        p = self.patch
        x = x.unfold(2, p, p).unfold(3, p, p)                      # b c h/p w/p p p
        x = x.permute(0, 2, 3, 1, 4, 5).reshape(b, (h // p) * (w // p), c * p * p)
        x = self.patch_embed(x)
        x = torch.cat([self.cls.expand(b, -1, -1), x], dim=1) + self.pos
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x)[:, 0])


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) \
            * self.weight


def _rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class LlamaBlock(nn.Module):
    """Llama decoder layer: RMSNorm, rotary MHA (q/k/v/o_proj), SwiGLU (gate/up/down_proj)."""

    def __init__(self, d: int, heads: int, hidden: int):
        super().__init__()
        self.heads = heads
        self.input_layernorm = RMSNorm(d)
        self.post_attention_layernorm = RMSNorm(d)
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)
        self.gate_proj = nn.Linear(d, hidden, bias=False)
        self.up_proj = nn.Linear(d, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d, bias=False)

    def forward(self, x, cos, sin):
        b, t, d = x.shape
        h = self.input_layernorm(x)
        q, k, v = (p(h).view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, t, d))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Llama(nn.Module):
    """A Llama-style causal LM (used when transformers is not installed)."""

    def __init__(self, vocab: int = 32000, d: int = 4096, layers: int = 2, heads: int = 32,
                 hidden: int = 11008, seq: int = 2048, theta: float = 10000.0):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(LlamaBlock(d, heads, hidden) for _ in range(layers))
        self.norm = RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        hd = d // heads
        inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
        ang = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
        ang = torch.cat((ang, ang), dim=-1)
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)
        _init_linear(self)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.embed_tokens(idx)
        cos, sin = self.cos[:t].to(x.dtype), self.sin[:t].to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


class LMLoss(nn.Module):
    """Wraps a causal LM (a module or a transformers model) so forward returns the loss; an
    encoder's masked-LM head (BERT) is scored the same way, on every position (a benchmark's
    loss: the step's work is the model's whatever the targets)."""

    def __init__(self, model: nn.Module, hf: bool = False, cache: bool = True):
        super().__init__()
        self.model, self.hf = model, hf
        self.kw = {"use_cache": False} if cache else {}    # an encoder (BERT) has no cache

    def forward(self, idx, targets):
        if self.hf:
            logits = self.model(input_ids=idx, **self.kw).logits
        else:
            logits = self.model(idx)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class ClsLoss(nn.Module):
    """Wraps a classifier so forward returns the cross-entropy loss."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x, y):
        return F.cross_entropy(self.model(x).float(), y)


def is_linear_site(mod: nn.Module) -> bool:
    """nn.Linear, or a transformers Conv1D (GPT-2: the same GEMM with W stored (in, out))."""
    if isinstance(mod, nn.Linear):
        return True
    w = getattr(mod, "weight", None)
    return type(mod).__name__ == "Conv1D" and isinstance(w, torch.Tensor) and w.dim() == 2


def count_params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


# ----------------------------------------------------------------------------- data
def stdlib_sources(val_every: int = 10):
    """(train files, validation files) of the stdlib's own ``.py`` sources, split by file.

    Deterministic: a file goes to validation when crc32 of its path relative to the
    stdlib root is divisible by ``val_every``. site-/dist-packages are left out.
    """
    import sysconfig
    import zlib
    root = sysconfig.get_paths()["stdlib"]
    train, val = [], []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames
                             if d not in ("site-packages", "dist-packages", "__pycache__"))
        for f in sorted(filenames):
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, root)
                (val if zlib.crc32(rel.encode()) % val_every == 0 else train).append(path)
    return root, train, val


def read_bytes(paths: Sequence[str], limit: Optional[int] = None) -> torch.Tensor:
    chunks, total = [], 0
    for p in paths:
        with open(p, "rb") as f:
            b = f.read()
        chunks.append(b + b"\n")
        total += len(b) + 1
        if limit and total >= limit:
            break
    data = b"".join(chunks)
    if limit:
        data = data[:limit]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


WORD_VOCAB = 32000
_WORD_RE = re.compile(rb"[A-Za-z_][A-Za-z0-9_]*|[0-9]+|[ \t]+|\n|[^A-Za-z0-9_\s]")


def word_tokens(train_paths: Sequence[str], val_paths: Sequence[str], vocab: int = WORD_VOCAB,
                limit: Optional[int] = None):
    """(train ids, validation ids, vocabulary size) of source files as word-level tokens:
    identifiers, digit runs, runs of spaces/tabs, newlines and single other characters. The
    vocabulary is the ``vocab - 1`` most frequent tokens of the training files (ties by
    bytes: deterministic) plus one unknown token (id ``vocab - 1``). ``limit``: bytes read
    from the training files (a tenth from the validation files), as ``read_bytes``.

    Why: a byte-level LM's head has 256 outputs; Llama's has 32000, and a large head's
    gradient is mostly tiny logit gradients, a different regime for its quantizers."""
    from collections import Counter
    train = _WORD_RE.findall(read_bytes(train_paths, limit).numpy().tobytes())
    val = _WORD_RE.findall(read_bytes(val_paths, limit // 10 if limit else None).numpy().tobytes())
    counts = Counter(train)
    kept = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:vocab - 1]
    ids = {tok: i for i, (tok, _) in enumerate(kept)}
    unk = vocab - 1

    def encode(toks):
        return torch.tensor([ids.get(t, unk) for t in toks], dtype=torch.int32)
    return encode(train), encode(val), vocab


def load_digits_images(size: int = 32, seed: int = 0):
    """scikit-learn's bundled digits, upsampled to ``size``x``size``, normalized, 80/20 split."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:
        raise RuntimeError("scikit-learn is not installed (pip install -e '.[bench]')") from e
    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    y = torch.tensor(d.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_train = int(0.8 * len(y))
    tr, te = perm[:n_train], perm[n_train:]
    mean, std = x[tr].mean(), x[tr].std()
    x = (x - mean) / std
    return x[tr], y[tr], x[te], y[te]


# ----------------------------------------------------------------------------- reporting
def fmt(v, digits: int = 2, unit: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v}{unit}"
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        if v != 0 and (abs(v) >= 1e5 or abs(v) < 10 ** -digits):
            return f"{v:.{digits}e}{unit}"
        return f"{v:.{digits}f}{unit}"
    return str(v)


def md_table(header: Sequence[str], rows: Iterable[Sequence]) -> str:
    rows = [[str(c) for c in r] for r in rows]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
    return "\n".join(lines)


def text_table(header: Sequence[str], rows: Iterable[Sequence]) -> str:
    rows = [list(map(str, header))] + [[str(c) for c in r] for r in rows]
    w = [max(len(r[i]) for r in rows) for i in range(len(header))]
    out = ["  ".join(c.ljust(w[i]) for i, c in enumerate(r)).rstrip() for r in rows]
    out.insert(1, "  ".join("-" * x for x in w))
    return "\n".join(out)


def update_docs_section(tag: str, title: str, body: str, path: str = DOCS_FILE) -> str:
    """Replace the text between ``<!-- tag:begin -->`` and ``<!-- tag:end -->`` in ``path``.

    Only that span changes; the rest of the file (other engineers' sections) is kept
    byte for byte. A missing file or missing markers: the section is appended.
    """
    begin, end = f"<!-- {tag}:begin -->", f"<!-- {tag}:end -->"
    block = f"{begin}\n{body.rstrip()}\n{end}"
    text = ""
    if os.path.exists(path):
        with open(path) as f:
            text = f.read()
    i, j = text.find(begin), text.find(end)
    if i >= 0 and j > i:
        new = text[:i] + block + text[j + len(end):]
    else:
        if not text:
            text = "# Benchmarks\n\nLatest device figures. Each section is written by the " \
                   "script named in its heading.\n"
        new = text.rstrip("\n") + f"\n\n## {title}\n\n{block}\n"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(new)
    os.replace(tmp, path)
    return path


def latest_results(paths: Sequence[str], prefix: str) -> List[str]:
    """Expand directories into their newest ``<prefix>_*.json`` file; keep files as given."""
    out = []
    for p in paths:
        if os.path.isdir(p):
            cands = sorted(f for f in os.listdir(p)
                           if f.startswith(prefix + "_") and f.endswith(".json"))
            if cands:
                out.append(os.path.join(p, max(cands, key=lambda f: os.path.getmtime(
                    os.path.join(p, f)))))
        elif os.path.exists(p):
            out.append(p)
    return out


def load_results(paths: Sequence[str], prefix: str):
    """(files, parsed JSON results) for ``--docs-only``: see ``latest_results``."""
    files = latest_results(paths, prefix)
    if not files:
        raise SystemExit(f"no {prefix}_*.json found in {list(paths)}")
    results = []
    for f in files:
        with open(f) as fh:
            results.append(json.load(fh))
    return files, results


def have_matplotlib() -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot  # noqa: F401
        return True
    except Exception:  # noqa: BLE001
        return False


def log(msg: str) -> None:
    print(msg, flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description="The package's code digest (result files' "
                                 "'git' field), or the commits that have a given one.")
    ap.add_argument("--which", metavar="DIGEST", help="list the commits with this digest")
    ap.add_argument("--limit", type=int, default=200, help="commits to search from HEAD")
    a = ap.parse_args()
    print(" ".join(commits_with_code(a.which, a.limit)) if a.which else code_digest())
