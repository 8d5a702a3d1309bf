"""Which form of W's column maxima does Inductor fuse into autocast's cast of the weight?

Why: the e4m3 W kernel (``hadamard.hq_weight_quant``) takes its scale from max |W[:, i]|, a
torch reduction the spliced graph hands to Inductor. Inductor fused it into the cast
(fp32 parameter -> bf16 copy, which it runs anyway) only for down_proj's W (4096 x 11008):
for every other Llama W it split the reduction into two kernels of its own, a whole extra
read of the bf16 copy (0.25 ms per Llama d4096 step, 24 launches; H100 step profile
2026-11-26). This script compiles the cast plus each candidate form at the Llama shapes
and lists the Triton kernels Inductor generates, to check a form before wiring it in (and
again after a torch upgrade: the fusion is Inductor's heuristic, not a contract).

    python bench/colmax_fusion.py            # CUDA only

Forms: ``full`` (one maximum over O: what the kernel reads today), ``slices8`` (8 partial
maxima over contiguous slices of O), ``strided64`` (64 partials over every 64th row, then
their maximum), ``param`` (the maximum of the fp32 parameter instead of the copy),
``interleavedK`` (K partials, partial j over rows j, j + K, ...: the reduced axis outermost
and K * I outputs, the layout of the one fused case, with more outputs).
"""
from __future__ import annotations

import re

import torch
from torch._inductor.utils import run_and_get_code

INF = float("inf")
SHAPES = ((4096, 4096), (11008, 4096), (4096, 11008))   # Llama d4096 (O, I): q/k/v/o, gate/up, down


def _vn(t, dim):
    return torch.linalg.vector_norm(t, INF, dim=dim, dtype=torch.float32)


FORMS = {
    "full": lambda w, p: _vn(w, 0),
    "slices8": lambda w, p: _vn(w.unflatten(0, (8, -1)), 1),
    "strided64": lambda w, p: _vn(_vn(w.unflatten(0, (64, -1)), 0), 0),
    "param": lambda w, p: _vn(p, 0),
    "interleaved2": lambda w, p: _vn(w.unflatten(0, (-1, 2)), 0),
    "interleaved4": lambda w, p: _vn(w.unflatten(0, (-1, 4)), 0),
    "interleaved8": lambda w, p: _vn(w.unflatten(0, (-1, 8)), 0),
}


def kernels(form, O: int, I: int) -> list:
    """Triton kernels of one compiled step: x @ W^T under autocast, plus ``form``'s maxima
    of W's bf16 copy ``w`` (or of the parameter ``p``)."""
    p = torch.randn(O, I, device="cuda") * 0.02
    x = torch.randn(64, I, device="cuda", dtype=torch.bfloat16)

    def step(x, p):
        with torch.autocast("cuda", torch.bfloat16):
            return x @ p.t(), form(p.to(torch.bfloat16), p)

    torch._dynamo.reset()
    _, code = run_and_get_code(torch.compile(step), x, p)
    return re.findall(r"^\s+(triton_\w+)\.run\(", "\n".join(code), re.M)


def main() -> None:
    for O, I in SHAPES:
        for name, form in FORMS.items():
            ks = kernels(form, O, I)
            fused = len(ks) == 1
            print(f"W {O}x{I} {name:10s} {len(ks)} kernel(s){' (fused)' if fused else ''}: "
                  f"{' '.join(ks)}", flush=True)


if __name__ == "__main__":
    main()
