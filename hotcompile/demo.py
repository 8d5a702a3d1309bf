"""``python -m hotcompile.demo``: train a small MLP on real handwritten digits with
``torch.compile(model, backend="hot")`` and the default config, next to Inductor.

Why this demo: it is the shortest honest check a newcomer can run on a laptop CPU: real
data (scikit-learn's bundled ``load_digits``, nothing downloads), the same seed and batches
for both backends, exactly what a user writes (``backend="hot"``, no config), the log line
hot prints for each compiled graph, the report of what it rewrote and why the rest stayed
exact, and both final losses and accuracies.

The model is sized for the defaults: ``min_features=256`` leaves layers narrower than 256
exact (too small to win on a GPU; an output head is named in ``exact_gx``, and a 10-way one
is narrower still). So of its four layers the two 256 -> 256 hidden ones are rewritten, the
64 -> 256 input layer and the 10-way head stay exact, and the report says so. On a CPU the cost gate
(``min_speedup``) does not apply: it has cost models for GPUs only.
"""
from __future__ import annotations

import argparse
import logging
import time

import torch

from .entry import hot_report


class DigitsMLP(torch.nn.Module):
    def __init__(self, hidden: int = 256):
        super().__init__()
        self.inp = torch.nn.Linear(64, hidden)        # 64 input features: stays exact
        self.fc1 = torch.nn.Linear(hidden, hidden)
        self.fc2 = torch.nn.Linear(hidden, hidden)
        self.head = torch.nn.Linear(hidden, 10)       # 10 outputs: stays exact

    def forward(self, x):
        gelu = torch.nn.functional.gelu
        return self.head(gelu(self.fc2(gelu(self.fc1(gelu(self.inp(x)))))))


def load_digits_split(seed: int = 0):
    """(x_train, y_train, x_test, y_test): 8x8 digits scaled to [0, 1], a fixed 80/20 split."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:  # only the demo and tests need it
        raise SystemExit("the demo needs scikit-learn: pip install -e '.[test]'") from e
    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_train = int(0.8 * len(y))
    tr, te = perm[:n_train], perm[n_train:]
    return x[tr], y[tr], x[te], y[te]


def train(backend, steps: int = 200, batch: int = 64, seed: int = 0, lr: float = 1e-3):
    """Train from a fixed init on fixed batches; returns (final loss, test accuracy, seconds)."""
    xtr, ytr, xte, yte = load_digits_split()
    torch.manual_seed(seed)
    model = DigitsMLP()
    compiled = torch.compile(model, backend=backend)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    order = torch.Generator().manual_seed(seed)
    losses = []
    t0 = time.perf_counter()
    for step in range(steps):
        idx = torch.randint(0, len(ytr), (batch,), generator=order)
        loss = torch.nn.functional.cross_entropy(compiled(xtr[idx]), ytr[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    seconds = time.perf_counter() - t0
    with torch.no_grad():
        acc = float((model(xte).argmax(1) == yte).float().mean())
    final = sum(losses[-20:]) / len(losses[-20:])
    return final, acc, seconds


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("hotcompile").setLevel(logging.INFO)      # hot's one line per graph
    results = {}
    for name in ("inductor", "hot"):
        torch._dynamo.reset()
        results[name] = train(name, steps=args.steps, seed=args.seed)
    print()
    print('what backend="hot" did (hotcompile.entry.hot_report()):')
    print(hot_report())
    print()
    for name, (loss, acc, sec) in results.items():
        print(f"{name:>8}: final train loss {loss:.4f}   test accuracy {acc * 100:.2f}%   "
              f"({args.steps} steps, {sec:.1f} s incl. compile)")
    gap = (results["inductor"][1] - results["hot"][1]) * 100
    print(f"accuracy gap inductor - hot: {gap:+.2f} points")


if __name__ == "__main__":
    main()
