"""passes/splice.py on CPU: the hot:: ops' fused bodies traced into a graph for Inductor.

CI has no GPU, so the graphs here hold fake CUDA tensors and Triton's mutation analysis
runs against a stand-in sm_90 target (TTIR needs no driver). What runs, and is bit-equal to
the ops, is checked on the GPU (tests/test_gpu_compiled.py)."""
from __future__ import annotations

import contextlib
import logging
import operator
import os

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.checkpoint import CheckpointPolicy

import hotcompile  # noqa: F401  registers torch.ops.hot.*
from hotcompile.passes import splice as SP

triton = pytest.importorskip("triton")
from hotcompile.kernels import gemm, hadamard  # noqa: E402  (triton present)

import interp  # noqa: E402

# wrap_triton traces JITFunctions only: an interpreted kernel (TRITON_INTERPRET=1 when the
# kernels module was imported, whatever triton.language was imported under) reruns in a child
_INTERPRETED = not isinstance(hadamard._hq_token_kernel, triton.runtime.jit.JITFunction) or \
    os.environ.get("TRITON_INTERPRET") == "1"
compiled = interp.compiled_mark(_INTERPRETED)
test_compiled_suite_in_subprocess = interp.compiled_subprocess_suite(__file__, _INTERPRETED)
WRAPPER = torch.ops.higher_order.triton_kernel_wrapper_functional
hot = torch.ops.hot


class _Hopper:
    """A Triton driver that only names its target: enough for TTIR (mutation analysis)."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget
        return GPUTarget("cuda", 90, 32)


@pytest.fixture
def hopper(monkeypatch):
    driver = triton.runtime.driver
    before = driver._active
    driver.set_active(_Hopper())
    monkeypatch.setattr(gemm, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(gemm, "sm_count", lambda index: 132)
    yield
    driver._active = before


def _fakes(mode, *shapes, dtype=torch.bfloat16, device="cuda"):
    with mode:
        return [torch.empty(s, device=device, dtype=dtype) for s in shapes]


def _site_graph(device="cuda", scale="token", measure="", fmt="e4m3", L=256, block=16):
    """A graph holding one site's ops as the rewrite inserts them: seeds, ABC, unit."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    g, x, w = _fakes(mode, (L, 512), (L, 384), (512, 384), device=device)

    def f(g, x, w):
        seeds = hot.draw_seeds(g, 1)
        xq, xs = hot.abc_compress(x, block, 8, block, 0, False, "auto", fmt)
        return hot.linear_backward(g, xq, xs, block, 8, block, 0, False, measure, "auto", w, 4, 8,
                                   scale, "k", seeds, 0)

    with mode:
        gm = make_fx(f, tracing_mode="fake")(g, x, w)
    for n in gm.graph.nodes:
        n.meta["partitioner_tag"] = "is_backward"
    return gm, mode


def _nodes(gm, targets):
    return [n for n in gm.graph.nodes if n.target in targets]


@compiled
def test_a_site_splices_into_kernel_nodes_with_the_ops_outputs(hopper):
    gm, mode = _site_graph()
    want = [tuple(n.meta["val"].shape) for n in gm.graph.output_node().args[0]]
    how = SP.splice_ops(gm.graph, _nodes(gm, SP.BODIES), mode)
    assert sorted(how.values()) == ["Inductor", "Inductor"], how
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    assert not _nodes(gm, SP.BODIES)
    assert len(_nodes(gm, {hot.draw_seeds.default})) == 1       # one per graph, kept
    kernels = _nodes(gm, {WRAPPER})
    # ABC 1 (its e4m3 scale from max |x|, a reduction Inductor compiles; its buffer
    # K-major: no transpose in backward); HQ g 1 (writing g's row maxima too); the bound 1
    # (their largest token-block sum); W 1 (its e4m3 scale from W's column maxima, a
    # reduction too); HLA g 1 (its scale from the bound); + 2 cuBLAS GEMMs
    assert len(kernels) == 5, [k.kwargs["kwargs"].keys() for k in kernels]
    maxima = _nodes(gm, {torch.ops.aten.amax.default})
    assert len(maxima) == 2, maxima       # of W's columns and of x
    assert len(_nodes(gm, {torch.ops.aten._scaled_mm.default})) == 2
    # what Inductor lowers the graph with: every op needs a lowering or, without one, no
    # decomposition (Inductor refuses a fallback for an op it expects decomposed)
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.lowering import lowerings
    decomps = select_decomp_table()
    for n in gm.graph.nodes:
        if isinstance(n.target, torch._ops.OpOverload):
            assert n.target in lowerings or n.target not in decomps, n.format_node()
    copies = [n for n in gm.graph.nodes if n.target is torch.ops.aten.copy_.default]
    assert not copies, "a spliced body must not write into its inputs"
    outs = gm.graph.output_node().args[0]
    assert [tuple(n.meta["val"].shape) for n in outs] == want
    for n in gm.graph.nodes:
        if n.op == "call_function":
            assert n.meta.get("partitioner_tag") == "is_backward", n.format_node()
            assert isinstance(n.meta.get("val"), (torch.Tensor, dict, tuple, list)) or \
                n.target is operator.getitem, n.format_node()


