"""The FP8 forward GEMM (``HOTConfig(forward="fp8")``, or ``"fp8_rowwise"``): scaled e4m3
operands on ``torch._scaled_mm``, written in aten ops only.

Why aten ops and not a Triton kernel: the casts are an amax reduction and one pointwise
pass per operand, which Inductor fuses with their producers (the RMSNorm or GELU that
made x, the bf16 cast of an fp32 master weight) and launches itself: no Python at run
time, no opaque op. The same functions serve twice: called on real tensors they are the
reference twin; called on ``torch.fx.Proxy`` objects (``passes/graph_utils.emit``) they
record exactly these ops into the joint graph. So the compiled graph computes the
reference by construction, and the tests compare the two on random data.

Numerics (as torchao's float8 recipes): s = max(amax(|t|), 1e-12) * (1 / 448) over the tensor, or
over each row (row-wise: each token of x, each output feature of W), q = e4m3(clamp(t * (1 /
s), -448, 448)) rounded to nearest even, 1 / s correctly rounded (``scale_reciprocal``: eager,
compiled and HOT's W kernel give the same levels, bit for bit, on the GPU as on the CPU);
the GEMM computes (q_x q_w^T) * s_x * s_w with fp32 accumulation. The clamp is needed: torch's
fp32 -> e4m3fn conversion does not saturate (it gives NaN above 448). NaN in an operand
makes its amax NaN, so the output is NaN, as a bf16 GEMM's would be somewhere.
Under bf16 autocast, Inductor fuses autocast's bf16 cast of x (or W) into this one and
keeps the value in fp32 (``emulate_precision_casts=False``): left alone, a compiled graph
would quantize the unrounded value where it fuses and the rounded one where it does not
(per layer as far apart as the twin on bf16 and on fp32 operands: 1.4% on a random MLP
layer), so the forward's output would move whenever an unrelated change altered what the
forward materializes. ``e4m3_cast`` therefore pins a bf16 / fp16 operand to its dtype
first with a bitcast round trip (as int16 and back), which Inductor computes from the
rounded value: the compiled forward is the twin on the operands' own dtype, fused or not.

``FAST_ACCUM``: the forward GEMM accumulates with Hopper's fast FP8 accumulation, as
torchao's forward does by default (its backward GEMMs do not); the accuracy gates ran
with it (docs/BENCHMARKS.md).
"""
from __future__ import annotations

import torch
from torch._inductor import inductor_prims  # noqa: F401  registers inductor_force_stride_order

aten = torch.ops.aten
prims = torch.ops.prims

E4M3_MAX = 448.0
_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16}
AMAX_FLOOR = 1e-12
FAST_ACCUM = True


def scale_from_amax(amax):
    """max(amax, 1e-12) * (1 / 448): the dequantization scale of e4m3 levels. Times 1 / 448
    rather than over 448: what Inductor compiles the division to on the GPU (not on the
    CPU), so every device and the W kernel (``hadamard._store_forward_weight``) compute the
    same scale."""
    return aten.mul.Tensor(aten.clamp_min.default(amax, AMAX_FLOOR), 1.0 / E4M3_MAX)


def scale_reciprocal(scale):
    """1 / scale in fp32, correctly rounded on every device, eager or compiled: divided in
    fp64 and rounded to fp32 once more. Why not ``aten.reciprocal`` on the fp32 scale: eager
    CUDA divides IEEE-rounded, but Inductor compiles it to Triton's fp32 ``/``, the GPU's
    approximate ``div.full.f32`` (up to 2 ulp off), so a compiled cast's level on a rounding
    boundary could differ from the eager twin's, and from itself where it is fused into
    another kernel (a producer's, a backward's). Triton's fp64 ``/`` is ``div.rn.f64``, and
    rounding an IEEE fp64 quotient of fp32 operands to fp32 gives the correctly rounded fp32
    quotient (53 >= 2 * 24 + 2 bits: double rounding is innocuous for division). One
    division per scale (a row's, or the tensor's), not per element."""
    inv64 = aten.reciprocal.default(prims.convert_element_type.default(scale, torch.float64))
    return prims.convert_element_type.default(inv64, torch.float32)


