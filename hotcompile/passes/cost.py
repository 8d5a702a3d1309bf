"""The cost gate: predicted backward time of a linear site, exact vs HOT, per shape.

Why: HOT pays memory-bound passes over g_y, W and x (Hadamard + quantize, transposes) and,
in default compile mode, the host time of its ops, to make two GEMMs cheaper. At ViT-B
sizes that costs more than the GEMMs save (H100: a fc1 backward 0.48 ms with HOT vs
0.17 ms in bf16); at Llama d4096 sizes it wins (fc1 5.1 vs 6.1 ms). ``backend="hot"`` must not
slow a model down, so a site is rewritten only when the model predicts
``exact / hot >= HOTConfig.min_speedup``.

The model: every kernel of a site is ``t = fixed + work / rate`` with ``work`` the bytes a
transform kernel moves or the FLOPs of a GEMM, one (fixed, slope) pair per kernel, fitted
by ``bench/fit_cost.py`` on the per-kernel timings of a ``bench/layers.py`` run (11 shapes
of ViT-B, GPT d4096 and Llama d4096 layers). Against the run's CUDA-graph replays of whole
backwards it over-estimates HOT by 5-8% at GPT and Llama d4096, and it never
under-estimates HOT by more than 10% (the fit raises the fixed costs until it does not:
the gate errs towards exact; at ViT-B sizes, where HOT measured 1.4-2.2x slower, it is
off by -10..+5%). In default compile mode each HOT site also costs host
time (Python dispatch of its ops, Triton's launcher for ~12 kernels) that the GPU cannot
hide when the site's GPU work is shorter: there the prediction is
``max(gpu, host)``; under CUDA graphs (``reduce-overhead``) only the GPU time counts.
Where the spliced path will own autocast's cast of the site's weight (``weight_cast.py``:
an fp32 parameter under autocast, both gradients HOT, g_x on the FP8 GEMM), W is priced as
it runs in the model, not as ``bench/layers.py`` times it on a bf16 weight: the exact
backward re-casts the fp32 parameter (the partitioner recomputes autocast's cast rather than
keep the bf16 copy), HOT's backward reads a W operand written in the forward by one read of
the copy, a launch serving up to 8 weights (``STEP_KERNELS``); that read also writes the
FP8 forward's W, so the forward's gate charges no cast of W there. And where the site's forward
stays bf16 (``forward.forward_plan``), ABC's e4m3 scale needs max |x| from a reduction of its
own, which ``abc_x``'s line (timed with the bound given) leaves out: at ViT-B bs192's fc2
that reduction cost 0.16 ms a site and made the site a loss the table called a gain.
Where GELU's kernel writes the FP8 forward's cast of x (``hot::gelu_e4m3``), the forward
is charged that kernel's time over GELU's, not a cast reading x again: priced as a second
pass, ViT-L/16 bs128's fc2 forwards stayed bf16, so their backwards paid ABC's own bound and
stayed exact (1.053x Inductor; 1.094x rewritten, sixty-first stop).
Both GEMMs are modelled on the paths the site will take (``gx_gemm_kernel``,
``gw_gemm_kernel``). The g_x GEMM: cuBLAS FP8 for bf16 g_y with per-token scales, the INT8
kernel otherwise (fp32 training, per-tensor or LQS scales). The g_W GEMM: cuBLAS FP8 where
the saved activation is e4m3 (``formats.gw_rule``), else the INT8 kernel.

One table per chip, picked by the device's name (``model_for``): the H100's and the H200's
(same arithmetic, 1.4x the memory bandwidth: HOT's memory-bound kernels run faster, but
not 1.4x faster, and their fixed costs weigh more; the H100 table under-estimated ViT-B
proj's HOT backward on an H200 by 22%, which errs towards HOT). Other CUDA devices use the
H100 table (the report names the table). CPU has no model (the reference kernels are not a
performance path) and is not gated.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

import torch

from ..kernels.formats import gw_rule, gx_rule
from ..kernels.ops import ONE_PASS_MAX_RANK

# one entry per kernel of a HOT site, plus the two bf16 GEMMs of the exact backward
KERNELS = ("grad_out", "hq_g_token", "hq_w", "hq_w_fp32", "hq_cublas", "hq_int8", "hla_g",
           "hla_int8", "hla_cublas", "abc_x", "gx_bf16", "gw_bf16",
           "fwd_cast_x", "fwd_cast_w", "fwd_fp8", "fwd_bf16")


# kernels without a fitted line of their own, timed by a kernel that moves bytes alike: the
# rebuild of a layer input in backward (``recompute_operands``: an Inductor pointwise
# kernel) by the FP8 forward's Inductor-fused cast of x. An estimate, not fitted: no device
# run has timed it alone.
SAME_LINE = {"rebuild_x": "fwd_cast_x"}

# lines not fitted by bench/fit_cost.py on isolated layers, measured in a model's step or on
# one kernel: a weight whose autocast cast HOT owns (``weight_cast.py``). ``w_recast``: the exact
# backward's cast of the fp32 parameter to bf16 (4 bytes read, 2 written an element), which
# the partitioner recomputes there rather than keep the copy; ``hq_w_owned``: HQ's W operand
# as the forward's ``_weight_operands_kernel`` writes it (the bf16 copy read, HQ's and the
# FP8 forward's e4m3 written: 4 bytes an element, both writes charged to the backward) plus
# ``_weight_cast_kernel``'s cost over the forward cast it replaces (its maxima). The exact
# step's forward cast and HOT's copy cancel. ``abc_bound``: max |x| for ABC's e4m3 scale
# where no FP8 forward cast of x gives it: a reduction Inductor compiles over x (2 bytes an
# element read), which ``abc_x``'s line (timed with the bound given) leaves out.
# ``fwd_cast_x_gelu``: the FP8 forward's row-wise cast of an x that GELU makes, where
# ``hot::gelu_e4m3`` writes it beside GELU's output (``forward._gelu_producer``): that
# kernel's time over GELU's alone, per element of x (its e4m3 levels written); the
# ``fwd_cast_x`` line (a cast reading x) prices it 2.5-4x too high.
STEP_KERNELS = ("hq_w_owned", "w_recast", "abc_bound", "fwd_cast_x_gelu")


def site_kernels(gx: bool, gw: bool, rank: int = 16, gx_gemm: str = "hq_cublas",
                 gw_gemm: str = "hla_int8", w_fp32: bool = False, rebuild_x: bool = False,
                 gx_e4m3: bool = False, w_owned: bool = False) -> tuple:
    """The kernels of a site's HOT backward (``abc_x``: its share of the forward's ABC,
    which writes the saved x K-major, as the g_W GEMM reads it; ``hla_g``: g's HLA operand,
    written K-major).
    Both gradients: one ``hot::linear_backward``, whose g_y operands come from one kernel
    pair up to ``ONE_PASS_MAX_RANK`` (int8 saved activations only); one of them:
    ``hq_grad_input`` or ``hla_grad_weight`` alone. ``gx_gemm`` / ``gw_gemm``: the GEMMs'
    paths (``gx_gemm_kernel``, ``gw_gemm_kernel``). ``recompute_operands``: ``w_fp32``, HQ's
    W kernel reads the fp32 parameter; ``rebuild_x``, backward rebuilds x first.
    ``w_owned``: HQ's W operand comes from the forward's W kernel (``hq_w_owned``, for a
    site whose weight cast HOT owns: ``STEP_KERNELS``).
    ``gx_e4m3`` (an exact_gx site under ``exact_gx_gemm="e4m3"``, ``gx`` False): its g_x on
    FP8 without HQ, priced on HQ's lines, whose kernels it runs: the per-token kernel
    writing g's e4m3 copy (``hadamard.grad_e4m3``), the W kernel writing the plain operand
    and the row-wise cuBLAS FP8 GEMM. Not fitted on its own: the head's timings
    (``bench/head_gx_gemm.py``, H200, 8192 x 32000 -> 4096) put the copy at 0.395 ms and
    the W kernel at 0.151 ms, beside HQ g's 0.0405 ms at 8192 x 4096 (g 8x smaller)."""
    hq_w = "hq_w_fp32" if w_fp32 else "hq_w_owned" if w_owned else "hq_w"
    if gx_e4m3 and not gx:
        return ("hq_g_token", hq_w, "hq_cublas") + site_kernels(False, gw, rank, gx_gemm,
                                                                gw_gemm, w_fp32, rebuild_x)
    extra = ("rebuild_x",) if rebuild_x and gw else ()
    if gx and gw and rank <= ONE_PASS_MAX_RANK and gw_gemm == "hla_int8":
        return ("grad_out", hq_w, gx_gemm, "hla_int8", "abc_x") + extra
    return ((("hq_g_token", hq_w, gx_gemm) if gx else ())
            + (("hla_g", gw_gemm, "abc_x") if gw else ()) + extra)


