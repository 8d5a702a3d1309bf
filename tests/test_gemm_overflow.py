"""The int32 overflow guard of the INT8 GEMM (gemm.scaled_mm) and of reference.int_matmul.

Why: an int32 sum of K products of 8-bit levels (|q| <= 127) wraps silently once
K * 127**2 >= 2**31 (K ~ 133k), a K the HLA g_W GEMM reaches on long token axes
(ceil(L/16) * rank). The kernel then sums K in chunks that cannot wrap and carries the
high bits of each chunk into a second int32 tile (gemm.py module doc); the result must be
the correctly rounded fp32 of the exact integer sum, i.e. bit-equal to a float64 reference.

CPU part (Triton interpreter, set up as in test_kernels_triton.py via tests/interp.py):
* a forced small chunk (``k_chunk``) exercises the chunked kernel on small shapes: K below,
  at and above the chunk, multiples of BK = 32 and not, vector and scalar scales, fp32 and
  bf16 outputs, padded rows; fresh random non-zero levels with +-127 in them, outputs
  poisoned first;
* the real default chunk at K = 140,000 with worst-case levels (the interpreter's int32
  dot wraps like the hardware's: without the guard this gives about -2.04e9 for +2.26e9).
Pure Python: the chunk the launcher picks is safe and when it chunks; reference.int_matmul's
K splitting is exact (its float64 CPU path, chunk forced small).
GPU part (marked ``gpu``, skipped without CUDA): K ~ 140k worst case against float64 for
scaled_mm and reference.int_matmul (torch._int_mm), and a forced chunk on GPU tiles.
"""

import pytest
import torch

import interp

interp.choose_interpreter()

from hotcompile.kernels import reference as R  # noqa: E402

try:
    from hotcompile.kernels import gemm as G  # noqa: E402
    _INTERPRETED = interp.interpreted(G._scaled_mm_kernel)
except ImportError as exc:  # pragma: no cover - triton missing
    pytest.skip(f"triton unavailable: {exc}", allow_module_level=True)

cpu = interp.cpu_mark(_INTERPRETED)
test_interpreter_suite_in_subprocess = interp.subprocess_suite(__file__, _INTERPRETED)

LONG_K = 140_000                       # > int8_k_chunk(): wraps in plain int32 (2.26e9 > 2**31)


@pytest.fixture(autouse=True)
def _no_chunk_override(monkeypatch):
    """An HOT_GEMM_K_CHUNK in the environment must not change what these tests check."""
    monkeypatch.setattr(G, "K_CHUNK_OVERRIDE", None)