def e4m3_levels(t32, inv):
    """e4m3(clamp(t32 * inv, -448, 448)), ``inv`` the scale's reciprocal (broadcast).
    clamp_min / clamp_max, not clamp: the joint graph is past decomposition, and these two
    are what Inductor lowers (NaN passes through both); the clamp is needed because torch's
    fp32 -> e4m3fn conversion does not saturate."""
    q = aten.clamp_max.default(aten.clamp_min.default(aten.mul.Tensor(t32, inv), -E4M3_MAX),
                               E4M3_MAX)
    return prims.convert_element_type.default(q, torch.float8_e4m3fn)


def e4m3_cast(t, rowwise: bool = False, contiguous: bool = False, scale_as_row: bool = False,
              dtype: torch.dtype | None = None, amax=None, bound: bool = False):
    """(e4m3 levels of ``t``, fp32 dequantization scale). ``t``: 2-D, any float dtype,
    ``dtype`` its dtype when ``t`` is a graph proxy (default: ``t.dtype``): a bf16 / fp16
    ``t`` is pinned to it first (a bitcast round trip; see the module's docstring).

    The scale is 0-d, or with ``rowwise`` one per row of ``t``, shaped (R, 1), or with
    ``scale_as_row`` (1, R): the GEMM's x and W scales. ``contiguous``: the levels are
    written row-major whatever ``t``'s strides (the GEMM's operand layout; Inductor fuses
    this with the cast). The 2-D scale is an ``as_strided`` view with unit strides of the
    1-D scale: Inductor gives a view made by ``unsqueeze`` (or a keepdim reduction) any
    stride on its size-1 axis (0 or R seen on CPU), which ``_scaled_mm`` rejects.
    ``amax``: max |t| (fp32: 0-d, or (R,) row-wise) when the caller has it: the same value
    the reduction here would give, so the same levels and scale without that read of t.
    ``bound``: also return max |t| over the whole of t (``max_bits``), from the maxima the
    cast takes anyway."""
    dtype = dtype or t.dtype
    if dtype in _BITS:          # the identity "& -1" keeps Inductor from folding the pair
        bits = aten.bitwise_and.Scalar(aten.view.dtype(t, _BITS[dtype]), -1)
        t = aten.view.dtype(bits, dtype)
    t32 = prims.convert_element_type.default(t, torch.float32)
    if amax is None:
        amax = aten.amax.default(aten.abs.default(t32), [1] if rowwise else [0, 1])
    scale = scale_from_amax(amax)
    inv = scale_reciprocal(scale)
    q = e4m3_levels(t32, aten.unsqueeze.default(inv, 1) if rowwise else inv)
    if contiguous:
        q = aten.clone.default(q, memory_format=torch.contiguous_format)
    if rowwise:
        n = aten.sym_size.int(t, 0)
        scale = aten.as_strided.default(scale, [1, n] if scale_as_row else [n, 1],
                                        [n, 1] if scale_as_row else [1, 1])
    if bound:
        return q, scale, max_bits(amax, rowwise)
    return q, scale


def max_bits(amax, rowwise: bool):
    """max |t| over all of t from a cast's maxima (0-d, or one per row) as a (1,) int32
    word of fp32 bits, the form HOT's kernels read a bound in (``hadamard.input_amax_bits``:
    the saved x's e4m3 scale, ``hot::abc_compress``'s ``amax``). Why: where a site's x goes
    to the FP8 forward, its cast already reduces x to these maxima (of the values pinned to
    x's dtype: the values ABC reads); their max is the tensor's, NaN included, without
    another read of x. At Llama's down_proj that read was a kernel of its own (180 MB at
    8192 x 11008: Inductor does not fuse a whole-tensor reduction into the SwiGLU
    product's row reduction; the thirty-ninth stop's output code)."""
    m = aten.amax.default(amax, [0]) if rowwise else amax
    return aten.view.dtype(aten.reshape.default(m, [-1]), torch.int32)


