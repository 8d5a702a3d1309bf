"""Training on real data (scikit-learn digits): hot reaches Inductor's accuracy (acceptance 5)."""
import pytest

import torch

import hotcompile
from hotcompile import demo


def test_digits_hot_matches_inductor():
    pytest.importorskip("sklearn")
    loss_ind, acc_ind, _ = demo.train("inductor", steps=300)
    torch._dynamo.reset()
    be = hotcompile.backend(hotcompile.HOTConfig(min_features=0, exclude=()))
    loss_hot, acc_hot, _ = demo.train(be, steps=300)
    # every layer, the 64-wide input layer and the 10-way head included, ran HOT's backward
    assert len(be.report.rewritten) == 4 and not be.report.exact
    assert acc_ind > 0.9
    assert acc_hot > acc_ind - 0.03, (acc_hot, acc_ind)
    assert loss_hot < 0.25
