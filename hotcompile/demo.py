"""``python -m hotcompile.demo``: train a small MLP on real handwritten digits, hot vs Inductor.

Why this demo: it is the shortest honest check a newcomer can run on a laptop CPU: real
data (scikit-learn's bundled ``load_digits``, nothing downloads), the same seed and batches
for both backends, the report of what HOT rewrote, and both final losses and accuracies.
"""
from __future__ import annotations

import argparse
import time

import torch

import hotcompile


class DigitsMLP(torch.nn.Module):
    def __init__(self, hidden: int = 256):
        super().__init__()
        self.fc1 = torch.nn.Linear(64, hidden)
        self.fc2 = torch.nn.Linear(hidden, hidden)
        self.head = torch.nn.Linear(hidden, 10)

    def forward(self, x):
        return self.head(torch.nn.functional.gelu(self.fc2(torch.nn.functional.gelu(self.fc1(x)))))


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


def train(backend, steps: int = 300, batch: int = 64, seed: int = 0, lr: float = 2e-3):
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
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    config = hotcompile.HOTConfig(min_features=0)      # tiny layers: rewrite all but the head
    xtr = load_digits_split()[0]
    print(hotcompile.explain(DigitsMLP(), xtr[:64], config=config))
    print()
    results = {}
    for name, be in (("inductor", "inductor"), ("hot", hotcompile.backend(config))):
        torch._dynamo.reset()
        results[name] = train(be, steps=args.steps, seed=args.seed)
        loss, acc, sec = results[name]
        print(f"{name:>8}: final train loss {loss:.4f}   test accuracy {acc * 100:.2f}%   "
              f"({args.steps} steps, {sec:.1f} s incl. compile)")
    gap = (results["inductor"][1] - results["hot"][1]) * 100
    print(f"accuracy gap inductor - hot: {gap:+.2f} points")


if __name__ == "__main__":
    main()
