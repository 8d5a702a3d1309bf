"""HOTConfig: the one place every knob of the backend lives.

Frozen and validated on construction, so a bad value fails where it is written
(a ValueError naming the field) rather than deep inside a compile.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Optional, Tuple, Union

from .kernels.formats import GW_FORMATS as _GW_FORMATS
from .kernels.fp8_forward import FORWARDS as _FORWARDS
from .kernels.saved_fp8 import FORMATS as _SAVED_FORMATS

_KERNELS = ("auto", "triton", "reference")
_GX_SCALES = ("lqs", "token", "tensor")
_EXACT_GX_GEMMS = ("bf16", "e4m3")


@dataclasses.dataclass(frozen=True)
class HOTConfig:
    """Configuration of the HOT backward.

    rank / block: HLA keeps ``rank`` of every ``block`` Hadamard coefficients along the
    tokens of one sequence. ``rank="auto"`` runs full rank for ``rank_calibration_start``
    steps, then measures, per site, on the real gradients of the next
    ``rank_calibration_steps`` backward passes, g_W's relative error at every rank
    against full rank and keeps the smallest rank within ``rank_tolerance`` (one recompile
    per graph when the choice is made). Why not from step 0: at initialisation the
    gradients are nearly constant over tokens (a byte-level GPT measures r=1..2 within
    10%), so a choice made there is wrong once the model learns what varies along the
    sequence (the same run ends at val loss 2.74 against 0.91). Not the default: even
    after the warm-up it keeps r=13..15 on some text sites, and the byte-level GPT ends
    +11% (docs/BENCHMARKS.md); a one-step error tolerance does not predict the final loss. A site whose sequence layout the pass cannot prove
    gets full rank whatever ``rank`` says (blocks must hold neighbouring tokens).
    gx_bits: bits of the output gradient g_y on the g_x path (HQ); gx_w_bits: bits of the
    weight operand there. gw_bits: bits of the g_W path (HLA) and of ABC.
    gx_scale: ``token`` (default), ``tensor``, or ``lqs`` (the paper's per-layer choice,
    calibrated on real gradients: per-token iff its error < ``lqs_ratio`` x per-tensor's).
    Why ``token`` by default: on these kernels per-token scaling is both the cheaper path
    (one read of g_y; per-tensor needs a global max first) and the more accurate one
    (ViT-B/16, H100: median g_x cosine 0.90 vs 0.19 when LQS picks per-tensor), so the
    paper's reason to fall back to per-tensor (a cheaper kernel) does not hold here.
    gw_format: the g_W path's operands: ``e4m3`` (scaled FP8 on cuBLAS, g's coefficients
    stochastically rounded onto the e4m3 grid, x saved in e4m3), ``int8`` (``gw_bits``
    levels, the INT8 Triton GEMM), or ``auto`` (default): e4m3 on CUDA devices with FP8
    tensor cores, int8 elsewhere (``kernels.formats.gw_rule`` has the measurements).
    forward: the forward GEMM of a site HOT rewrites, or whose backward the cost gate keeps
    exact (the forward is gated on its own: ViT-L/16 bs128's qkv, backward predicted 0.83x,
    forward 1.26x): ``auto`` (default: ``fp8_rowwise`` for a
    bf16 forward on a Hopper GPU, ``bf16`` elsewhere: CPU, fp32 or fp16 forwards, other
    chips), ``bf16`` (as Inductor compiles it), ``fp8`` (tensor-wise scaled e4m3 operands on
    ``torch._scaled_mm``, the casts Inductor-fused aten ops: ``kernels/fp8_forward.py``) or
    ``fp8_rowwise`` (a scale per token and per output feature; bf16 forwards only), where
    the forward cost gate predicts it faster and the GPU has FP8 tensor cores; the report
    says per site. Why ``auto`` takes the row-wise FP8 forward on Hopper: Llama d4096 1.32x
    Inductor against 1.17x with a bf16 forward (H200), and the byte- and word-level GPT
    gates passed pooled (+0.49%, s.e. 0.50, over 7 seeds; +0.27%, s.e. 0.26, over 6)
    (docs/BENCHMARKS.md, 36th and 37th stops). A site with an exact backward and an FP8
    forward since the sixty-second stop: ViT-B/16 bs128 1.052x Inductor against 1.025x
    with such sites kept bf16 (its 24 qkv and fc1 sites), ViT-L/16 bs128 +0.9%, BERT-base
    1.021x Inductor (24 sites, no backward rewritten), GPT-2's 24 c_fc and c_proj sites
    +0.4% (c_proj's x from GELU's kernel, tanh's GELU since the sixty-third stop; H200,
    paired). In-features must be multiples of 16 (cuBLAS's FP8 layout); out-features
    need not where the site's backward stays exact (an LM head's vocabulary: GPT-2's
    50257): W is padded with zero rows and the output is a strided view of the GEMM's
    first O columns, where the pass proves every reader takes it (not where the compiled
    function returns it: ``passes/strided_output.py``); GPT-2 1.030x Inductor with its
    head so, 1.015x without, in one process (64th stop). ``min_speedup=0`` turns the forward's gate
    off too: under ``auto`` every aligned site on Hopper then takes the FP8 forward
    (``forward="bf16"`` keeps Inductor's).
    kernels: ``auto`` = fused Triton on CUDA, reference torch elsewhere.
    include / exclude: layer names to restrict / skip: a name as the compiled module's
    ``named_modules()`` gives it (``blocks.0.fc2``), one dotted component of it (``head``),
    or an ``fnmatch`` glob of the full name (``blocks.*.fc2``). A layer is named after the
    module you compiled, whatever the graph breaks; a weight that is not a module's
    ``weight`` is named after the parameter (``self_attn.in_proj`` for ``in_proj_weight``),
    and a row slice of one after its rows (``self_attn.in_proj[0:64]``, matched by
    ``self_attn.in_proj`` too). Decided per compiled graph: where Dynamo reuses one graph
    for several modules (a graph break inside repeated blocks), the first one's names
    decide, and the report says so.
    exact_gx: layers (named as for ``exclude``) whose g_x stays exact: only their g_W (HLA)
    and the saved activation (ABC) are HOT's. The default names the output head, whose g_x
    carries the loss's gradient to every layer below it: HOT on the whole head failed the
    byte-level GPT gate (+3.20%), its g_W alone passed it at 4 seeds (+0.53%) and a
    32000-token word-level GPT at 3 seeds (-0.02%) (docs/BENCHMARKS.md). A layer named in
    both ``exclude`` and ``exact_gx`` stays exact; like every site, the head is rewritten
    only where the cost gate predicts it faster (Llama's 4096 -> 32000 head yes, GPT-2's
    768 -> 50257 and ViT's heads no).
    exact_gx_gemm: the g_x GEMM of the layers named in ``exact_gx``: ``bf16`` (default: as
    Inductor compiles it) or ``e4m3``: no Hadamard and no 4-bit levels, but g stochastically
    rounded to e4m3 with a scale per token (unbiased; written by the per-token kernel,
    whose read of g also gives the HLA operand's bound), W^T rounded to e4m3 per column,
    the FP8 GEMM with fp32 accumulation (``reference.e4m3_gx_backward``), where the GPU and
    shapes allow it (``formats.e4m3_gx_fused``) and the cost gate predicts the site faster
    with it than exact and than with its g_W alone beside a bf16 g_x (else its g_W alone
    is HOT's, where that pays; the report says per site). Not the default: beside the FP8
    forward it made Llama d4096 1.339x Inductor against 1.324x without it and torchao's
    1.328x (H200, one call), but the byte-level GPT's final loss read +1.31% (s.e. 0.52)
    over Inductor's across 6 seeds, against +0.49% (0.50) for the FP8 forward alone
    (docs/BENCHMARKS.md, 36th stop).
    min_features: a linear with in- or out-features below this stays exact (too small to win).
    min_speedup: the cost gate (``passes/cost.py``): on a GPU, a site's backward is rewritten
    only when its predicted exact backward time is at least this multiple of HOT's, and its
    forward GEMM put on FP8 only when bf16's predicted time is at least this multiple of
    FP8's, each decided alone (1.0: never slower; 0: gate off, every eligible site
    rewritten for HOT's memory savings; the forward's FP8 gate is off then too, so under
    the default ``forward="auto"`` every aligned site on Hopper takes the FP8 forward). CPU
    runs the reference kernels and is not gated.
    abc: save the compressed activation instead of x (False: compress in backward).
    recompute_operands: let backward rebuild, instead of keeping, the operands of HOT's
    backward that are pointwise functions of tensors it keeps anyway (``passes/
    recompute.py``): a linear's input after a LayerNorm, RMSNorm, GELU or SwiGLU (no
    compressed copy is saved; the compression runs in backward) and autocast's bf16 copy
    of W (rebuilt from the fp32 parameter). Bit-identical gradients, less memory
    (``bench/saved_tensors.py``), one more pointwise pass in backward: off by default
    until its device timing is measured.
    saved_activations: ``auto`` (default), ``exact``, ``bf16``, ``fp8`` or ``fp8_all``: the
    activations Inductor's partitioner keeps for backward, other than HOT's own buffers,
    kept narrower (``passes/saved.py`` says which: a LayerNorm's input or x_hat, a GELU's,
    an exact layer's input; never attention's, a log-softmax's or a weight's). ``bf16``:
    fp32 ones as bf16 (an error of 2^-9 RMS, 2^-8 at most, of t - m, m the mean of the row or
    of its block). ``fp8``: bf16 / fp16 ones as e4m3 rows with an fp32 scale (and the row
    mean) each (a row over 1024 wide in blocks), fp32 ones as bf16;
    a kept tensor that is a pointwise function of another compressed one (GELU's output
    beside its input) is rebuilt from that one's restoration in backward, not kept.
    ``fp8_all``: fp32 ones as e4m3 rows too (error 2^-4: it failed the byte-level GPT gate
    beside the FP8 forward). Less memory
    (issue 12: a ViT-B/16 step's peak), for every model, whatever the cost gate decides.
    ``auto``: ``bf16`` in a graph that computes in bf16 or fp16 (autocast, a half-precision
    model), except a tensor whose rows it would centre in blocks (over 1024 wide and not
    reduced by a norm: ViT-H/14's LayerNorm output; narrowed, its first 8 blocks ran 0.960x
    Inductor with no site rewritten, kept, ViT-H bs64 1.045x under the default, fifty-ninth
    stop), ``exact`` in an fp32 one, whose user has not asked for bf16
    anywhere. Why
    ``bf16`` by default there: the same speed as Inductor (1.000-1.009x on ViT-B and GPT-2;
    on Llama equal to ``exact`` within noise), 0.93x the peak on ViT-B and GPT-2, and it
    passed the gates alone (byte-level GPT -0.15% over 5 seeds, digits 0.19 point;
    docs/BENCHMARKS.md, 28th and 29th stops). ``fp8``
    stays opt-in: 0.67-0.70x the peak at 0.96x the speed.
    splice: on a GPU, copy each HOT op's fused kernels into the graph (``passes/splice.py``)
    so Inductor launches them from its own wrapper, with no Python between kernels (True);
    False keeps them behind ``hot::`` custom ops (one profiler range per op: debugging).
    Ops whose choices are made at run time (``gx_scale="lqs"``, ``rank="auto"`` while it
    calibrates, dynamic shapes) stay ops either way; the report's ``launch`` says per site.
    lqs_*: calibration steps, per-token threshold ratio, re-calibration period (0 = never),
    and a JSON file to load/save the choices so a restarted run reuses them.
    dump_dir: write graphs and reports here (env ``HOT_DUMP`` does the same).
    """

    rank: Union[int, str] = 16
    block: int = 16
    gx_bits: int = 4
    gx_w_bits: int = 8
    gw_bits: int = 8
    gx_scale: str = "token"
    gw_format: str = "auto"
    forward: str = "auto"
    rank_tolerance: float = 0.1
    rank_calibration_steps: int = 2
    rank_calibration_start: int = 100
    kernels: str = "auto"
    include: Optional[Tuple[str, ...]] = None
    exclude: Tuple[str, ...] = ()
    exact_gx: Tuple[str, ...] = ("head", "lm_head")
    exact_gx_gemm: str = "bf16"
    min_features: int = 256
    min_speedup: float = 1.0
    abc: bool = True
    recompute_operands: bool = False
    saved_activations: str = "auto"
    splice: bool = True
    lqs_calibration_steps: int = 3
    lqs_ratio: float = 0.5
    lqs_recalibrate_every: int = 0
    lqs_file: Optional[str] = None
    dump_dir: Optional[str] = None

    def __post_init__(self):
        def bad(field, msg):
            raise ValueError(f"HOTConfig.{field}: {msg} (got {getattr(self, field)!r})")

        if self.rank != "auto" and (isinstance(self.rank, bool) or not isinstance(self.rank, int)):
            bad("rank", "must be an int or 'auto'")
        for f in ("block", "gx_bits", "gx_w_bits", "gw_bits", "min_features",
                  "lqs_calibration_steps", "lqs_recalibrate_every", "rank_calibration_steps",
                  "rank_calibration_start"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int):
                bad(f, "must be an int")
        if self.block < 2 or self.block & (self.block - 1):
            bad("block", "must be a power of two >= 2")
        if self.rank != "auto" and not 1 <= self.rank <= self.block:
            bad("rank", f"must be 'auto' or satisfy 1 <= rank <= block ({self.block})")
        for f in ("gx_bits", "gx_w_bits", "gw_bits"):
            if getattr(self, f) not in (4, 8):
                bad(f, "must be 4 or 8")
        if self.gx_scale not in _GX_SCALES:
            bad("gx_scale", f"must be one of {_GX_SCALES}")
        if (isinstance(self.rank_tolerance, bool) or not isinstance(self.rank_tolerance, (int, float))
                or not 0 < self.rank_tolerance < 1):
            bad("rank_tolerance", "must be a number in (0, 1)")
        if self.rank_calibration_steps < 1:
            bad("rank_calibration_steps", "must be >= 1")
        if self.rank_calibration_start < 0:
            bad("rank_calibration_start", "must be >= 0")
        if self.gw_format not in _GW_FORMATS:
            bad("gw_format", f"must be one of {_GW_FORMATS}")
        if self.saved_activations not in _SAVED_FORMATS:
            bad("saved_activations", f"must be one of {_SAVED_FORMATS}")
        if self.forward not in _FORWARDS:
            bad("forward", f"must be one of {_FORWARDS}")
        if self.exact_gx_gemm not in _EXACT_GX_GEMMS:
            bad("exact_gx_gemm", f"must be one of {_EXACT_GX_GEMMS}")
        if self.kernels not in _KERNELS:
            bad("kernels", f"must be one of {_KERNELS}")
        for f in ("include", "exclude", "exact_gx"):
            v = getattr(self, f)
            if v is None and f == "include":
                continue
            if (v is None or isinstance(v, str) or not hasattr(v, "__iter__")
                    or not all(isinstance(s, str) for s in v)):
                bad(f, "must be a tuple of strings" + (" or None (every layer)" if f == "include"
                                                      else " (use () for none)"))
            object.__setattr__(self, f, tuple(v))
        if self.min_features < 0:
            bad("min_features", "must be >= 0")
        if (isinstance(self.min_speedup, bool) or not isinstance(self.min_speedup, (int, float))
                or not 0 <= self.min_speedup < float("inf")):
            bad("min_speedup", "must be a finite number >= 0 (0 turns the cost gate off)")
        for f in ("abc", "recompute_operands", "splice"):
            if not isinstance(getattr(self, f), bool):
                bad(f, "must be a bool")
        if self.lqs_calibration_steps < 1:
            bad("lqs_calibration_steps", "must be >= 1")
        if self.lqs_recalibrate_every < 0:
            bad("lqs_recalibrate_every", "must be >= 0 (0 = never)")
        if not (isinstance(self.lqs_ratio, (int, float)) and 0 < self.lqs_ratio):
            bad("lqs_ratio", "must be a positive number")
        if self.dump_dir is None and os.environ.get("HOT_DUMP"):
            object.__setattr__(self, "dump_dir", os.environ["HOT_DUMP"])
        for f in ("dump_dir", "lqs_file"):
            v = getattr(self, f)
            if v is not None:
                if not isinstance(v, (str, os.PathLike)) or not str(v):
                    bad(f, "must be a path (str or os.PathLike) or None")
                object.__setattr__(self, f, os.fspath(v))
        if self.kernels == "triton":
            self._check_triton_usable()

    def _check_triton_usable(self) -> None:
        """``kernels="triton"`` needs triton and a CUDA device (or ``TRITON_INTERPRET=1``):
        an impossible choice fails here, not at the first forward."""
        try:
            import triton  # noqa: F401
        except ImportError as e:
            raise ValueError("HOTConfig.kernels: 'triton' but triton is not importable") from e
        import torch
        if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("HOTConfig.kernels: 'triton' needs a CUDA device (or "
                             "TRITON_INTERPRET=1 to run the kernels on CPU); use 'auto'")

    @classmethod
    def paper(cls, **overrides) -> "HOTConfig":
        """The HOT paper's settings: HLA r=8 of 16 tokens, 4-bit g_y and W on the g_x path,
        LQS choosing the g_x scaling per layer, the forward left as it is (bf16). Not the
        default: r=8 breaks text models and the 4-bit W operand is the whole of g_x's bias
        (docs/BENCHMARKS.md)."""
        kw = dict(rank=8, gx_bits=4, gx_w_bits=4, gw_bits=8, gx_scale="lqs", forward="bf16")
        kw.update(overrides)
        return cls(**kw)

    @property
    def auto_rank(self) -> bool:
        return self.rank == "auto"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def digest(self) -> str:
        """A stable hash of the config, for cache keys and dump names."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True,
                                         default=str).encode()).hexdigest()[:12]