def scaled_linear(xq, sx, wtq, sw, bias, dtype: torch.dtype, fast_accum: bool = FAST_ACCUM):
    """y = (xq sx) (wtq sw) + bias in ``dtype``; ``wtq``: the (I, O) operand, column-major
    (the transpose of a row-major (O, I) buffer: cuBLAS's FP8 layout); scales 0-d, or (L, 1)
    and (1, O) row-wise (bf16 output only). bf16 and fp32 outputs come from the GEMM (bf16
    with its bias fused), fp16 through an fp32 output and a cast."""
    out = torch.float32 if dtype == torch.float16 else dtype
    fused_bias = bias is not None and out == torch.bfloat16
    y = aten._scaled_mm.default(*gemm_layouts(xq, wtq), sx, sw, bias if fused_bias else None,
                                None, out, fast_accum)
    if bias is not None and not fused_bias:
        y = aten.add.Tensor(y, bias)
    if out != dtype:
        y = prims.convert_element_type.default(y, dtype)
    return y


def gemm_layouts(xq, wtq):
    """(xq row-major, wtq column-major): the only layouts cuBLAS's FP8 GEMM multiplies.
    Why not the casts' own ``contiguous`` clone alone: Inductor lays out a pointwise
    result as it likes unless a consumer pins it, and ``_scaled_mm``'s lowering does not;
    with x a transposed view of the model's input it wrote the e4m3 x column-major and
    cuBLASLt raised "Only multiplication of row-major and column-major matrices" (the GPU
    property suite, fiftieth stop). ``inductor_force_stride_order`` pins each operand's
    layout for Inductor (no copy where it is there already); eagerly it copies only an
    operand that is not."""
    i = aten.sym_size.int(xq, 1)
    force = prims.inductor_force_stride_order.default
    return force(xq, [i, 1]), force(wtq, [1, i])


def weight_operand(wt, rowwise: bool = False, dtype: torch.dtype | None = None,
                   max_bits=None, pad: int = 0):
    """The (I, O) forward operand ``wt`` -> (column-major e4m3 (I, O + pad), scale: 0-d, or
    (1, O + pad) row-wise): quantize W = wt^T as a row-major (O, I) buffer, then view it
    transposed. ``dtype``: ``wt``'s, when it is a graph proxy. ``max_bits``: W's maxima as
    int32 bits of |W| (``reference.weight_cast``'s): per row (O,) row-wise, per column (I,)
    tensor-wise (their max is W's): W's amax without a reduction over W. ``pad``: zero rows
    appended to W (``out_padding``), whose levels are 0 (their row-wise scale the floor's):
    Inductor fuses the padding into the cast's one read of W."""
    amax = None
    if max_bits is not None:
        if not rowwise:         # int32 order is float order for |W| (NaN above inf)
            max_bits = aten.amax.default(max_bits, [0])
        elif pad:               # the zero rows' maxima: 0.0, whose bits are 0
            max_bits = aten.constant_pad_nd.default(max_bits, [0, pad], 0)
        amax = aten.view.dtype(max_bits, torch.float32)
    w = aten.permute.default(wt, [1, 0])
    if pad:
        w = aten.constant_pad_nd.default(w, [0, 0, 0, pad], 0.0)
    q, s = e4m3_cast(w, rowwise, True, scale_as_row=True, dtype=dtype, amax=amax)
    return aten.permute.default(q, [1, 0]), s


def out_padding(O: int) -> int:
    """Zero rows that bring W's out-features O to a multiple of 16, cuBLAS's FP8 layout rule
    (GPT-2's head: 50257 -> 50272, BERT's: 30522 -> 30528). Why pad and not keep bf16: the
    padded FP8 forward made GPT-2's head with its loss (16384 x 768 -> 50257, forward and
    backward) 1.076x Inductor's bf16 (8.99 -> 8.36 ms), GPT-2's step 1.030x against 1.015x
    with the head left bf16 in the same process (H200, ``bench/padded_head.py``, docs/BENCHMARKS.md,
    sixty-fourth stop). In-features are not padded: x would need a copy of its own."""
    return -O % 16


