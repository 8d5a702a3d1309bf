"""grad_out.grad_out_quant (one kernel pair for both operands of g_y) against the two
separate launchers it replaces, hadamard.hq_act_quant and hla.hla_quant.

What must hold, bit for bit, on fresh random inputs (never zeros) with every output
allocation poisoned first: the HQ levels and scale, the HLA levels (the L' defined columns
of the transposed buffer; its pad columns are unwritten by both) and scale, for O and L
that are not multiples of 16, per-token and per-tensor HQ scales, ranks 8 and 16 (and a
2-D selection), 4- and 8-bit HQ levels, int8 and e4m3 HQ storage, bf16 and fp32 inputs,
tiles with several token blocks and column tiles, and NaN/Inf inputs (which propagate
exactly as in the separate kernels).

CPU part: Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported), small
shapes, skipped on a machine with CUDA. GPU part (marked ``gpu``): ViT-sized g (12608 x
3072 and x 768) on the compiled kernels.
"""

import pytest
import torch

import interp

# As in test_kernels_triton.py: the interpreter must be chosen before triton.language is
# first imported; if it was imported in compiled mode already, the CPU tests run in a child.
interp.choose_interpreter()

try:
    import triton.language as tl  # noqa: E402
    from hotcompile.kernels import grad_out as GO, hadamard as H, hla as HL  # noqa: E402
    _INTERPRETED = interp.interpreted(GO._grad_out_kernel)
except ImportError as exc:  # pragma: no cover - triton missing
    pytest.skip(f"triton unavailable: {exc}", allow_module_level=True)

cpu = interp.cpu_mark(_INTERPRETED)
test_interpreter_suite_in_subprocess = interp.subprocess_suite(__file__, _INTERPRETED)


@pytest.fixture
def poison(monkeypatch):
    """Every torch.empty / empty_like (the launchers' output allocations) starts as garbage:
    99 in integer tensors, NaN in float ones (0x7F, NaN, in e4m3), so an element a kernel
    leaves unwritten cannot pass."""
    real_empty, real_like = torch.empty, torch.empty_like

    def fill(t):
        if t.dtype == torch.float8_e4m3fn:
            t.view(torch.uint8).fill_(0x7F)
        elif t.dtype.is_floating_point:
            t.fill_(float("nan"))
        else:
            t.fill_(99)
        return t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: fill(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: fill(real_like(*a, **k)))


def _randn(*shape, dtype=torch.float32, device="cpu"):
    return (torch.randn(*shape, device=device) * 3).to(dtype)


