"""backend="hot" inside PyTorch Lightning, on CPU: two pre-norm transformer blocks (d=256, so
the default config rewrites all 8 linear layers), a few SGD steps, compared with the same fit
in eager mode (what each run must show: trainer_checks.py).

- ``trainer.fit(torch.compile(module, backend="hot"))``: Lightning compiles the module's
  ``training_step`` with that backend.
- ``self.net = torch.compile(net, backend="hot")`` inside the LightningModule, with
  ``self.log`` in ``training_step``.
- the first way with ``self.log`` in ``training_step``: on torch >= 2.12, Lightning up to
  2.6.6 fails in Dynamo for every backend (Lightning-AI/pytorch-lightning#21836, fixed by
  #21837); while it does, the test checks that exact error and reports xfail.

Not marked slow: 4 to 10 s per run on 2 cores (one compile; more when it is the process's first).
"""
import logging

import pytest
import torch
import torch.nn.functional as F

import hotcompile  # noqa: F401  registers torch.ops.hot.* (helpers reads them)
from helpers import Block
from trainer_checks import check_against_eager, hot_log_counts, update_errors, weights

try:
    import lightning.pytorch as pl
except ImportError:
    pl = pytest.importorskip(
        "pytorch_lightning",
        reason="neither lightning nor pytorch_lightning is installed (CI installs lightning: .ci/run)")

STEPS, D = 3, 256
LINEARS = ("qkv", "proj", "fc1", "fc2")


class _Blocks(pl.LightningModule):
    def __init__(self, log_loss=False, compile_net=None):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(Block(D, 4), Block(D, 4))
        if compile_net:
            self.net = torch.compile(self.net, backend=compile_net)
        self.log_loss = log_loss
        self.losses = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        if self.log_loss:
            self.log("train_loss", loss)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _data():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(2, 8 * STEPS, 32, D, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def _fit(module, fitted=None):
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(fitted if fitted is not None else module, _data())
    return trainer


def _check(module, caplog):
    assert hot_log_counts(caplog.records) == [(8, 8)], caplog.text
    eager = _Blocks()
    init = weights(eager)
    _fit(eager)
    hot, ref = weights(module), weights(eager)
    names = [n for n in hot if n.endswith(".weight") and n.split(".")[-2] in LINEARS]
    assert len(names) == 8, names
    check_against_eager(module.losses, eager.losses, STEPS, update_errors(hot, ref, init, names))


def test_fit_module_compiled_by_hot(caplog):
    caplog.set_level(logging.INFO, logger="hotcompile")
    module = _Blocks()
    _fit(module, torch.compile(module, backend="hot"))
    _check(module, caplog)


def test_fit_module_whose_net_is_compiled_by_hot_and_logs(caplog):
    caplog.set_level(logging.INFO, logger="hotcompile")
    module = _Blocks(log_loss=True, compile_net="hot")
    trainer = _fit(module)
    assert torch.isfinite(trainer.callback_metrics["train_loss"])
    _check(module, caplog)


def test_fit_module_compiled_by_hot_that_logs(caplog):
    caplog.set_level(logging.INFO, logger="hotcompile")
    module = _Blocks(log_loss=True)
    try:
        trainer = _fit(module, torch.compile(module, backend="hot"))
    except torch._dynamo.exc.InternalTorchDynamoError as e:
        if "'method' object has no attribute '__dict__'" not in str(e):
            raise
        pytest.xfail(f"lightning {pl.__version__} with torch {torch.__version__}: self.log in a "
                     "compiled training_step fails in Dynamo for any backend (Lightning-AI/"
                     "pytorch-lightning#21836); compile the inner network instead (tested above)")
    assert torch.isfinite(trainer.callback_metrics["train_loss"])
    _check(module, caplog)