@compiled
@pytest.mark.parametrize("sum_first", [True, False], ids=["sum_before_site", "sum_after_site"])
@pytest.mark.parametrize("tag", ["is_backward", "is_forward"])
def test_a_backward_input_is_realized_once_for_every_reader(hopper, sum_first, tag):
    """g a pointwise result (GELU's backward in a model) that a site, the bias gradient's
    sum and a pointwise op read: in backward the sum reads the buffer the site's kernels
    read (put right after g, whichever of the two comes first), so Inductor does not
    recompute g inside the reduction; the pointwise reader keeps g (Inductor fuses it with
    the copy); outside backward the graph keeps its readers as they were."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    a, b, x, w = _fakes(mode, (256, 512), (256, 512), (256, 384), (512, 384))

    def f(a, b, x, w):
        g = a * b
        gb = g.sum(0) if sum_first else None
        seeds = hot.draw_seeds(g, 1)
        xq, xs = hot.abc_compress(x, 16, 8, 16, 0, False, "auto", "e4m3")
        outs = hot.linear_backward(g, xq, xs, 16, 8, 16, 0, False, "", "auto", w, 4, 8,
                                   "token", "k", seeds, 0)
        return (*outs, g.sum(0) if gb is None else gb, g * 2)

    with mode:
        gm = make_fx(f, tracing_mode="fake")(a, b, x, w)
    for n in gm.graph.nodes:
        n.meta["partitioner_tag"] = tag if n.name == "mul" else "is_backward"
    ops = _nodes(gm, {hot.linear_backward.default})
    assert SP.splice_ops(gm.graph, ops, mode)[ops[0]] == "Inductor"
    gm.graph.lint()
    g = _nodes(gm, {torch.ops.aten.mul.Tensor})[0]
    (total,) = _nodes(gm, {torch.ops.aten.sum.dim_IntList})
    (double,) = [n for n in _nodes(gm, {torch.ops.aten.mul.Tensor}) if n is not g]
    forced = [u for u in g.users if u.target is SP.FORCE_STRIDES]
    assert len(forced) == 1, list(g.users)
    assert double.args[0] is g
    if tag == "is_backward":
        assert g.next is forced[0] and set(g.users) == {forced[0], double}
        assert total.args[0] is forced[0]
        reads_g = [k.kwargs["kwargs"]["g_ptr"] for k in _nodes(gm, {WRAPPER})
                   if "g_ptr" in k.kwargs["kwargs"]]
        assert reads_g and all(r is forced[0] for r in reads_g), reads_g
    else:
        assert total.args[0] is g


@compiled
def test_launches_at_triton_defaults_record_bare_kernels(hopper):
    """A launch at Triton's default warps and stages is recorded as the bare JITFunction. A
    one-config autotuner (what naming ``num_warps`` makes of it) would have Inductor key the
    kernel's definition on the launch's scalars: one copy of it per layer shape."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    gm, mode = _site_graph()
    SP.splice_ops(gm.graph, _nodes(gm, SP.BODIES), mode)
    kernels = [kernel_side_table.get_kernel(n.kwargs["kernel_idx"])
               for n in _nodes(gm, {WRAPPER})]
    assert len(kernels) == 5
    assert all(isinstance(k, triton.runtime.jit.JITFunction) for k in kernels), kernels


@compiled
def test_the_forward_abc_keeps_its_save_policy(hopper):
    gm, mode = _site_graph()
    comp = _nodes(gm, {hot.abc_compress.default})[0]
    comp.meta.update(recompute=CheckpointPolicy.MUST_SAVE, partitioner_tag="is_forward")
    first = comp.prev
    SP.splice_ops(gm.graph, [comp], mode)
    n = first.next
    spliced = []
    while n.target is not hot.linear_backward.default:
        spliced.append(n)
        n = n.next
    assert spliced and all(s.meta["recompute"] is CheckpointPolicy.MUST_SAVE for s in spliced)
    assert all(s.meta["partitioner_tag"] == "is_forward" for s in spliced)


@compiled
def test_an_abc_handed_its_bound_reads_x_once(hopper):
    """``hot::abc_compress`` given max |x| (the FP8 forward cast's, ``passes/forward.py``)
    splices into its kernel alone: no reduction over x of its own (without the bound, one
    ``amax``: ``test_a_site_splices_into_kernel_nodes_with_the_ops_outputs``)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    x, = _fakes(mode, (256, 384))
    with mode:
        bound = torch.empty((1,), device="cuda", dtype=torch.int32)

    def f(x, bound):
        return hot.abc_compress(x, 16, 8, 16, 0, False, "auto", "e4m3", bound)

    with mode:
        gm = make_fx(f, tracing_mode="fake")(x, bound)
    for n in gm.graph.nodes:
        n.meta["partitioner_tag"] = "is_forward"
    how = SP.splice_ops(gm.graph, _nodes(gm, SP.BODIES), mode)
    assert list(how.values()) == ["Inductor"], how
    gm.graph.eliminate_dead_code()
    kernels = _nodes(gm, {WRAPPER})
    assert len(kernels) == 1
    assert not _nodes(gm, {torch.ops.aten.amax.default,
                           torch.ops.aten.linalg_vector_norm.default})
    reads = kernels[0].kwargs["kwargs"]["amax_ptr"]
    while reads.op != "placeholder":      # the bound, through the splice's layout pin
        reads = reads.args[0]
    assert reads is [n for n in gm.graph.nodes if n.op == "placeholder"][1]


@compiled
@pytest.mark.parametrize("case,reason", [
    ("lqs", "gx_scale='lqs'"),
    ("measure", "rank calibration"),
    ("cpu", "not on a CUDA device"),
    ("checkpointed", "activation-checkpointed"),
])
def test_run_time_choices_keep_the_op(hopper, case, reason):
    gm, mode = _site_graph(device="cpu" if case == "cpu" else "cuda",
                           scale="lqs" if case == "lqs" else "token",
                           measure="m" if case == "measure" else "")
    unit = _nodes(gm, {hot.linear_backward.default})[0]
    if case == "checkpointed":
        unit.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
    how = SP.splice_ops(gm.graph, [unit], mode)
    assert reason in how[unit]
    assert _nodes(gm, {hot.linear_backward.default}) == [unit]


@compiled
def test_dynamic_shapes_keep_the_op(hopper):
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=True)
    tokens = env.create_symintnode(env.create_symbol(256, ConstantSource("L")), hint=256)
    with mode:
        g = torch.empty((tokens, 512), device="cuda", dtype=torch.bfloat16)
        w = torch.empty((512, 384), device="cuda", dtype=torch.bfloat16)
    graph = torch.fx.Graph()
    gn, wn = graph.placeholder("g"), graph.placeholder("w")
    gn.meta["val"], wn.meta["val"] = g, w
    node = graph.call_function(hot.hq_grad_input.default, (gn, wn, 4, 8, 16, "token", "k", "auto"))
    node.meta["val"] = g.new_empty((tokens, 384))
    graph.output(node)
    assert SP.refusal(node) == "dynamic shapes (tiles and grids are chosen from sizes)"


@compiled
def test_a_body_whose_kernels_cannot_be_analysed_stays_an_op(hopper, caplog, monkeypatch):
    """Without a target Triton's mutation analysis fails and torch assumes every input is
    written; functionalisation would copy inputs back: the op stays. (Kernels without
    declared writes: a declaration would answer in place of the analysis under torch 2.11.)"""
    from hotcompile.passes import kernel_access as KA
    monkeypatch.setattr(KA, "CHECK_DECLARED", False)
    monkeypatch.setattr(KA, "declared_writes", lambda kernel, kwargs: None)
    gm, mode = _site_graph()
    unit = _nodes(gm, {hot.linear_backward.default})[0]

    class _NoTarget:
        def get_current_target(self):
            raise RuntimeError("no target")

    triton.runtime.driver.set_active(_NoTarget())
    with caplog.at_level(logging.ERROR):
        how = SP.splice_ops(gm.graph, [unit], mode)
    assert "writes into its inputs" in how[unit], how
    assert _nodes(gm, {hot.linear_backward.default}) == [unit]


@compiled
def test_a_body_without_fused_kernels_stays_an_op(hopper, monkeypatch):
    """A body that falls back to the reference twin (aten ops only) is not spliced: Inductor
    could re-associate its float math and the op would no longer be the reference."""
    gm, mode = _site_graph()
    unit = _nodes(gm, {hot.linear_backward.default})[0]

    def reference_like(g, xq, xs, *rest):
        w = rest[7]
        return g.float().mm(w.float()).to(g.dtype), g.t().float().mm(xq.float()).to(g.dtype)

    monkeypatch.setitem(SP.BODIES, hot.linear_backward.default, reference_like)
    how = SP.splice_ops(gm.graph, [unit], mode)
    assert "no fused kernel" in how[unit], how
    assert _nodes(gm, {hot.linear_backward.default}) == [unit]


def _sites(*site_shapes):
    """A graph of several sites' ops as the rewrite inserts them ((g, x, w) shapes each)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    ins = _fakes(mode, *[shape for shapes in site_shapes for shape in shapes])
    n = len(site_shapes)

    def f(*a):
        seeds = hot.draw_seeds(a[0], 2 * n)
        outs = []
        for i in range(n):
            g, x, w = a[3 * i:3 * i + 3]
            xq, xs = hot.abc_compress(x, 16, 8, 16, 0, False, "auto", "e4m3")
            outs += hot.linear_backward(g, xq, xs, 16, 8, 16, 0, False, "", "auto", w, 4, 8,
                                        "token", "k", seeds, 2 * i)
        return outs

    with mode:
        gm = make_fx(f, tracing_mode="fake")(*ins)
    return gm, mode