def gx_gemm_kernel(config, g: torch.Tensor, n: int) -> str:
    """The table key of a site's g_x GEMM: the path ``formats.gx_rule`` will take at run time
    for this g_y (dtype, device) and config, without the ``HOT_GEMM_FORMAT`` experiment
    override. cuBLAS FP8 needs per-token scales: ``gx_scale="lqs"`` may pick per-tensor on
    a site, so it is predicted on the slower INT8 kernel (the gate errs towards exact). A
    non-CUDA device (a test's stand-in) is taken as an H100, the table's device."""
    path = gx_rule(config.gx_bits, config.gx_w_bits, config.gx_scale == "token", g.dtype, n,
                   _capability(g), None)
    return "hq_cublas" if path == "cublas_fp8" else "hq_int8"


def gw_gemm_kernel(config, g: torch.Tensor, dims: tuple = ()) -> str:
    """The table key of a site's g_W GEMM: the format ``formats.gw_rule`` fixes for this
    device and the site's (I, O) (a non-CUDA stand-in is taken as an H100, the table's
    device)."""
    fmt = gw_rule(config.gw_format, "cuda", _capability(g), dims)
    return "hla_cublas" if fmt == "e4m3" else "hla_int8"


def _capability(g: torch.Tensor) -> tuple:
    """g's CUDA compute capability; an H100's (9, 0) for a non-CUDA stand-in."""
    return torch.cuda.get_device_capability(g.device) if g.device.type == "cuda" else (9, 0)