def _bits(t):
    """The tensor's bytes as integers: equality that also holds for NaN scales."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(ints[t.element_size()])


def _assert_same(a, b, what):
    assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape, a.dtype, b.dtype)
    assert torch.equal(_bits(a), _bits(b)), what


def _check(g, hq_bits, per_token, hq_seed, rank, select, hla_bits, hla_seed, fp8=False,
           seed_add=0, seq_len=0, seq_first=False):
    """grad_out_quant against the separate pair; returns the combined outputs."""
    lay = dict(seq_len=seq_len, seq_first=seq_first)
    out = GO.grad_out_quant(g, hq_bits, per_token, hq_seed, rank, select, hla_bits, hla_seed,
                            fp8=fp8, hla_seed_add=seed_add, **lay)
    hq_q, hq_s = H.hq_act_quant(g, hq_bits, per_token, hq_seed, fp8)
    hla_q, hla_s = HL.hla_quant(g, rank, select, hla_bits, stochastic=True,
                                seed=hla_seed + seed_add, transposed=True, pad_to=16, **lay)
    rows = HL.token_layout(g.shape[0], seq_len, seq_first)[4] * rank   # L': defined columns
    _assert_same(out[0], hq_q, "hq levels")
    _assert_same(out[1], hq_s, "hq scale")
    assert out[2].shape == hla_q.shape and out[2].dtype == hla_q.dtype
    _assert_same(out[2][:, :rows], hla_q[:, :rows], "hla levels")
    _assert_same(out[3], hla_s, "hla scale")
    return out


# =============================================================================== CPU

CASES = [  # L, O, per_token, rank, hq_bits, dtype: each value of each axis at least twice
    (37, 40, True, 8, 4, torch.bfloat16),
    (37, 40, False, 16, 8, torch.float32),
    (64, 48, True, 16, 8, torch.bfloat16),
    (64, 48, False, 8, 4, torch.float32),
    (48, 64, True, 8, 8, torch.float32),
    (48, 64, False, 16, 4, torch.bfloat16),
]


@cpu
@pytest.mark.parametrize("L,O,per_token,rank,hq_bits,dtype", CASES)
def test_bit_identical_to_separate_kernels(poison, L, O, per_token, rank, hq_bits, dtype):
    torch.manual_seed(L * O + rank)
    g = _randn(L, O, dtype=dtype)
    out = _check(g, hq_bits, per_token, 1234, rank, "1d", 8, torch.tensor(77))
    q = out[0]
    assert int(q.abs().max()) <= H.qmax(hq_bits) and bool((q != 0).any())


@cpu
@pytest.mark.parametrize("per_token", [True, False])
def test_fp8_levels_and_2d_selection(poison, per_token):
    torch.manual_seed(5)
    g = _randn(37, 24, dtype=torch.bfloat16)
    out = _check(g, 4, per_token, 3, 10, "2d", 8, 4, fp8=True)
    assert out[0].dtype == torch.float8_e4m3fn


@cpu
@pytest.mark.parametrize("tile,per_token", [("2,16,4,4", True), ("1,32,2,8", False),
                                            ("4,16,1,16", True), ("1,128,4,2", False)])
def test_other_tile_shapes(poison, monkeypatch, tile, per_token):
    """Several token blocks per program (past L), several column tiles per row, a tile
    wider than O_pad, HQ slices of 2 to 16 tokens: the tile shape must not change a bit."""
    monkeypatch.setenv("HOT_GRAD_OUT_TILE", tile)
    torch.manual_seed(11)
    _check(_randn(37, 40, dtype=torch.bfloat16), 4, per_token, 21, 8, "1d", 8, 22)


@cpu
@pytest.mark.parametrize("bad,per_token", [(float("nan"), True), (float("nan"), False),
                                           (float("inf"), True), (float("-inf"), False)])
def test_nonfinite_inputs_propagate_like_separate_kernels(poison, bad, per_token):
    torch.manual_seed(3)
    g = _randn(37, 40, dtype=torch.bfloat16)
    g[3, 5] = bad
    hq_q, hq_s, hla_q, hla_s = _check(g, 4, per_token, 9, 8, "1d", 8, 10)
    assert not torch.isfinite(hla_s)                     # the HLA amax covers every token
    assert not torch.isfinite(hq_s).all()
    if per_token:
        assert torch.isfinite(hq_s[torch.arange(37) != 3]).all()   # other rows unaffected


@cpu
@pytest.mark.parametrize("seq_len,seq_first,per_token", [(13, False, True), (13, True, False),
                                                          (20, False, False), (20, True, True)])
def test_sequence_blocks(poison, seq_len, seq_first, per_token):
    """Blocks of 16 neighbouring positions of one sequence (13: one padded block per
    sequence; 20: a full and a padded one), batch-first and sequence-first rows: the
    padding positions must not leak into the HQ operand, which covers every row once."""
    torch.manual_seed(seq_len + seq_first)
    g = _randn(3 * seq_len, 40, dtype=torch.bfloat16)
    _check(g, 4, per_token, 31, 8, "1d", 8, 32, seq_len=seq_len, seq_first=seq_first)


@cpu
def test_one_seed_tensor_for_both_halves(poison):
    """hla_seed_add: the HLA half reads the HQ seed tensor plus an offset (the fused
    backward op draws one seed per site), equal to the separate kernel with seed + 1."""
    torch.manual_seed(9)
    g = _randn(37, 40, dtype=torch.bfloat16)
    seed = torch.tensor(41)
    a = _check(g, 4, True, seed, 8, "1d", 8, seed, seed_add=1)
    b = GO.grad_out_quant(g, 4, True, seed, 8, "1d", 8, seed)
    assert not torch.equal(a[2][:, :24], b[2][:, :24])   # another key: other HLA bits
    _assert_same(a[0], b[0], "hq levels")


@cpu
def test_tiny_scales_take_the_ieee_branch(poison):
    """Rows of denormal magnitude (reciprocal of the scale overflows) next to normal rows."""
    torch.manual_seed(8)
    g = _randn(37, 40)
    g[5] *= 1e-39
    g[20:24] *= 1e-40
    _check(g, 4, True, 1, 8, "1d", 8, 2)
    _check(g * 1e-40, 8, False, 1, 16, "1d", 8, 2)       # per-tensor HQ and HLA scales tiny


@cpu
def test_noncontiguous_input_and_seed_forms(poison):
    torch.manual_seed(4)
    g = _randn(40, 37, dtype=torch.bfloat16).t()         # (37, 40) view, stride (1, 37)
    a = _check(g, 4, True, 5, 8, "1d", 8, 6)
    b = GO.grad_out_quant(g.contiguous(), 4, True, torch.tensor([5]), 8, "1d", 8,
                          torch.tensor(6, dtype=torch.int64))
    for i, what in enumerate(("hq levels", "hq scale", "hla levels", "hla scale")):
        x, y = (a[i][:, :24], b[i][:, :24]) if i == 2 else (a[i], b[i])   # L' = 24
        _assert_same(x, y, what)
    c = GO.grad_out_quant(g, 4, True, 7, 8, "1d", 8, 6)
    assert not torch.equal(a[0], c[0]) and torch.equal(a[2][:, :24], c[2][:, :24])


@cpu
def test_argument_checks():
    g = _randn(16, 16)
    with pytest.raises(ValueError):
        GO.grad_out_quant(g, 1, True, 0, 8, "1d", 8, 0)
    with pytest.raises(ValueError):
        GO.grad_out_quant(g, 4, True, 0, 8, "1d", 9, 0)
    with pytest.raises(ValueError):
        GO.grad_out_quant(g, 4, True, 0, 0, "1d", 8, 0)
    with pytest.raises(ValueError):
        GO.grad_out_quant(g, 4, True, 0, 8, "3d", 8, 0)


# =============================================================================== GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("O", [3072, 768])
@pytest.mark.parametrize("per_token", [True, False])
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_vit_shapes_bit_identical(O, per_token, fp8):
    torch.manual_seed(0)
    g = _randn(12608, O, dtype=torch.bfloat16, device="cuda")
    _check(g, 4, per_token, torch.tensor(77, device="cuda"), 8, "1d", 8,
           torch.tensor(78, device="cuda"), fp8=fp8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_odd_shapes_and_nonfinite():
    torch.manual_seed(1)
    g = _randn(1000, 520, device="cuda")
    for per_token in (True, False):
        _check(g, 4, per_token, 3, 8, "1d", 8, 4)
        _check(g.to(torch.bfloat16), 8, per_token, 3, 16, "1d", 8, 4)
    g[500, 100] = float("inf")              # infs alone: s inf, reciprocal 0 (the IEEE path)
    g[600, 3] = -float("inf")
    for per_token in (True, False):
        hla_q = _check(g, 4, per_token, 3, 8, "1d", 8, 4)[2]
        assert not hla_q.isnan().any() and hla_q[:, :8 * 63].abs().max() < 127
    g[10, 7] = float("nan")
    for per_token in (True, False):
        _check(g, 4, per_token, 3, 8, "1d", 8, 4)