def _spliced_as_unmemoized(gm, site_shapes) -> bool:
    """Whether ``gm`` (spliced with the memo) is the graph the same sites splice into with
    every launch analysed anew."""
    from hotcompile.passes import kernel_access as KA
    gm2, mode2 = _sites(*site_shapes)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(KA, "memoized_kernel_access", __import__("contextlib").nullcontext)
        mp.setattr(SP, "memoized_kernel_access", __import__("contextlib").nullcontext)
        SP.splice_ops(gm2.graph, _nodes(gm2, SP.BODIES), mode2)
    shape = lambda g: [(n.op, str(n.target), sorted(n.kwargs.get("kwargs", {}))   # noqa: E731
                        if n.target is WRAPPER else None) for n in g.graph.nodes]
    return shape(gm) == shape(gm2)


@compiled
def test_repeated_launches_are_analysed_once_per_compile(hopper):
    """Sites repeat the same launches: Triton's mutation analysis (a TTIR generation each)
    runs once per distinct launch while the memo is installed, and the spliced graph is the
    one the unmemoized analysis gives. Outside a compile torch's own function is back."""
    from torch._higher_order_ops import triton_kernel_wrap as twrap
    from hotcompile.passes import kernel_access as KA
    like = ((256, 512), (256, 384), (512, 384))
    original = twrap.identify_accessed_tensors
    gm, mode = _sites(like, like)
    before = dict(KA.STATS)
    SP.splice_ops(gm.graph, _nodes(gm, SP.BODIES), mode)
    assert twrap.identify_accessed_tensors is original and not KA._MEMO
    misses = KA.STATS["misses"] - before["misses"]
    hits = KA.STATS["hits"] - before["hits"]
    assert (misses, hits) == (5, 5), (misses, hits)     # 5 launches per site, 2 like sites
    assert _spliced_as_unmemoized(gm, (like, like))


@compiled
def test_widths_that_specialise_alike_share_one_analysis(hopper):
    """Two sites whose widths Triton specialises alike (16 divides both) share most of their
    launches' analyses, and the spliced graph is the one the unmemoized analysis gives."""
    from hotcompile.passes import kernel_access as KA
    sites = (((256, 512), (256, 384), (512, 384)), ((256, 1024), (256, 768), (1024, 768)))
    gm, mode = _sites(*sites)
    before = dict(KA.STATS)
    SP.splice_ops(gm.graph, _nodes(gm, SP.BODIES), mode)
    misses = KA.STATS["misses"] - before["misses"]
    assert misses < 10, misses                      # 5 launches per site
    assert _spliced_as_unmemoized(gm, sites)


@compiled
def test_runtime_integers_are_keyed_by_their_specialisation():
    """A runtime integer is keyed by what Triton keeps of it (type by range, == 1, divisible
    by 16), a constexpr by its value; a kernel without known parameters keys every value."""
    from hotcompile.kernels import hla
    from hotcompile.passes import kernel_access as KA
    k = hla._hla_kernel
    base = {"x_ptr": torch.empty(2, dtype=torch.bfloat16), "C": 4096, "BC": 256}
    key = lambda **kw: KA._key(k, {**base, **kw}, None)        # noqa: E731
    assert key(C=11008) == key() != key(C=4104)                 # 16 divides 4096 and 11008
    assert key(C=1) != key(C=17) and key(C=2 ** 31) != key(C=2 ** 31 - 16)
    assert key(BC=512) != key()                                 # a constexpr: by value
    assert KA._key(len, {"C": 4096}, None) != KA._key(len, {"C": 11008}, None)