def padded_linear(xq, sx, wq, sw, bias, dtype: torch.dtype, O: int, pad: int):
    """``scaled_linear`` on a W operand padded by ``pad`` columns (``weight_operand``), the
    bias padded to match, and the output sliced back to its O features: a strided view (row
    stride O + pad) of the GEMM's output, which ``passes/forward.py`` gives only to readers
    it proved take any strides."""
    if not pad:
        return scaled_linear(xq, sx, wq, sw, bias, dtype)
    if bias is not None:
        bias = aten.constant_pad_nd.default(bias, [0, pad], 0.0)
    y = scaled_linear(xq, sx, wq, sw, bias, dtype)
    return aten.slice.Tensor(y, 1, 0, O)


def fp8_linear(x, wt, bias=None, dtype: torch.dtype | None = None, rowwise: bool = False):
    """The reference twin of a rewritten forward site: x (L, I) @ wt (I, O) (+ bias) on e4m3
    operands, tensor-wise or (``rowwise``) with a scale per token and per output feature; an
    O that is not a multiple of 16 on W padded with zero rows, the output a view of the
    GEMM's first O columns (``out_padding``)."""
    O = wt.shape[1]
    pad = out_padding(O)
    xq, sx = e4m3_cast(x, rowwise, contiguous=True)
    wq, sw = weight_operand(wt, rowwise, pad=pad)
    return padded_linear(xq, sx, wq, sw, bias, dtype or x.dtype, O, pad)


FORWARDS = ("auto", "bf16", "fp8", "fp8_rowwise")
# where "auto" takes the row-wise FP8 forward: the chips whose FP8 speed and cost table were
# measured (Hopper: H100 and H200, passes/cost.py); elsewhere it keeps bf16
AUTO_CAPABILITY = 9


def forward_rule(requested: str, device: torch.device, I, O,
                 dtype: torch.dtype = torch.bfloat16, pad_out: bool = False) -> tuple[str, str]:
    """(format, reason) of a site's forward GEMM: ``requested`` ("fp8": tensor-wise scales,
    "fp8_rowwise") where possible, else "bf16" with the reason. Needs FP8 tensor cores on
    CUDA (compute capability >= 8.9; CPU runs ``_scaled_mm``'s reference kernel, for tests),
    in/out features that are multiples of 16 (cuBLAS's FP8 layout rule; with ``pad_out``
    any static out-features, W padded: ``out_padding``), and for row-wise scales a bf16
    forward (the only output the row-wise GEMM has).

    "auto" (the default) is "fp8_rowwise" for a bf16 forward on an NVIDIA GPU of compute
    capability 9.x, and "bf16" with no reason elsewhere (CPU, an fp32 or fp16 forward,
    another chip; ROCm, whose MI300 also reports 9.x but whose FP8 is e4m3fnuz): a default
    that was not asked for FP8 has nothing to explain there.
    Why row-wise on Hopper: Llama d4096 1.32x Inductor against 1.17x with the bf16
    forward, the byte- and word-level GPT gates passed pooled over 7 and 6 seeds
    (docs/BENCHMARKS.md, 36th and 37th stops); the forward cost gate keeps bf16 where FP8
    would not pay, whatever the backward's gate decided for the site (ViT-B bs64's layers
    stay bf16 both ways; from bs128 its qkv and fc1 take the FP8 forward with an exact
    backward). With ``min_speedup=0`` both gates are off: every aligned site takes it."""
    if requested not in FORWARDS:
        raise ValueError(f"HOTConfig.forward must be one of {FORWARDS}, got {requested!r}")
    if requested == "auto":
        if (device.type != "cuda" or dtype != torch.bfloat16 or torch.version.hip
                or torch.cuda.get_device_capability(device)[0] != AUTO_CAPABILITY):
            return "bf16", ""
        requested = "fp8_rowwise"
    if requested == "bf16":
        return "bf16", ""
    if requested == "fp8_rowwise" and dtype != torch.bfloat16:
        return "bf16", f"row-wise FP8 needs a bf16 forward (got {str(dtype).split('.')[-1]})"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        return "bf16", "FP8 forward needs compute capability >= 8.9"
    if device.type not in ("cuda", "cpu"):
        return "bf16", f"no FP8 GEMM on {device.type}"
    for name, n in (("in", I), ("out", O)):
        if not isinstance(n, int) or (n % 16 and not (name == "out" and pad_out)):
            return "bf16", f"FP8 forward needs {name}-features a multiple of 16 (got {n})"
    return requested, ""
