"""The hot:: custom ops: registration checks (opcheck) and fake/real agreement."""
import pytest
import torch

from hotcompile.kernels import ops  # noqa: F401


def _checks(fmt: str) -> tuple:
    """opcheck's tests for a saved activation of ``fmt``: its schema test multiplies the
    tensors to detect mutation, which CPU cannot do in float8 (the fake and AOT tests run)."""
    both = ("test_faketensor", "test_aot_dispatch_static")
    return both if fmt == "e4m3" else ("test_schema",) + both


@pytest.mark.parametrize("fmt", ["int8", "e4m3"])
@pytest.mark.parametrize("L,O,I", [(48, 32, 24), (37, 40, 19)])
def test_opcheck(L, O, I, fmt):
    g, w, x = torch.randn(L, O), torch.randn(O, I), torch.randn(L, I)
    torch.library.opcheck(torch.ops.hot.hq_grad_input.default,
                          (g, w, 4, 4, 16, "token", "site", "reference"),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))
    xq, xs = torch.ops.hot.abc_compress(x, 8, 8, 16, 0, False, "reference", fmt)
    torch.library.opcheck(torch.ops.hot.abc_compress.default, (x, 8, 8, 16, 0, False, "reference", fmt),
                          test_utils=_checks(fmt) + ("test_autograd_registration",))
    torch.library.opcheck(torch.ops.hot.hla_grad_weight.default,
                          (g, xq, xs, 8, 8, 16, 0, False, "", "reference"), test_utils=_checks(fmt))
    assert xq.shape == ((L + 15) // 16 * 8, I)
    assert xq.dtype == (torch.int8 if fmt == "int8" else torch.float8_e4m3fn)
    assert torch.ops.hot.hla_grad_weight(g, xq, xs, 8, 8, 16, 0, False, "", "reference").shape == (O, I)


@pytest.mark.parametrize("fmt", ["int8", "e4m3"])
@pytest.mark.parametrize("L,O,I,seq_len", [(48, 32, 24, 0), (39, 40, 19, 13)])
def test_linear_backward_op(L, O, I, seq_len, fmt):
    """The one-op site backward: registration checks, and the same numbers as the two
    separate reference ops given the seed it draws (g_x from s, g_W from s + 1)."""
    torch.manual_seed(L)
    g, w, x = torch.randn(L, O), torch.randn(O, I), torch.randn(L, I)
    xq, xs = torch.ops.hot.abc_compress(x, 8, 8, 16, seq_len, False, "reference", fmt)
    args = (g, xq, xs, 8, 8, 16, seq_len, False, "", "reference", w, 4, 8, "token", "s")
    torch.library.opcheck(torch.ops.hot.linear_backward.default, args, test_utils=_checks(fmt))
    torch.manual_seed(7)
    seed = ops.draw_seed(torch.device("cpu"))
    torch.manual_seed(7)
    gx, gw = torch.ops.hot.linear_backward(*args)
    from hotcompile.kernels import reference as R
    assert torch.equal(gx, R.hq_grad_input(g, w, 4, True, seed, w_bits=8))
    assert torch.equal(gw, R.hla_grad_weight(g, xq, xs, 8, "1d", 8, seed + 1, seq_len=seq_len))
    assert gx.shape == (L, I) and gw.shape == (O, I)


@pytest.mark.parametrize("cap,dtype,e4m3", [((9, 0), torch.bfloat16, True),
                                           ((9, 0), torch.float32, False),
                                           ((8, 0), torch.bfloat16, False)])
def test_reference_twin_takes_the_fused_w_format(monkeypatch, cap, dtype, e4m3):
    """On a GPU the reference ops quantize W as the fused g_x does there: scaled e4m3 on the
    cuBLAS FP8 path (bf16 g with per-token scales, compute capability >= 8.9), integer
    levels elsewhere; in both ops that compute g_x. (A CPU tensor stands in for a CUDA one
    of capability ``cap``.)"""
    from hotcompile.kernels import reference as R
    monkeypatch.setattr(ops, "_cuda_capability", lambda t: cap)
    torch.manual_seed(5)
    g, w, x = (torch.randn(64, 48, dtype=dtype), torch.randn(48, 32, dtype=dtype),
               torch.randn(64, 32, dtype=dtype))
    seeds = torch.tensor([11, 12])
    want = R.hq_grad_input(g, w, 4, True, seeds[0], w_bits=8, w_e4m3=e4m3)
    other = R.hq_grad_input(g, w, 4, True, seeds[0], w_bits=8, w_e4m3=not e4m3)
    assert not torch.equal(want, other)
    got = torch.ops.hot.hq_grad_input(g, w, 4, 8, 16, "token", "s", "reference", seeds, 0)
    assert torch.equal(got, want)
    xq, xs = torch.ops.hot.abc_compress(x, 16, 8, 16, 0, False, "reference", "e4m3")
    gx, _ = torch.ops.hot.linear_backward(g, xq, xs, 16, 8, 16, 0, False, "", "reference", w, 4,
                                          8, "token", "s", seeds, 0)
    assert torch.equal(gx, want)
    # where the fused op falls back to the reference itself (block 8), integer W levels
    got8 = torch.ops.hot.hq_grad_input(g, w, 4, 8, 8, "token", "s", "reference", seeds, 0)
    assert torch.equal(got8, R.hq_grad_input(g, w, 4, True, seeds[0], 8, w_bits=8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_output_dtypes_follow_the_gradient(dtype):
    g, w, x = torch.randn(32, 32, dtype=dtype), torch.randn(32, 16, dtype=dtype), torch.randn(32, 16)
    assert torch.ops.hot.hq_grad_input(g, w, 4, 4, 16, "tensor", "s", "auto").dtype == dtype
    xq, xs = torch.ops.hot.abc_compress(x.to(dtype), 8, 8, 16, 0, False, "auto", "int8")
    assert torch.ops.hot.hla_grad_weight(g, xq, xs, 8, 8, 16, 0, False, "", "auto").dtype == dtype


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="kernels='triton'"):
        torch.ops.hot.hq_grad_input(torch.randn(32, 32), torch.randn(32, 16), 4, 4, 16, "token",
                                    "s", "triton")


def test_seeds_differ_per_rank_under_the_same_manual_seed(monkeypatch):
    draws = {}
    for rank in (0, 1, 2):
        monkeypatch.setattr(ops, "_rank", lambda r=rank: r)
        torch.manual_seed(0)
        draws[rank] = [int(ops.draw_seed(torch.device("cpu"))) for _ in range(4)]
    assert len({s for d in draws.values() for s in d}) == 12
    torch.manual_seed(0)
    monkeypatch.setattr(ops, "_rank", lambda: 1)
    assert [int(ops.draw_seed(torch.device("cpu"))) for _ in range(4)] == draws[1]


def test_draw_seeds_one_launch_for_a_graph(monkeypatch):
    """``hot::draw_seeds``: n seeds at once, offset per rank like ``draw_seed``'s; an op given
    ``seeds`` and ``seed_index`` uses that element (as if it had drawn it), and one given
    none still draws its own."""
    like = torch.empty(3)
    for rank in (0, 3):
        monkeypatch.setattr(ops, "_rank", lambda r=rank: r)
        torch.manual_seed(5)
        seeds = torch.ops.hot.draw_seeds(like, 4)
        torch.manual_seed(5)
        plain = torch.randint(0, ops._SEED_HIGH, (4,), dtype=torch.int64)
        offset = (rank * ops._RANK_STRIDE) % ops._SEED_HIGH
        assert seeds.dtype == torch.int64 and torch.equal(seeds, plain + offset)
    g, w = torch.randn(40, 32), torch.randn(32, 24)
    from hotcompile.kernels import reference as R
    got = torch.ops.hot.hq_grad_input(g, w, 4, 8, 16, "token", "s", "reference", seeds, 2)
    assert torch.equal(got, R.hq_grad_input(g, w, 4, True, seeds[2], w_bits=8))
    assert not torch.equal(got, R.hq_grad_input(g, w, 4, True, seeds[1], w_bits=8))
