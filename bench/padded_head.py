"""An LM head whose vocabulary is not a multiple of 16, then its loss: Inductor bf16 against
``backend="hot"`` (its FP8 forward on W padded with zero rows, ``fp8_forward.out_padding``;
the backward exact), forward + backward, compiled, bf16 autocast.

Why: cuBLAS's FP8 GEMM takes out-features in multiples of 16, so GPT-2's head (768 ->
50257) and BERT's (-> 30522) kept their bf16 forward, the largest GEMM of those models.
Padding W costs a few zero rows and leaves the output a strided view of the GEMM's first O
columns (the loss reads it as it is). Timed per shape (medians of ``do_bench``, one
process, the modes in turn): the compiled step of head and loss both ways, the training
graph's forward alone, and the bare GEMMs as eager ops (bf16 at O, row-wise FP8 at the
padded width; cuBLAS's bf16 GEMM at an odd O is slow eagerly: Inductor pads it too).
Checked: HOT's report says the head took the padded FP8 forward, and its loss is within
FP8's error of Inductor's.

    python bench/padded_head.py --out $OUT
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import hotcompile  # noqa: E402
from hotcompile.kernels import fp8_forward as F8  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

# (tokens, in-features, vocabulary): GPT-2 16 x 1024, BERT-base and BERT-large 32 x 512,
# and Llama's aligned 32000 (no padding: the same path HOT took before)
SHAPES = ((16384, 768, 50257), (16384, 768, 30522), (16384, 1024, 30522), (8192, 4096, 32000))


class HeadLoss(torch.nn.Module):
    def __init__(self, I: int, O: int):
        super().__init__()
        self.head = torch.nn.Linear(I, O, bias=False)
        torch.nn.init.normal_(self.head.weight, std=0.02)

    def forward(self, x, t):
        return F.cross_entropy(self.head(x).float(), t)


def bench(fn, quick: bool) -> float:
    from triton.testing import do_bench
    return do_bench(fn, warmup=5 if quick else 25, rep=50 if quick else 300)


def run_shape(L: int, I: int, O: int, quick: bool) -> dict:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    x = torch.randn(L, I, device=dev, requires_grad=True)
    t = torch.randint(0, O, (L,), device=dev)
    row = {"L": L, "I": I, "O": O, "pad": F8.out_padding(O)}
    for mode in ("inductor", "hot"):
        torch._dynamo.reset()
        m = HeadLoss(I, O).to(dev)
        be = hotcompile.backend() if mode == "hot" else "inductor"
        f = torch.compile(m, backend=be)

        def step():
            x.grad = None
            m.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = f(x, t)
            loss.backward()
            return loss

        row[f"{mode}_loss"] = step().item()

        def forward():        # the training graph's forward (under no_grad Dynamo would
            with torch.autocast("cuda", dtype=torch.bfloat16):  # compile an inference
                f(x, t)                                       # graph, which HOT leaves be)
        row[f"{mode}_step_ms"] = bench(step, quick)
        row[f"{mode}_forward_ms"] = bench(forward, quick)
        if mode == "hot":
            rec = be.report.layers[0]
            row["hot_forward"] = rec.forward + (f" (W padded to {rec.O + rec.forward_pad})"
                                                if rec.forward_pad else "")
            row["hot_forward_reason"] = rec.forward_reason
            row["hot_backward"] = f"g_x {rec.gx_path}, g_W {rec.gw_path}"
    a = torch.randn(L, I, device=dev, dtype=torch.bfloat16)
    w = torch.randn(O, I, device=dev, dtype=torch.bfloat16)
    row["gemm_bf16_ms"] = bench(lambda: a @ w.t(), quick)
    aq, sa = F8.e4m3_cast(a, True, contiguous=True)
    wq, sw = F8.weight_operand(w.t(), True, pad=row["pad"])
    row["gemm_fp8_padded_ms"] = bench(lambda: F8.scaled_linear(aq, sa, wq, sw, None,
                                                               torch.bfloat16), quick)
    row["step_speedup"] = row["inductor_step_ms"] / row["hot_step_ms"]
    row["loss_rel_diff"] = abs(row["hot_loss"] - row["inductor_loss"]) / row["inductor_loss"]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=C.RESULTS_DIR)
    p.add_argument("--tag", default="")
    p.add_argument("--quick", action="store_true", help="fewer timing repeats")
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("padded_head.py times cuBLAS's FP8 GEMM: it needs a CUDA GPU")
    rows = []
    for L, I, O in SHAPES:
        rows.append(run_shape(L, I, O, a.quick))
        print({k: round(v, 4) if isinstance(v, float) else v for k, v in rows[-1].items()},
              flush=True)
    dev = torch.device("cuda")
    base = C.result_base(a.out, "padded_head", dev, a.tag)
    C.write_json(base + ".json", {"environment": C.environment(dev), "rows": rows})
    head = ("L x I -> O (pad)", "Inductor step ms", "hot step ms", "speed-up",
            "forward ms Inductor / hot", "GEMM bf16 / FP8 padded ms", "hot's forward",
            "hot's backward", "loss rel. diff")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append(
            f"| {r['L']} x {r['I']} -> {r['O']} (+{r['pad']}) | {r['inductor_step_ms']:.3f} | "
            f"{r['hot_step_ms']:.3f} | {r['step_speedup']:.3f}x | "
            f"{r['inductor_forward_ms']:.3f} / {r['hot_forward_ms']:.3f} | "
            f"{r['gemm_bf16_ms']:.3f} / {r['gemm_fp8_padded_ms']:.3f} | {r['hot_forward']} "
            f"{r['hot_forward_reason']} | {r['hot_backward']} | {r['loss_rel_diff']:.1e} |")
    C.write_text(base + ".md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
