"""``hotcompile.debug.launches``: what a compiled graph launches, from Inductor's output code.

The fixtures are the output code of one Llama d4096 training step under ``backend="hot"``
(2 layers, 15 sites, the defaults: row-wise FP8 forward), as an H200 compiled it (torch 2.11,
thirty-ninth stop, call 160): they pin the counts docs/BENCHMARKS.md gives for issue 11
item 3.
"""
import gzip
import os

import torch

import hotcompile
from hotcompile import HOTConfig
from hotcompile.debug.launches import hot_kernel_names, launches, site_op_calls
from helpers import Block

DATA = os.path.join(os.path.dirname(__file__), "data")


def _fixture(graph: str) -> str:
    with gzip.open(os.path.join(DATA, f"output_code_llama_d4096_hot_{graph}_h200.py.gz"),
                   "rt") as f:
        return f.read()


def test_the_llama_step_launches_under_one_hot_kernel_per_site_forward_and_five_backward():
    """14 layer sites and the head (its g_W only). Forward: the layer's seven weights' casts
    in one launch and their operands (HQ's W, the FP8 forward's W) in one, per layer; ABC
    per group sharing x (q/k/v, gate/up, down, the head; o_proj's is in the backward): 11
    HOT kernels over 15 sites. Each site's forward GEMM is one FP8 ``_scaled_mm`` in place of
    its bf16 ``mm`` (the head's stays). Backward: HQ g, the bound, HLA g and two FP8 GEMMs
    per site (the head: HLA g and one), o_proj's two ABC, the head's exact g_x (one mm), the
    graph's one seed draw."""
    fw, bw = launches(_fixture("forward")), launches(_fixture("backward"))
    assert fw == {"hot": {"_weight_cast_kernel": 2, "_weight_operands_kernel": 2,
                          "_hla_kernel": 7},
                  "inductor": 32, "extern": {"mm": 1, "_scaled_mm": 15},
                  "ops": {"aten._scaled_dot_product_cudnn_attention": 2}}, fw
    assert bw == {"hot": {"_hq_token_kernel": 14, "_block_bound_kernel": 14, "_hla_kernel": 17},
                  "inductor": 20, "extern": {"mm": 1, "_scaled_mm": 29},
                  "ops": {"hot.draw_seeds": 1,
                          "aten._scaled_dot_product_cudnn_attention_backward": 2}}, bw
    assert site_op_calls(fw) == site_op_calls(bw) == 0      # every site spliced
    sites = 15
    assert sum(fw["hot"].values()) <= sites                 # issue 11 item 3: <= 1 per site
    # per layer site: 5 backward launches (HQ g, bound, HLA g, 2 GEMMs) + o_proj's 2 ABC
    layer = 14
    assert bw["hot"]["_hq_token_kernel"] == bw["hot"]["_block_bound_kernel"] == layer
    assert bw["hot"]["_hla_kernel"] + bw["extern"]["_scaled_mm"] == 3 * layer + 2 + 2


def test_comments_kernel_sources_and_names_are_read_as_the_wrapper_runs_them():
    """A kernel's source (between triple quotes) and comments mention ``.run(`` and ops
    without launching them; a launch is classified by the name its definition gives, not
    the variable's; CPU kernels and op calls count."""
    q = "'" * 3
    code = "\n".join([
        f"_hla_kernel_3 = async_compile.triton('_hla_kernel', {q}",
        "def _hla_kernel(x):",
        "    other.run(x)  # in the source: not a launch",
        "    torch.ops.aten.mm.default(x, x)",
        f"{q}, device_str='cuda')",
        f"triton_poi_fused_0 = async_compile.triton('triton_poi_fused_0', {q}",
        f"{q})",
        "def call(args):",
        "    # Topologically Sorted Source Nodes: [torch.ops.aten.mm], _hla_kernel_3.run(",
        "    _hla_kernel_3.run(buf0, buf1, stream=stream0)",
        "    _hla_kernel_3.run(buf2, buf3, stream=stream0)  # trailing comment .run(",
        "    triton_poi_fused_0.run(buf4, 16, stream=stream0)",
        "    cpp_fused_add_1(buf5, buf6)",
        "    extern_kernels._scaled_mm(a, b, s, t, out_dtype=torch.bfloat16, out=buf7)",
        "    extern_kernels.mm(a, b, out=buf8)",
        "    buf9 = torch.ops.hot.linear_backward.default(a, b)",
        "    torch.ops.hot.draw_seeds.default(buf10)",
    ])
    got = launches(code)
    assert got == {"hot": {"_hla_kernel": 2}, "inductor": 2,
                   "extern": {"_scaled_mm": 1, "mm": 1},
                   "ops": {"hot.linear_backward": 1, "hot.draw_seeds": 1}}, got
    assert site_op_calls(got) == 1      # the seed draw is not a site's


def test_hot_kernel_names_are_the_package_kernels():
    names = hot_kernel_names()
    assert {"_hq_token_kernel", "_hq_weight_kernel", "_hla_kernel", "_block_bound_kernel",
            "_weight_cast_kernel", "_weight_operands_kernel", "_scaled_mm_kernel"} <= names, names
    from hotcompile.kernels import hadamard
    assert not any(n.startswith("fwht") for n in names)      # helpers are not kernels
    assert "fwht16" in vars(hadamard)


def test_a_cpu_graph_launches_inductor_kernels_and_the_hot_ops():
    """On a CPU the sites run behind ``hot::`` ops (reference kernels) among Inductor's C++
    kernels: both graphs of a compiled block say so."""
    from torch._inductor.utils import run_and_get_code
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Block(d=64, heads=4)
    x = torch.randn(2, 16, 64, requires_grad=True)
    be = hotcompile.backend(HOTConfig(min_features=0, exclude=()))

    def step():
        torch.compile(model, backend=be)(x).square().mean().backward()
    _, codes = run_and_get_code(step)
    assert len(codes) == 2, len(codes)
    fw, bw = (launches(c) for c in codes)
    assert len(be.report.rewritten) == 4
    assert fw["inductor"] > 0 and bw["inductor"] > 0, (fw, bw)
    hot_ops = {k: v for k, v in bw["ops"].items() if k.startswith("hot.")}
    assert sum(hot_ops.values()) >= 4, bw       # each rewritten site's backward op
    assert not fw["hot"] and not bw["hot"]      # no Triton kernel of ours on a CPU