def test_unkeyable_launches_go_to_the_original_analysis():
    """A symbolic size (or any argument the memo cannot describe) is never keyed."""
    from hotcompile.passes import kernel_access as KA

    class _Sym:
        pass

    assert KA._key(object(), {"n": _Sym()}, None) is None
    assert KA._key(len, {"x": torch.empty(2, dtype=torch.bfloat16), "B": 4}, None) == \
        (len, (("B", "int", 4), ("x", "tensor", torch.bfloat16)), "")


@pytest.mark.parametrize("check", [False, True])
def test_a_writes_only_analysis_is_answered_from_the_declaration(monkeypatch, check):
    """Where torch's analysis answers with the written names alone (torch 2.11's
    ``identify_mutated_tensors -> list[str]``), a launch of a kernel that declares its writes
    gets the declaration without any analysis (no TTIR); a kernel without one, or a launch
    the declaration cannot read, is analysed; with ``CHECK_DECLARED`` every declared launch
    is analysed too and a differing declaration raises. Outside the block, torch's own."""
    from torch._higher_order_ops import triton_kernel_wrap as twrap
    from hotcompile.kernels import hadamard, hla
    from hotcompile.passes import kernel_access as KA
    calls = []

    def identify_mutated_tensors(kernel, kwargs, tma_descriptor_metadata) -> "list[str]":
        calls.append(kernel)
        return ["q_ptr", "s_ptr"]

    monkeypatch.delattr(twrap, "identify_accessed_tensors", raising=False)
    monkeypatch.setattr(twrap, "identify_mutated_tensors", identify_mutated_tensors,
                        raising=False)
    monkeypatch.setattr(KA, "CHECK_DECLARED", check)
    t = torch.empty(4)
    phase2 = {"x_ptr": t, "q_ptr": t, "s_ptr": t, "amax_ptr": t, "seed_ptr": t, "PHASE": 2,
              "C": 4096}
    with KA.memoized_kernel_access():
        got = twrap.identify_mutated_tensors(hla._hla_kernel, phase2, {})
        assert got == ["q_ptr", "s_ptr"] and calls == ([hla._hla_kernel] if check else [])
        if check:
            with pytest.raises(AssertionError, match="declared writes"):
                twrap.identify_mutated_tensors(hla._hla_kernel, {**phase2, "PHASE": 1}, {})
            assert len(KA.MISMATCHES) == 1          # and recorded for the tests' fixture
            KA.MISMATCHES.clear()
        else:
            assert twrap.identify_mutated_tensors(
                hla._hla_kernel, {**phase2, "PHASE": 1}, {}) == ["amax_ptr"]
            assert calls == []
        calls.clear()
        twrap.identify_mutated_tensors(hadamard._hq_tensor_kernel, phase2, {})   # undeclared
        twrap.identify_mutated_tensors(hla._hla_kernel, {"x_ptr": t}, {})        # unreadable
        assert calls == [hadamard._hq_tensor_kernel, hla._hla_kernel]
    assert twrap.identify_mutated_tensors is identify_mutated_tensors
    assert not KA._WRITES_ONLY


@compiled
@pytest.mark.parametrize("forward", ["bf16", "fp8", "fp8_rowwise"])
def test_a_weight_cast_and_its_operands_splice_into_the_sites_kernels(hopper, forward):
    """``hot::weight_cast`` (the forward's W copy and its column maxima, with row maxima for
    a row-wise FP8 forward, in place of autocast's cast) and ``hot::weight_operands`` after
    it (HQ's scaled-e4m3 W, and under an FP8 forward that forward's W operand, from one
    read of the copy) splice into one kernel node each: the W kernel reads the cast
    kernel's maxima, the site's op, given W's operand (``w_q``, ``w_s``, as
    passes/weight_cast.py gives them), splices without a W kernel of its own, and no
    reduction over W is left (only x's maximum; tensor-wise, the max of W's column maxima)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    g, x = _fakes(mode, (256, 512), (256, 384))
    (p,) = _fakes(mode, (512, 384), dtype=torch.float32)
    rows = forward == "fp8_rowwise"

    def f(g, x, p):
        w, col_max, row_max = hot.weight_cast(p, torch.bfloat16, "auto", rows)
        fwd_max = row_max if rows else col_max if forward == "fp8" else None
        w_q, w_s, f_q, f_s = hot.weight_operands(w, col_max, fwd_max, forward, "auto")
        seeds = hot.draw_seeds(g, 1)
        xq, xs = hot.abc_compress(x, 16, 8, 16, 0, False, "auto", "e4m3")
        return f_q, f_s, hot.linear_backward(g, xq, xs, 16, 8, 16, 0, False, "", "auto", w,
                                             4, 8, "token", "k", seeds, 0, w_q=w_q, w_s=w_s)

    with mode:
        gm = make_fx(f, tracing_mode="fake")(g, x, p)
    for n in gm.graph.nodes:
        n.meta["partitioner_tag"] = "is_backward"
    want = [n.meta["val"] for n in gm.graph.output_node().args[0][:2]]
    how = SP.splice_ops(gm.graph, _nodes(gm, SP.BODIES), mode)
    assert sorted(how.values()) == ["Inductor"] * 4, how
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    kernels = _nodes(gm, {WRAPPER})
    names = sorted(_kernel_name(k) for k in kernels)
    assert names.count("_weight_cast_kernel") == 1 and names.count("_weight_operands_kernel") == 1
    assert "_hq_weight_kernel" not in names     # the site's op makes no W operand of its own
    cast = next(k for k in kernels if _kernel_name(k) == "_weight_cast_kernel")
    wk = next(k for k in kernels if _kernel_name(k) == "_weight_operands_kernel")
    src = wk.kwargs["kwargs"]["a0"]             # the W kernel's maxima: the cast kernel's
    while src.target is not WRAPPER:
        src = src.args[0]
    assert src is cast
    if forward == "bf16":
        assert want[0].numel() == 0
    else:
        fq, fs = gm.graph.output_node().args[0][:2]
        while fq.target is not WRAPPER:
            fq = fq.args[0]
        assert fq is wk                          # the forward's operand: the W kernel's
        for got, w in zip(gm.graph.output_node().args[0][:2], want):
            v = got.meta["val"]
            assert v.shape == w.shape and v.stride() == w.stride() and v.dtype == w.dtype
    amaxes = _nodes(gm, {torch.ops.aten.amax.default})
    assert len(amaxes) == 1 + (forward == "fp8")     # x's (and the column maxima's max)


def _kernel_name(node) -> str:
    """The Triton kernel a ``triton_kernel_wrapper_functional`` node launches."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    k = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
    return getattr(k, "__name__", None) or k.fn.__name__