def work(kernel: str, L: int, I: int, O: int, rank: int, block: int) -> float:
    """Bytes (transform kernels) or FLOPs (GEMMs) of one kernel at shape (L, I, O)."""
    o_pad = -(-O // 16) * 16
    lr = -(-L // block) * rank                       # tokens kept by HLA
    return {
        "grad_out": 2 * L * O + L * o_pad + lr * O,  # g_y in, both operands out
        "hq_g_token": 2 * L * O + L * o_pad,         # g_y bf16 in, levels out
        "hq_w": 2 * O * I + I * o_pad,
        "hq_w_fp32": 4 * O * I + I * o_pad,
        "hq_w_owned": 4 * O * I,                     # copy in, HQ's and the forward's e4m3 out
        "w_recast": 6 * O * I,                       # fp32 parameter in, bf16 copy out
        "abc_bound": 2 * L * I,                      # x read by max |x|
        "rebuild_x": 4 * L * I,                      # >= 2 bytes of kept input read, x written
        "hq_cublas": 2 * L * I * o_pad,
        "hq_int8": 2 * L * I * o_pad,
        "hla_g": 2 * L * O + lr * O,
        "hla_int8": 2 * O * I * lr,
        "hla_cublas": 2 * O * I * -(-lr // 16) * 16,
        "abc_x": 2 * L * I + lr * I,                 # forward: x in, compressed x out
        "gx_bf16": 2 * L * I * O,
        "gw_bf16": 2 * L * I * O,
        "fwd_cast_x": 5 * L * I,                     # amax read, cast read, e4m3 write
        "fwd_cast_x_gelu": L * I,                    # e4m3 written beside GELU's output
        "fwd_cast_w": 5 * O * I,
        "fwd_fp8": 2 * L * I * O,
        "fwd_bf16": 2 * L * I * O,
    }[kernel]


@dataclasses.dataclass(frozen=True)
class CostModel:
    name: str
    kernels: Dict[str, Tuple[float, float]]   # kernel -> (fixed ms, ms per unit of work)
    host_hot_ms: float                        # host time of one HOT site's ``hot::`` ops
    host_exact_ms: float                      # the same for the two exact GEMMs
    host_spliced_ms: float = 0.074            # one spliced site (Inductor launches it)
    # ``STEP_KERNELS`` lines, measured in a model's step; a table without them prices an
    # owned weight cast like any other W (``prices_owned_w``) and no bound of ABC's own
    step_lines: Dict[str, Tuple[float, float]] = dataclasses.field(default_factory=dict)

    def kernel_ms(self, k: str, L: int, I: int, O: int, rank: int, block: int) -> float:
        k = SAME_LINE.get(k, k)
        fixed, slope = self.step_lines[k] if k in STEP_KERNELS else self.kernels[k]
        return fixed + slope * work(k, L, I, O, rank, block)

    @property
    def prices_owned_w(self) -> bool:
        """Whether this table has the lines of a weight whose cast HOT owns."""
        return "hq_w_owned" in self.step_lines and "w_recast" in self.step_lines

    def gpu_ms(self, L: int, I: int, O: int, rank: int, block: int, gx: bool = True,
               gw: bool = True, abc_share: float = 1.0,
               gx_gemm: str = "hq_cublas", gw_gemm: str = "hla_int8", w_fp32: bool = False,
               rebuild_x: bool = False, gx_e4m3: bool = False,
               w_owned: bool = False, x_bound: bool = False) -> Tuple[float, float]:
        """(exact, HOT) GPU time of the site's backward (+ its share of the ABC kernel and,
        with ``rebuild_x``, of x's rebuild: both shared by the sites reading one x).
        ``gx_e4m3``: g_x on FP8 without HQ (``site_kernels``). ``w_owned``: HOT owns the
        site's weight cast (``STEP_KERNELS``; ignored by a table without those lines): the
        exact side re-casts W, HOT's reads the forward's W operand. ``x_bound``: ABC's max
        |x| is a reduction of its own (no FP8 forward cast gives it; its share, like ABC's)."""
        w_owned = w_owned and gx and not w_fp32 and self.prices_owned_w
        t = lambda k: self.kernel_ms(k, L, I, O, rank, block)  # noqa: E731
        exact = (t("gx_bf16") if gx or gx_e4m3 else 0.0) + (t("gw_bf16") if gw else 0.0)
        exact += t("w_recast") if w_owned else 0.0
        hot = sum(t(k) * (abc_share if k in ("abc_x", "rebuild_x") else 1.0)
                  for k in site_kernels(gx, gw, rank, gx_gemm, gw_gemm, w_fp32, rebuild_x,
                                        gx_e4m3, w_owned))
        if x_bound and gw and "abc_bound" in self.step_lines:
            hot += t("abc_bound") * abc_share
        return exact, hot

    def predict_forward(self, L: int, I: int, O: int, x_share: float = 1.0,
                        w_owned: bool = False, gelu: bool = False) -> Tuple[float, float]:
        """(bf16, FP8) predicted ms of a site's forward GEMM with its casts (``x_share``: the
        site's part of an x cast shared by the sites reading the same input). Inductor
        launches the casts and the extern GEMM itself in both cases: GPU time only.
        ``w_owned``: HOT owns the site's weight cast, and the kernel that writes HQ's W
        writes the forward's too, in the same read: the backward's ``hq_w_owned`` line
        prices both (measured under an FP8 forward), so no ``fwd_cast_w`` here (a table
        without that line charges it as before). ``gelu``: x is GELU's output and the
        row-wise cast is written by GELU's kernel (``forward._gelu_producer``): the cast
        costs that kernel's time over GELU's alone (``fwd_cast_x_gelu``; a table without
        the line prices a cast that reads x)."""
        t = lambda k: self.kernel_ms(k, L, I, O, 16, 16)  # noqa: E731
        w_cast = 0.0 if w_owned and self.prices_owned_w else t("fwd_cast_w")
        x_cast = ("fwd_cast_x_gelu" if gelu and "fwd_cast_x_gelu" in self.step_lines
                  else "fwd_cast_x")
        return t("fwd_bf16"), t("fwd_fp8") + x_share * t(x_cast) + w_cast

    def predict(self, L: int, I: int, O: int, rank: int, block: int, gx: bool, gw: bool,
                abc_share: float, graphs: bool, gx_gemm: str = "hq_cublas",
                gw_gemm: str = "hla_int8", w_fp32: bool = False,
                rebuild_x: bool = False, gx_e4m3: bool = False,
                spliced: bool = False, w_owned: bool = False,
                x_bound: bool = False) -> Tuple[float, float]:
        """(exact, HOT) predicted ms; ``graphs``: the step replays a CUDA graph (no host);
        ``spliced``: the site's kernels are launched by Inductor (``passes/splice.py``),
        whose host time is ``host_spliced_ms``, not the ``hot::`` ops' ``host_hot_ms``;
        ``w_owned``, ``x_bound``: as ``gpu_ms``."""
        exact, hot = self.gpu_ms(L, I, O, rank, block, gx, gw, abc_share, gx_gemm, gw_gemm,
                                 w_fp32, rebuild_x, gx_e4m3, w_owned, x_bound)
        if not graphs:
            share = (int(gx or gx_e4m3) + int(gw)) / 2
            exact = max(exact, self.host_exact_ms * share)
            hot = max(hot, (self.host_spliced_ms if spliced else self.host_hot_ms) * share)
        return exact, hot


# Fitted by bench/fit_cost.py on bench/results/layers_2026-11-24T200300_h100-80gb-hbm3.json
# (ninth stop; defaults: g_y 4-bit per token, W 8-bit as scaled e4m3, HLA rank 16; g_x on
# cuBLAS FP8; g_W on cuBLAS FP8 with e4m3 operands, x saved K-major by ABC, so no
# transpose; the channel-major HLA tile; ABC timed from CUDA-graph replays). 11 layers:
# ViT-B, GPT d4096 and Llama d4096's own (8192 tokens); against the whole-backward
# replays the HOT side is within -10..+8% (Llama +5..+6%), the exact side within -5..+9%.
# The fixed costs were scaled by 0.929 (fit_cost.py). The eighth stop's table (fitted
# before ABC wrote K-major) over-priced a Llama d4096 attention site 0.830 vs 0.799 ms and
# left two of them exact; measured, HOT runs it 0.64 vs 0.80 ms. Host times from the
# 2026-11-23T201819 run: the eager HOT backward of the smallest layer (ViT-B proj, GPU
# 0.14 ms) took 0.275 ms, the exact one is GPU-bound: ``host_hot_ms``, the ``hot::`` ops' (the
# seventh stop measured spliced sites at 0.30 ms too, when Inductor's wrapper still launched a
# user Triton kernel through Triton's own Python launcher). Spliced sites since the
# thirty-first stop's static launcher: ``host_spliced_ms`` = 0.074 ms, every ViT-B/16 bs64
# layer forced and spliced against Inductor, (22.56 - 18.94 ms) / 49 sites of host time a step,
# the forward's FP8 casts included (H200 machine, fifty-first stop,
# train_2026-12-01T083125_h200_s51_vit_forced; the host is the CPU's, so both tables take it).
H100 = CostModel(
    name="H100 (layers_2026-11-24T200300)",
    kernels={
        "grad_out": (0.0483, 1.4305e-09),
        "hq_g_token": (0.0013, 6.6961e-10),
        "hq_w": (0.0086, 8.4563e-10),
        "hq_w_fp32": (0.0124, 7.1387e-10),
        "hq_cublas": (0.0013, 6.9840e-13),
        "hq_int8": (0.0214, 8.4067e-13),
        "hla_g": (0.0152, 7.4639e-10),
        "hla_int8": (0.0446, 8.5529e-13),
        "hla_cublas": (0.0079, 7.3551e-13),
        "abc_x": (0.0080, 5.6919e-10),
        "gx_bf16": (0.0000, 1.4368e-12),
        "gw_bf16": (0.0000, 1.4302e-12),
        # forward lines, GPU time of Inductor-compiled casts and GEMMs (CUDA-graph replays),
        # forward_layers_2026-11-24T052226 (ViT-B, GPT d4096 fc1, Llama d4096 layers): the
        # least-squares fit, the FP8 GEMM's fixed cost raised to 0.010 ms so that the ViT-B
        # layers are not under-estimated (the fit's 0 predicts ViT fc1 0.043 vs 0.059 ms)
        "fwd_cast_x": (0.0064, 3.5114e-10),
        "fwd_cast_w": (0.0065, 3.4933e-10),
        "fwd_fp8": (0.0100, 7.2539e-13),
        "fwd_bf16": (0.0000, 1.3763e-12),
    },
    host_hot_ms=0.30,
    host_exact_ms=0.01,
)


# Fitted by bench/fit_cost.py on bench/results/layers_2026-12-02T145339_h200.json (fifty-eighth
# stop: the kernels of the forty-ninth to fifty-third stops, g's HLA operand on the bits, one
# multiply a quotient; ABC timed as a site runs it, its bound from x's producer; copy 4189
# GB/s). The fixed costs were scaled by 2.469 so that no layer's HOT time is under-estimated
# by more than 10% (the whole-backward replays it is checked against time ABC with its own
# max |x| pass, which a site whose FP8 forward gives the bound does not run: the table errs
# towards exact). Against the forty-third stop's table (layers_2026-11-30T040407, in git
# history) g's HLA line is 25% cheaper a byte, HQ's per-token g 10%; no bench model's
# decision moves (the fifty-eighth stop's arithmetic over ViT-B bs64-512, GPT-2 and Llama
# d1536-d5120). Host times: the H100 table's (the ``hot::`` ops' was not measured on an H200).
H200 = CostModel(
    name="H200 (layers_2026-12-02T145339)",
    kernels={
        "grad_out": (0.0941, 1.3750e-09),
        "hq_g_token": (0.0002, 4.2449e-10),
        "hq_w": (0.0337, 5.1443e-10),
        "hq_w_fp32": (0.0412, 4.5443e-10),
        "hq_cublas": (0.0000, 7.1211e-13),
        "hq_int8": (0.0762, 8.2730e-13),
        "hla_g": (0.0226, 2.9715e-10),
        "hla_int8": (0.0698, 9.1433e-13),
        "hla_cublas": (0.0124, 7.8079e-13),
        "abc_x": (0.0123, 2.7131e-10),
        "gx_bf16": (0.0000, 1.4706e-12),
        "gw_bf16": (0.0000, 1.4484e-12),
        # forward lines: forward_layers_2026-11-29T005353_h200_s34 (thirty-fourth stop), the
        # least-squares fit, the FP8 GEMM's fixed cost raised from 0.0075 to 0.015 ms so that
        # no layer's FP8 side is under-estimated by more than 10% (the fit alone predicted
        # ViT-B fc1 at 0.83x its measured 0.095 ms)
        "fwd_cast_x": (0.0073, 2.7946e-10),
        "fwd_cast_w": (0.0077, 2.7664e-10),
        "fwd_fp8": (0.0150, 6.6246e-13),
        "fwd_bf16": (0.0000, 1.3965e-12),
    },
    host_hot_ms=H100.host_hot_ms,
    host_exact_ms=H100.host_exact_ms,
    # From the fiftieth stop's step profile of Llama d4096 (2 layers + head, 8192 tokens;
    # profile_2026-12-01T045219_h200_s50, device times of the kernels, no launch gaps).
    # w_recast: Inductor's casts of the 15 fp32 weights, forward and backward alike
    # (``_to_copy`` / ``_to_copy_t`` kernels, 0.024 / 0.061-0.065 / 0.182-0.189 ms at
    # 4096 x 4096, 11008 x 4096, 32000 x 4096): least squares through the origin, the copy
    # rate (4.24 TB/s). hq_w_owned: HOT's step instead ran ``_weight_operands_kernel``
    # (0.725 ms) and ``_weight_cast_kernel`` (0.691 ms, against 0.584 ms of Inductor's
    # forward casts of the same 14 weights) in two launches each: (0.725 + 0.107) ms over 4
    # bytes of each of their 404.8 M elements; fixed cost the ``hq_w`` line's over the 8
    # weights a launch serves (``hadamard.WEIGHT_SLOTS``). The ``hq_w`` line above (a bf16 W,
    # one launch a weight, as bench/layers.py times it) had priced that W side at 1.12 ms
    # of HOT backward for these 14 sites, and nothing on the exact side for 0.56 ms of
    # backward re-casts (fifty-seventh stop).
    # abc_bound: a reduction over x Inductor compiled where the forward stayed bf16 (ViT-B
    # bs192's fc2, its input GELU's output: 0.162 ms a site for 232 MB, fifty-seventh stop,
    # profile_2026-12-02T125010_h200_s57_vit192_fc2) or fused into x's producer as a
    # reduction kernel (Llama d4096's down_proj, SiLU(gate) * up: 0.64 against Inductor's
    # pointwise 0.25 ms for 2 sites, 180 MB each, in the fiftieth stop's profile): the slower
    # of the two, 1.07e-9 ms a byte, ~0.93 TB/s.
    # fwd_cast_x_gelu: ``hot::gelu_e4m3`` against Inductor's GELU alone at 12608 x 3072,
    # 16448 x 5120, 8192 x 4096 and 12608 x 8192 (sixtieth stop, CUDA-graph replays,
    # gelu_e4m3_kernel_2026-12-03T0619_h200_s60): 0.0150, 0.0403, 0.0139, 0.0670 ms over
    # GELU's 0.053-0.139. Through the origin (a least-squares intercept came out negative),
    # the slope 0.9x the largest ms an element, so that no shape is under-priced by more than
    # 10% (12608 x 8192 by 10%, the others over-priced 1.2-1.5x).
    step_lines={"hq_w_owned": (0.0044, 5.1390e-10), "w_recast": (0.0, 2.3561e-10),
                "abc_bound": (0.0, 1.0700e-09), "fwd_cast_x_gelu": (0.0, 5.8383e-10)},
)

# a device name's marker -> its table; the first marker found in the name wins
MODELS = (("H200", H200), ("H100", H100))


def model_for(device: torch.device) -> Optional[CostModel]:
    """The cost model of ``device`` (by its name; the H100's for a chip without a table of
    its own); None where HOT's speed is not modelled (CPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((m for marker, m in MODELS if marker in name), H100)

