"""Shared test models and graph-capture helpers."""
import contextlib
import math
import pathlib
import sys

import torch
import torch.nn.functional as F

HOT_OPS = {"hq": torch.ops.hot.hq_grad_input.default, "hla": torch.ops.hot.hla_grad_weight.default,
           "abc": torch.ops.hot.abc_compress.default,
           "unit": torch.ops.hot.linear_backward.default}


class MLP(torch.nn.Module):
    def __init__(self, d_in=64, hidden=96, d_out=48, bias=True):
        super().__init__()
        self.fc1 = torch.nn.Linear(d_in, hidden, bias=bias)
        self.fc2 = torch.nn.Linear(hidden, d_out, bias=bias)

    def forward(self, x):
        return self.fc2(self.fc1(x).relu())


class Cross(torch.nn.Module):
    """Cross-attention: q from x, k/v from mem, through nn.MultiheadAttention, whose q and
    kv projections are row slices of one in_proj_weight."""

    def __init__(self):
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(32, 4, batch_first=True)

    def forward(self, x, mem):
        return self.attn(x, mem, mem)[0]


def gelu_new(x, root=math.sqrt(2.0 / math.pi), fp32_pow=False):
    """Hugging Face's ``gelu_new`` (GPT-2's activation) as transformers writes it: tanh's
    GELU in the input's dtype, op by op (``root`` other than sqrt(2/pi): another function).
    ``fp32_pow``: as CUDA autocast runs it, its ``pow`` on an fp32 copy of x (so the ops
    after it in fp32), the result cast back to x's dtype."""
    cube = torch.pow(x.float() if fp32_pow else x, 3.0)
    return (0.5 * x * (1.0 + torch.tanh(root * (x + 0.044715 * cube)))).to(x.dtype)


class Block(torch.nn.Module):
    """Pre-norm transformer block: attention + MLP, 3-D input, biases, LayerNorm. ``gelu``:
    F.gelu's ``approximate`` ("none", "tanh") or "gelu_new" (GPT-2's)."""

    def __init__(self, d=64, heads=4, gelu="none"):
        super().__init__()
        self.heads, self.gelu = heads, gelu
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)
        self.fc1 = torch.nn.Linear(d, 4 * d)
        self.fc2 = torch.nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        h = self.fc1(self.ln2(x))
        h = gelu_new(h) if self.gelu == "gelu_new" else F.gelu(h, approximate=self.gelu)
        return x + self.fc2(h)


@contextlib.contextmanager
def capture_graphs():
    """Collect the post-grad forward and backward graphs Inductor compiles (fx.Graph list)."""
    graphs = []
    with torch._inductor.config.patch(post_grad_custom_post_pass=graphs.append):
        yield graphs


def count_ops(graph, op) -> int:
    """Calls of ``op``. For HOT_OPS["hq"] / ["hla"]: the sites with an HQ g_x / HLA g_W,
    whether alone or inside a site's one-op backward (hot::linear_backward does both)."""
    ops = {op, HOT_OPS["unit"]} if op in (HOT_OPS["hq"], HOT_OPS["hla"]) else {op}
    return sum(1 for n in graph.nodes if n.op == "call_function" and n.target in ops)


def is_bw(graph) -> bool:
    return any(n.op == "placeholder" and "tangents" in n.name for n in graph.nodes)


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def bench_common():
    """``bench/common.py`` (the benchmark models: Llama, RMSNorm), importable from any
    working directory."""
    repo = str(pathlib.Path(__file__).resolve().parents[1])
    if repo not in sys.path:
        sys.path.insert(0, repo)
    from bench import common
    return common


def slow_hot_backward_table():
    """A cost table where HOT's backward never pays (g's HLA kernel costs a second) and FP8
    forward GEMMs and casts are nearly free: every site keeps its exact backward and takes
    the FP8 forward alone."""
    from hotcompile.passes import cost
    table = cost.CostModel(name="slow HOT backward, fast FP8", host_hot_ms=0.0,
                           host_exact_ms=0.0, kernels={k: (0.0, 1e-9 if "bf16" in k else 1e-15)
                                                       for k in cost.KERNELS})
    table.kernels["hla_g"] = (1e3, 0.0)
    return table