def _weights_graph(shapes, rows, devices=None):
    """A forward holding one ``hot::weight_cast`` and one ``hot::weight_operands`` per weight
    (fp32 parameters of ``shapes`` on ``devices``, row maxima where ``rows[i]``), in the
    rewrite's order: each weight's cast, then its operands, then a use of them (the forward
    GEMM's place)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    devices = devices or ["cuda"] * len(shapes)
    ps = [_fakes(mode, s, dtype=torch.float32, device=d)[0] for s, d in zip(shapes, devices)]

    def f(*ps):
        outs = []
        for p, r in zip(ps, rows):
            w, col_max, row_max = hot.weight_cast(p, torch.bfloat16, "auto", r)
            q, s, fq, fs = hot.weight_operands(w, col_max, row_max if r else None,
                                               "fp8_rowwise" if r else "bf16", "auto")
            outs += [q.float().sum() + s.sum(), fq, fs]
        return outs

    with mode:
        gm = make_fx(f, tracing_mode="fake")(*ps)
    for n in gm.graph.nodes:
        n.meta["partitioner_tag"] = "is_forward"
    return gm, mode


@compiled
def test_a_layers_weights_take_one_launch_of_each_w_kernel(hopper, monkeypatch):
    """Consecutive W ops of one configuration splice as one body each kind: three weights'
    casts are one ``_weight_cast_kernel`` node and their operands one
    ``_weight_operands_kernel`` node, every op's outputs where its users read them (shapes,
    strides, dtypes as the ops'), and only the used slots' outputs counted as written (a
    slot past N repeats slot 0's tensors: counted written, it came back from the functional
    node as an untouched clone of slot 0's output). A weight of another configuration (no
    row maxima) or device, or past ``GROUP_ELEMENTS``, starts a group of its own."""
    shapes = [(512, 384), (384, 512), (256, 384), (512, 384)]

    def splice(rows, devices=None):
        gm, mode = _weights_graph(shapes, rows, devices)
        want = [(tuple(n.meta["val"].shape), n.meta["val"].stride(), n.meta["val"].dtype)
                for n in gm.graph.output_node().args[0]]
        how = SP.splice_ops(gm.graph, _nodes(gm, SP.BODIES), mode)
        assert set(how.values()) == {"Inductor"} and len(how) == 8, how
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        got = [(tuple(n.meta["val"].shape), n.meta["val"].stride(), n.meta["val"].dtype)
               for n in gm.graph.output_node().args[0]]
        assert got == want
        assert not _nodes(gm, SP.BODIES)
        kernels = _nodes(gm, {WRAPPER})
        for k in kernels:       # only the used slots' outputs are written (cloned)
            n, name = k.kwargs["kwargs"]["N"], _kernel_name(k)
            kw = k.kwargs["kwargs"]
            roles = (("w", "c") + ("r",) * kw["ROW_MAX"] if name == "_weight_cast_kernel"
                     else ("q", "s") + ("f", "fs") * (kw["FWD"] != 0))
            assert sorted(k.kwargs["tensors_to_clone"]) == sorted(
                f"{r}{i}" for r in roles for i in range(n)), (name, k.kwargs["tensors_to_clone"])
        return [(_kernel_name(k), k.kwargs["kwargs"]["N"]) for k in kernels]

    assert splice([True] * 4) == [("_weight_cast_kernel", 4), ("_weight_operands_kernel", 4)]
    cast, operands = "_weight_cast_kernel", "_weight_operands_kernel"     # in graph order:
    assert splice([True, True, False, True]) == [(cast, 2), (operands, 2), (cast, 1),
                                                 (operands, 1), (cast, 1), (operands, 1)]
    assert splice([True] * 4, ["cuda:0", "cuda:0", "cuda:1", "cuda:1"]) == [
        (cast, 2), (operands, 2), (cast, 2), (operands, 2)]     # one launch, one device
    monkeypatch.setattr(SP, "GROUP_ELEMENTS", 2 * 512 * 384)
    assert splice([True] * 4) == [(cast, 2), (operands, 2), (cast, 2), (operands, 2)]


@compiled
@pytest.mark.parametrize("fmt", ["e4m3", "int8"])
@pytest.mark.parametrize("scale", ["token", "tensor"])
def test_declared_writes_are_what_tritons_analysis_finds(hopper, monkeypatch, fmt, scale):
    """Every launch of a kernel that declares its writes (``launch.declare_writes``, which
    stands in for Triton's mutation analysis under torch 2.11) is analysed too in the tests
    (``kernel_access.CHECK_DECLARED``) and must agree: a site's kernels across formats and
    scales, both phases where a kernel has two, and a layer's W kernels in groups of 1-4
    weights with and without row maxima. A disagreement raises inside the trace, so the op
    would stay unspliced: every op here must splice."""
    from hotcompile.kernels.launch import declared_writes
    from hotcompile.passes import kernel_access as KA
    assert KA.CHECK_DECLARED
    checked = []
    real = KA._check

    def spy(kernel, kwargs, declared, result):
        real(kernel, kwargs, declared, result)
        checked.append(getattr(kernel, "fn", kernel).__name__)

    monkeypatch.setattr(KA, "_check", spy)
    gm, mode = _site_graph(scale=scale, fmt=fmt)
    how = SP.splice_ops(gm.graph, _nodes(gm, SP.BODIES), mode)
    assert set(how.values()) == {"Inductor"}, how
    for rows in ([True], [False], [True, False, True, True]):
        gm, mode = _weights_graph([(512, 384)] * len(rows), rows)
        how = SP.splice_ops(gm.graph, _nodes(gm, SP.BODIES), mode)
        assert set(how.values()) == {"Inductor"}, how
    assert {"_hla_kernel", "_weight_cast_kernel", "_weight_operands_kernel"} <= set(checked), \
        checked
    assert declared_writes(object(), {}) is None


def _analysed_writes(kernel, kwargs):
    """Triton's mutation analysis of one launch (this torch's), its written tensors. A
    launch leaving a parameter to its default is refused: torch's analysis would report
    every tensor written (the forty-third stop's failure, when ``PAIRS`` was added)."""
    from torch._higher_order_ops import triton_kernel_wrap as twrap
    from hotcompile.kernels.launch import unpassed_parameters
    from hotcompile.passes import kernel_access as KA
    missing = unpassed_parameters(kernel, 0, kwargs)
    assert not missing, (kernel.fn.__name__, "launch leaves out", missing)
    analyse = getattr(twrap, "identify_accessed_tensors", None) or twrap.identify_mutated_tensors
    return sorted(n for n in KA.written_names(analyse(kernel, kwargs, {}))
                  if isinstance(kwargs.get(n), torch.Tensor))


def _declared_launches():
    """``(kernel, kwargs)`` over every constexpr combination that decides a declared kernel's
    stores, with the aliasing its launchers use (unused slots: slot 0's read-only input;
    an unused ``m_ptr`` / ``seed_ptr``: another argument)."""
    import itertools
    import triton.language as tl
    from hotcompile.kernels import hla
    H = hadamard
    f32, i32, i64, bf16, i8 = torch.float32, torch.int32, torch.int64, torch.bfloat16, torch.int8
    e4 = torch.float8_e4m3fn
    T = lambda dt: torch.empty(4, dtype=dt)          # noqa: E731
    for row_max, plain, chunks, fp8 in itertools.product([False, True], [False, True],
                                                          [0, 1, 3], [False, True]):
        yield H._hq_token_kernel, dict(
            g_ptr=T(bf16), q_ptr=T(e4 if fp8 or plain else i8), s_ptr=T(f32), seed_ptr=T(i64),
            m_ptr=T(f32), z_ptr=T(i32), L=256, O=512, O_pad=512, stride_g=512, ldq=512,
            groups_per_row=32, BR=16, BC={0: 64, 1: 512, 3: 256}[chunks], CHUNKS=chunks,
            Q=448 if plain else 7, FP8=fp8, INTERPRET=False, ROW_MAX=row_max, PLAIN=plain)
    for phase, e4m3, rotate, fp8, rnd in itertools.product([1, 2], [False, True], [False, True],
                                                           [False, True], [None, tl.bfloat16]):
        if rotate or e4m3:
            yield H._hq_weight_kernel, dict(
                w_ptr=T(f32), q_ptr=T(e4 if e4m3 or fp8 else i8), s_ptr=T(f32), amax_ptr=T(i32),
                scale_mul=1.0, O=512, I=384, O_pad=512, stride_wo=384, stride_wi=1, ldq=512,
                PHASE=phase, BI=64, BO=128, Q=28 if e4m3 else 7, FP8=fp8, E4M3=e4m3,
                INTERPRET=False, ROUND=rnd, ROTATE=rotate)
    for n, fwd, rotate in itertools.product([1, 2, 8], [0, 1, 2], [False, True]):
        kw = {}
        for k in range(8):
            kw.update({f"w{k}": T(bf16), f"q{k}": T(e4), f"s{k}": T(f32), f"a{k}": T(i32),
                       f"f{k}": T(e4 if fwd else bf16), f"fs{k}": T(f32 if fwd else bf16),
                       f"fm{k}": T(i32 if fwd else bf16), f"O{k}": 512, f"I{k}": 384,
                       f"e{k}": 100 * (k + 1)})
        for k in range(n, 8):
            kw.update({f"{r}{k}": kw["w0"] for r in ("w", "q", "s", "a", "f", "fs", "fm")})
        yield H._weight_operands_kernel, dict(kw, scale_mul=1.0, N=n, BI=128, BO=64,
                                              Q=28 if rotate else 448, INTERPRET=False,
                                              FWD=fwd, ROTATE=rotate)
    for n, row_max, bf in itertools.product([1, 2, 8], [False, True], [False, True]):
        kw = {}
        for k in range(8):
            p = T(f32)
            kw.update({f"p{k}": p, f"w{k}": T(bf16 if bf else torch.float16), f"c{k}": T(i32),
                       f"r{k}": T(i32) if row_max else p, f"O{k}": 512, f"I{k}": 384,
                       f"sp{k}": 384, f"si{k}": 1, f"e{k}": 100 * (k + 1)})
        for k in range(n, 8):
            kw.update({f"{r}{k}": kw["p0"] for r in ("p", "w", "c", "r")})
        yield H._weight_cast_kernel, dict(kw, N=n, ROWS=128, BO=128, BI=64, BF16=bf,
                                          ROW_MAX=row_max)
    for phase, e4m3, stoch, trans, bound, flat, step, pairs in itertools.product(
            [1, 2], [False, True], [False, True], [False, True], [False, True], [False, True],
            [0, 2], [False, True]):
        if (bound and not (e4m3 and not stoch)) or (e4m3 and phase == 1) or \
                (step and not (e4m3 and stoch)) or \
                (pairs and not (trans and (e4m3 or not stoch))):    # hla.tile_plan's
            continue
        amax = T(i32)
        yield hla._hla_kernel, dict(
            x_ptr=T(bf16), q_ptr=T(e4 if e4m3 else i8), s_ptr=T(f32), amax_ptr=amax,
            seed_ptr=T(i64) if stoch else amax, seed_add=0, scale_mul=1.0, S=256, n_sblk=16,
            stride_b=4096, stride_s=16, C=512, stride_x=512, ldq=512, n_blk=16,
            groups_per_row=32, PHASE=phase, BT=4, BC=2 * (32 // (step or 4)) * 4 if pairs
            else 64, RP=16, RANK=16, KEPT=0, Q=7, STOCHASTIC=stoch, TRANSPOSED=trans,
            INTERPRET=False, E4M3=e4m3, CPT=1, FLAT=flat, EVEN_C=True, BOUND=bound, STEP=step,
            PAIRS=pairs, ROW_STRIDE=512 if pairs else 0)
    yield hla._block_bound_kernel, dict(m_ptr=T(f32), out_ptr=T(i32), S=256, n_sblk=16,
                                        stride_b=4096, stride_s=16, n_blk=16, BB=64)


@contextlib.contextmanager
def _scalars_as_constexprs(kernel, kwargs):
    """Every scalar argument of ``kernel`` taken for a constexpr while the block runs: how
    torch 2.11's mutation analysis builds a launch's TTIR (torch 2.13 keeps them run-time
    values). ``KernelParam.is_constexpr`` is a cached property, shadowed here per instance."""
    params = [p for p in kernel.params
              if not p.is_constexpr and not isinstance(kwargs.get(p.name), torch.Tensor)]
    for p in params:
        p.__dict__["is_constexpr"] = True
    try:
        yield
    finally:
        for p in params:
            del p.__dict__["is_constexpr"]


@compiled
@pytest.mark.parametrize("as_211", [False, True], ids=["this_torch", "scalars_as_constexprs"])
def test_every_declared_kernel_variant_writes_what_tritons_analysis_finds(hopper, as_211):
    """Each declared kernel over every combination of the constexprs that decide its stores
    (slots 1, 2 and 8; each forward kind; both phases; rotation, plain and e4m3 forms;
    stochastic, transposed, bound, flat, stepped and word-pair HLA tiles), against this torch's
    analysis: the declaration the splice relies on under torch 2.11 is exactly right, not
    just on the launches the other tests happen to record. ``as_211``: analysed as torch 2.11
    does, every scalar argument a constexpr (``_scalars_as_constexprs``): a kernel that calls
    a tensor method on a scalar argument (``(stride // 2).to(tl.int64)``) builds under this
    torch's analysis and fails under 2.11's, which then takes every pointer for written. That
    passed the CPU suite and failed every spliced GPU test (forty-fifth stop)."""
    from hotcompile.kernels.launch import declared_writes
    seen, bad = set(), []
    for kernel, kwargs in _declared_launches():
        seen.add(kernel.fn.__name__)
        with _scalars_as_constexprs(kernel, kwargs) if as_211 else contextlib.nullcontext():
            got = _analysed_writes(kernel, kwargs)
        declared = sorted(declared_writes(kernel, kwargs))
        if declared != got:
            consts = {k: v for k, v in kwargs.items() if k.isupper()}
            bad.append((kernel.fn.__name__, consts, declared, got))
    assert not bad, bad
    assert seen == {"_hq_token_kernel", "_hq_weight_kernel", "_weight_operands_kernel",
                    "_weight_cast_kernel", "_hla_kernel", "_block_bound_kernel"}


def _undeclared_launches():
    """``(kernel, kwargs)`` of the kernels that declare no writes (the INT8 GEMM and its
    transpose, per-tensor HQ, the one-read g kernel of ``grad_out``) over the constexprs
    that shape their code: torch's analysis decides their writes wherever they are spliced."""
    import itertools
    from hotcompile.kernels import grad_out
    f32, i32, i64, bf16, i8 = torch.float32, torch.int32, torch.int64, torch.bfloat16, torch.int8
    e4 = torch.float8_e4m3fn
    T = lambda dt: torch.empty(4, dtype=dt)          # noqa: E731
    for rv, cv, fp8, exact, chunked in itertools.product(*[[False, True]] * 5):
        if fp8 and chunked:                          # refused by the kernel's static_assert
            continue
        yield gemm._scaled_mm_kernel, dict(
            a_ptr=T(e4 if fp8 else i8), bt_ptr=T(e4 if fp8 else i8), out_ptr=T(bf16),
            rs_ptr=T(f32), cs_ptr=T(f32), alpha=1.0, M=256, N=256, K=256, lda=256, ldb=256,
            ldo=256, ROW_VEC=rv, COL_VEC=cv, FP8=fp8, EXACT_ACC=exact, EVEN_K=True, BM=64,
            BN=64, BK=64, GROUP_M=8, CHUNKED=chunked, K_CHUNK=128 if chunked else 0)
    yield gemm._transpose_kernel, dict(src_ptr=T(i8), dst_ptr=T(i8), R=256, C=256, lds=256,
                                       ldd=256, BR=64, BC=64)
    for phase, fp8 in itertools.product([1, 2], [False, True]):
        yield hadamard._hq_tensor_kernel, dict(
            g_ptr=T(bf16), q_ptr=T(e4 if fp8 else i8), s_ptr=T(f32), amax_ptr=T(i32),
            seed_ptr=T(i64), L=256, O=512, O_pad=512, stride_g=512, ldq=512, groups_per_row=32,
            PHASE=phase, BR=8, BC=512, Q=7, FP8=fp8, INTERPRET=False)
    for phase, per_token, fp8 in itertools.product([1, 2], [False, True], [False, True]):
        yield grad_out._grad_out_kernel, dict(
            g_ptr=T(bf16), hq_ptr=T(e4 if fp8 else i8), hq_s_ptr=T(f32), hla_ptr=T(i8),
            hla_s_ptr=T(f32), amax_ptr=T(i32), hq_seed_ptr=T(i64), hla_seed_ptr=T(i64),
            hla_seed_add=0, L=256, O=512, O_pad=512, stride_g=512, ld_hla=256, S=256,
            n_sblk=16, stride_b=4096, stride_s=16, n_blk=16, hq_groups=32, hla_groups=32,
            PHASE=phase, PER_TOKEN=per_token, BT=4, BC=64, HR=16, RP=16, RANK=16, KEPT=0,
            HQ_Q=7, HLA_Q=127, FP8=fp8, INTERPRET=False)


@compiled
def test_undeclared_kernels_are_analysed_alike_with_scalars_as_constexprs(hopper):
    """The kernels without a declaration, analysed both ways: torch 2.11's analysis (every
    scalar a constexpr) finds the same written tensors as this torch's. Where it could not
    build the TTIR it would report every pointer written, and a spliced graph would copy
    each of them for nothing."""
    bad, seen = [], set()
    for kernel, kwargs in _undeclared_launches():
        seen.add(kernel.fn.__name__)
        plain = _analysed_writes(kernel, kwargs)
        with _scalars_as_constexprs(kernel, kwargs):
            as_211 = _analysed_writes(kernel, kwargs)
        if plain != as_211 or len(plain) == sum(isinstance(v, torch.Tensor) for v in kwargs.values()):
            bad.append((kernel.fn.__name__, {k: v for k, v in kwargs.items() if k.isupper()},
                        plain, as_211))
    assert not bad, bad
    assert seen == {"_scaled_mm_kernel", "_transpose_kernel", "_hq_tensor_kernel",
                    "_grad_out_kernel"}


def test_a_declaration_naming_no_parameter_is_refused():
    """A misspelt name in a declaration would drop a written tensor (a wrong gradient): it
    raises, and the memo then analyses the launch instead."""
    from hotcompile.kernels import hla, launch
    from hotcompile.passes import kernel_access as KA
    real = launch._WRITES[hla._block_bound_kernel]
    try:
        launch.declare_writes(hla._block_bound_kernel, lambda a: ("out",))
        with pytest.raises(ValueError, match="not its parameters"):
            launch.declared_writes(hla._block_bound_kernel, {})
        assert KA._declared(hla._block_bound_kernel, {}, None) is None
    finally:
        launch.declare_writes(hla._block_bound_kernel, real)


def _decomposed_site(traceless: bool, clone: bool):
    """A spliced site after Inductor's reinplacing and kernel decomposition passes, with
    HOT's traceless decomposition or without it; with ``clone``, one of its kernels' written
    buffers is also a graph output (so that kernel must clone it). The kernel nodes carry a
    stack trace and module stack, as a model's do."""
    from hotcompile.kernel_nodes import traceless_kernel_decomposition
    from torch._inductor.fx_passes import post_grad
    from torch._inductor.fx_passes.reinplace import reinplace_inplaceable_ops
    from torch._inductor.fx_utils import FakeTensorUpdater
    gm, mode = _site_graph()
    SP.splice_ops(gm.graph, _nodes(gm, SP.BODIES), mode)
    gm.graph.eliminate_dead_code()
    for i, n in enumerate(_nodes(gm, {WRAPPER})):
        n.meta["stack_trace"] = f'  File "model.py", line {i}, in forward'
        n.meta["nn_module_stack"] = {"L__self___fc": ("L['self'].fc", torch.nn.Linear)}
    if clone:
        kernel = _nodes(gm, {WRAPPER})[1]
        out = gm.graph.output_node()
        written = kernel.kwargs["kwargs"][kernel.kwargs["tensors_to_clone"][0]]
        out.args = (tuple(out.args[0]) + (written,),)
    gm.recompile()
    with mode:
        reinplace_inplaceable_ops(FakeTensorUpdater(gm), gm.graph)
        assert [bool(n.kwargs["tensors_to_clone"]) for n in _nodes(gm, {WRAPPER})] == \
            [False, clone, False, False, False]
        with traceless_kernel_decomposition() if traceless else contextlib.nullcontext():
            post_grad.decompose_triton_kernel_wrapper_functional(gm.graph)
    gm.graph.lint()
    return gm


def _canonical(gm, names: bool) -> list:
    """Each node's op, target, arguments (nodes by position, a kernel's constant arguments by
    value: each trace adds its own side-table entry), metadata (tensors by size, stride and
    dtype) as text, and with ``names`` its name."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    from torch.utils import _pytree as pytree
    at = {n: i for i, n in enumerate(gm.graph.nodes)}

    def text(v):
        return str(pytree.tree_map(lambda t: (tuple(t.shape), t.stride(), t.dtype)
                                   if isinstance(t, torch.Tensor) else t, v))
    rows = []
    for n in gm.graph.nodes:
        kwargs = dict(n.kwargs)
        if "constant_args_idx" in kwargs:
            kwargs["constant_args_idx"] = kernel_side_table.get_constant_args(
                kwargs["constant_args_idx"])
        args = torch.fx.node.map_arg((n.args, kwargs), lambda a: ("node", at[a]))
        rows.append((n.name if names else "", n.op, str(n.target), str(args),
                     sorted((k, text(v)) for k, v in n.meta.items())))
    return rows


@compiled
@pytest.mark.parametrize("clone", [False, True])
def test_kernel_nodes_that_clone_nothing_decompose_without_a_trace_as_inductor_does(hopper, clone):
    """The traceless decomposition gives exactly Inductor's graph (nodes, names where every
    node is its own, arguments, order, metadata); a kernel that must clone its output is
    left to Inductor's pass."""
    from hotcompile import kernel_nodes as KN
    want = _decomposed_site(traceless=False, clone=clone)
    before = KN.replaced_count()
    got = _decomposed_site(traceless=True, clone=clone)
    assert KN.replaced_count() - before == 5 - clone
    assert _canonical(got, names=not clone) == _canonical(want, names=not clone)
    mutation = torch.ops.higher_order.triton_kernel_wrapper_mutation
    assert len(_nodes(got, {mutation})) == 5 and not _nodes(got, {WRAPPER})
    assert len(_nodes(got, {torch.ops.aten.clone.default})) == clone


def test_the_traceless_decomposition_is_scoped_and_reentrant():
    from hotcompile.kernel_nodes import traceless_kernel_decomposition
    from torch._inductor.fx_passes import post_grad
    original = post_grad.decompose_triton_kernel_wrapper_functional
    with traceless_kernel_decomposition():
        patched = post_grad.decompose_triton_kernel_wrapper_functional
        assert patched is not original
        with traceless_kernel_decomposition():
            assert post_grad.decompose_triton_kernel_wrapper_functional is patched
        assert post_grad.decompose_triton_kernel_wrapper_functional is patched
    assert post_grad.decompose_triton_kernel_wrapper_functional is original


def test_a_failing_traceless_decomposition_leaves_the_graph_to_inductors_pass(monkeypatch, caplog):
    """An error in HOT's replacement is logged and Inductor's pass runs on the graph as it
    was: the compile goes on."""
    from hotcompile import kernel_nodes as KN
    from torch._inductor.fx_passes import post_grad
    seen = []

    def boom(graph):
        raise RuntimeError("unexpected node")
    monkeypatch.setattr(KN, "mutations_in_place", boom)
    graph = torch.fx.Graph()
    with monkeypatch.context() as m:
        m.setattr(post_grad, "decompose_triton_kernel_wrapper_functional", seen.append)
        with caplog.at_level(logging.WARNING, logger="hotcompile"), \
                KN.traceless_kernel_decomposition():
            post_grad.decompose_triton_kernel_wrapper_functional(graph)
    assert seen == [graph]
    assert "left to Inductor's decomposition" in caplog.text