@pytest.fixture
def poison(monkeypatch):
    """Every torch.empty / empty_like (the GEMM's output allocation) starts as garbage: NaN
    in float tensors, 99 in integer ones, so an unwritten element cannot pass."""
    real_empty, real_like = torch.empty, torch.empty_like

    def fill(t):
        return t.fill_(float("nan") if t.dtype.is_floating_point else 99)

    monkeypatch.setattr(torch, "empty", lambda *a, **k: fill(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: fill(real_like(*a, **k)))


def _levels(rows, K, device="cpu", extremes=True):
    """Random non-zero 8-bit levels in [-127, 127] with a +127 and a -127 run in them."""
    q = torch.randint(1, 128, (rows, K), device=device, dtype=torch.int16)
    q = torch.where(torch.rand(rows, K, device=device) < 0.5, q, -q)
    if extremes:
        q[0, : (K + 1) // 2] = 127
        q[-1, K // 3:] = -127
    return q.to(torch.int8)


def _reference(a, b, rs, cs, alpha):
    """The exact sum (float64, exact below 2**53) rounded once to fp32, then scaled in the
    kernel's (and reference.py's) epilogue order."""
    acc = (a.double() @ b.double().t()).float()
    row_vec, col_vec = rs.dim() == 1, cs.dim() == 1
    if row_vec or col_vec:
        return acc * (rs[:, None] if row_vec else rs) * ((cs[None, :] if col_vec else cs) * alpha)
    return acc * (rs * (cs * alpha))


def _fp32(x: int) -> float:
    """An integer as the fp32 it rounds to (the GEMM's fp32 output of an exact sum)."""
    return float(torch.tensor(x, dtype=torch.float64).float())


def _scales(M, N, row_vec, col_vec, device="cpu"):
    rs = torch.rand(M, device=device) + 0.1 if row_vec else torch.tensor(0.37, device=device)
    cs = torch.rand(N, device=device) + 0.1 if col_vec else torch.tensor(1.3, device=device)
    return rs, cs


# =============================================================================== pure Python


def test_default_chunk_cannot_wrap():
    for level_max, (qa, qb) in ((127, (127, 127)), (None, (128, 128)), (7, (7, 7)),
                                ((127, 7), (127, 7))):
        chunk = G.int8_k_chunk(level_max)
        assert chunk % 128 == 0 and chunk % 32 == 0            # a multiple of every BK
        # a chunk starts with acc in [0, 2**16) (the carry's remainder) and must stay < 2**31
        assert chunk * qa * qb + 2**16 - 1 <= 2**31 - 1
        assert (chunk + 128) * qa * qb + 2**16 - 1 > 2**31 - 1  # and is the longest such
    assert G.int8_k_chunk(127) * 127 * 127 < 2**31
    assert G.int8_k_chunk(127) == 133_120 and G.int8_k_chunk() == 130_944


def test_launcher_chunks_only_past_the_bound():
    for interp_mode in (False, True):
        assert G._k_chunk(LONG_K, 127, None, interp_mode) == G.int8_k_chunk(127)
        assert G._k_chunk(LONG_K, None, None, interp_mode) == G.int8_k_chunk()
        assert G._k_chunk(G.int8_k_chunk(127), 127, None, interp_mode) is None
        assert G._k_chunk(12_608, None, None, interp_mode) is None
        assert G._k_chunk(LONG_K, 7, None, interp_mode) is None        # 4-bit: never
        assert G._k_chunk(64, None, 64 if interp_mode else 128, interp_mode) is None
    assert G._k_chunk(100, None, 32, True) == 32
    assert G._k_chunk(300, None, 128, False) == 128
    for bad in (0, -32, 48, 200_000):                                  # unaligned / unsafe
        with pytest.raises(ValueError):
            G._k_chunk(300, None, bad, True)
    with pytest.raises(ValueError):
        G._k_chunk(300, None, 32, False)                               # compiled BK is 128
    with pytest.raises(ValueError):
        G.int8_k_chunk(129)


def test_chunk_override_attribute(monkeypatch):
    monkeypatch.setattr(G, "K_CHUNK_OVERRIDE", 64)
    assert G._k_chunk(100, None, None, True) == 64
    assert G._k_chunk(100, None, 96, True) == 96                       # the argument wins


@pytest.mark.parametrize("K,k_chunk", [(7, 8), (8, 8), (9, 8), (100, 8), (64, 16), (1000, 24)])
def test_reference_int_matmul_chunks_exact(K, k_chunk):
    torch.manual_seed(K)
    a, b = _levels(19, K), _levels(12, K).t()
    exact = (a.double() @ b.double()).float()
    assert torch.equal(R.int_matmul(a, b, k_chunk=k_chunk), exact)
    assert torch.equal(R.int_matmul(a, b), exact)


def test_reference_int_matmul_rejects_unsafe_chunks():
    a, b = _levels(4, 16), _levels(4, 16).t()
    for bad in (0, 12, 131_072):
        with pytest.raises(ValueError):
            R.int_matmul(a, b, k_chunk=bad)


# =============================================================================== CPU


@cpu
@pytest.mark.parametrize("M,N,K,k_chunk", [
    (37, 24, 50, 64),      # K < chunk: the plain loop
    (37, 24, 64, 64),      # K == chunk: the plain loop
    (37, 24, 65, 64),      # a 1-element second chunk
    (37, 24, 200, 64),     # 3 full chunks + a ragged one, K % BK != 0
    (33, 40, 256, 64),     # K % BK == 0 (EVEN_K), 4 chunks
    (5, 3, 100, 32),       # one BK step per chunk
    (64, 33, 301, 96),     # chunks of 3 steps, ragged tail
])
@pytest.mark.parametrize("row_vec,col_vec", [(True, True), (False, True), (True, False),
                                             (False, False)])
def test_chunked_kernel_exact(poison, M, N, K, k_chunk, row_vec, col_vec):
    torch.manual_seed(M * 1000 + K)
    a, b = _levels(M, K), _levels(N, K)
    rs, cs = _scales(M, N, row_vec, col_vec)
    ref = _reference(a, b, rs, cs, 1 / 16)
    for dtype in (torch.float32, torch.bfloat16):
        out = G.scaled_mm(a, b, rs, cs, 1 / 16, dtype, k_chunk=k_chunk)
        assert torch.equal(out, ref.to(dtype))
    # padded row strides (the HLA operand layout): only the first K columns count
    pad = lambda t: torch.nn.functional.pad(t, (0, (-K) % 16 + 16), value=127)
    assert torch.equal(G.scaled_mm(pad(a), pad(b), rs, cs, 1 / 16, torch.float32, k=K,
                                   k_chunk=k_chunk), ref)


@cpu
def test_chunked_kernel_negative_partials(poison):
    """Chunks whose partials are large and negative (-127 * 127 per product): the carry's
    floor split must hold for negative accumulators too."""
    M, N, K = 6, 5, 300
    a = torch.full((M, K), 127, dtype=torch.int8)
    b = torch.full((N, K), -127, dtype=torch.int8)
    b[1::2, ::3] = 127
    one = torch.tensor(1.0)
    out = G.scaled_mm(a, b, one, one, 1.0, torch.float32, k_chunk=32)
    assert torch.equal(out, _reference(a, b, one, one, 1.0))


@cpu
def test_long_k_default_chunk_interpreter(poison):
    """The launcher's own chunk at K = 140,000 (130,944 + a 9,056 tail), worst-case levels:
    all +127 rows against all +127 / alternating columns. Plain int32 would wrap to -2.04e9."""
    K = LONG_K
    a = torch.full((3, K), 127, dtype=torch.int8)
    a[1, ::2] = -127
    b = torch.full((4, K), 127, dtype=torch.int8)
    b[2] = -127
    b[3, ::7] = -1
    rs, cs = torch.tensor([1.0, 0.5, 2.0]), torch.tensor([1.0, 1.0, 3.0, 0.25])
    out = G.scaled_mm(a, b, rs, cs, 1.0, torch.float32)
    ref = _reference(a, b, rs, cs, 1.0)
    assert float(out[0, 0]) == _fp32(K * 127 * 127)                   # 2.26e9, no wrap
    assert torch.equal(out, ref)
    assert torch.equal(G.scaled_mm(a, b, rs, cs, 1.0, torch.float32, level_max=127), ref)


# =============================================================================== GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("K", [LONG_K, LONG_K + 37])               # EVEN_K and a ragged tail
def test_gpu_long_k_worst_case(K):
    M, N = 300, 200
    torch.manual_seed(0)
    a = _levels(M, K, device="cuda", extremes=False)
    b = _levels(N, K, device="cuda", extremes=False)
    a[:7] = 127                                                        # worst case: all +127
    b[:5] = 127
    b[5:9] = -127
    rs, cs = _scales(M, N, True, True, device="cuda")
    exact = a.double() @ b.double().t()
    assert float(exact[:7, :5].min()) >= 2**31                         # would wrap in int32
    ref64 = exact * rs.double()[:, None] * (cs.double()[None, :] / 16)
    out = G.scaled_mm(a, b, rs, cs, 1 / 16, torch.float32)
    err = (out.double() - ref64).abs()
    assert float(err.max() / ref64.abs().max()) < 1e-6
    assert float((err[:7, :9] / ref64[:7, :9].abs()).max()) < 1e-6     # the worst-case block
    assert torch.equal(out, _reference(a, b, rs, cs, 1 / 16))          # and in fact bit-exact
    one = torch.ones(M, device="cuda")
    acc = G.scaled_mm(a, b, one, torch.full((N,), 16.0, device="cuda"), 1 / 16, torch.float32)
    assert torch.equal(acc, exact.float())                             # fp32(exact sum)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("K,k_chunk", [(1000, 128), (4096, 256), (5000, 384)])
def test_gpu_forced_chunk_exact(K, k_chunk):
    M, N = 1000, 520
    torch.manual_seed(K)
    a, b = _levels(M, K, device="cuda"), _levels(N, K, device="cuda")
    rs, cs = _scales(M, N, True, True, device="cuda")
    ref = _reference(a, b, rs, cs, 1 / 16)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(G.scaled_mm(a, b, rs, cs, 1 / 16, dtype, k_chunk=k_chunk), ref.to(dtype))
        assert torch.equal(G.scaled_mm(a, b, rs, cs, 1 / 16, dtype), ref.to(dtype))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_reference_int_matmul_long_k():
    K = LONG_K                                                         # _int_mm path: K % 8 == 0
    a = torch.full((32, K), 127, dtype=torch.int8, device="cuda")
    b = torch.full((K, 16), 127, dtype=torch.int8, device="cuda")
    b[:, 8:] = _levels(8, K, device="cuda").t()
    exact = a.double() @ b.double()
    assert torch.equal(R.int_matmul(a, b), exact.float())
    assert float(R.int_matmul(a, b)[0, 0]) == _fp32(K * 127 * 127)
