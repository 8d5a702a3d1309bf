"""Property-based tests of the "hot" backend on small random models (hypothesis).

Each example builds a random ``nn.Module`` from drawn choices (a straight-line
``forward`` is generated, so graph breaks split it as they would a hand-written model,
and every failure message prints that source), runs one forward+backward eagerly and
one through ``torch.compile(backend=hotcompile.backend(near_exact_config()))``, and checks:

1. compiling and running forward+backward never raises; the joint-graph pass never falls
   back on an internal error (``report.errors`` stays empty) and leaves no torch.fx
   warning about its graph surgery (a node erased twice);
2. the gradients of every parameter and of every input that requires grad match eager
   within the tolerance below;
3. every record that stays exact carries a non-empty, specific reason, not an exception
   the pass caught (``... Error: ...``);
4. no activation product is rewritten. Every activation product of a model has an
   (I, O) signature that no parameter linear of that model has: token counts (1..64, not
   in the feature set), product-only widths (28/36/44 for ``h @ b``, 52/60 for
   ``h @ (W1^T W2)``) and parameter-product inner sizes (10/14) never are a parameter
   linear's in or out features. So a rewritten record with a product's signature is
   that product; besides, per (I, O) and overall, rewritten records never outnumber the
   parameter linears built with that (in, out), which also catches a linear rewritten
   with its roles swapped (x taken for the weight: (I, O) = (features, tokens));
5. frozen weights (``requires_grad=False``) get no gradient, and per (I, O) no more
   records take the HLA g_W path than there are trainable linears with that (in, out).

What the models combine. Linear spellings: ``nn.Linear``, ``F.linear(x, W, b)``,
``x @ W.t()``, ``x @ W`` and ``torch.addmm(b, x, W)`` with W stored (in, out)
(transformers' Conv1D), ``W @ x`` with x (in, tokens), ``F.linear(x, w.t())`` with w
stored (in, out), ``einsum('...i,oi->...o')``; weights contiguous or column-major.
Products that must stay exact: ``q @ k.transpose(-1, -2)`` and ``p @ v`` between
activations or their einsums, ``h @ b`` with ``b`` a model input (not a parameter, with or
without grad), each optionally after ``torch._dynamo.graph_break()`` so that activations
arrive as graph inputs; ``cat([linear(h), h @ b])`` (a linear and a product reading one
x); ``h @ (W1.t() @ W2)`` (a parameter x parameter product). Layouts: 2-D (N, D),
batch-first (B, S, D), sequence-first (S, B, D), 4-D (B, H, W, D); contiguous,
transposed, sliced and token-strided input views; mid-model ``transpose(0, -2)`` and
``[..., ::2, :]``. Dtypes: fp32, and CPU autocast in bf16 and in fp16 (both work on CPU
with torch 2.13 for every op used here: mm/addmm/bmm, softmax, embedding, cat,
tanh/relu/gelu, GELU's tanh form as ``F.gelu`` gives it and as Hugging Face's ``gelu_new``
writes it). With and without bias; shared weights (one D x D parameter in two
layers, in sequence or both reading the same h, possibly spelled differently); tied
weights (one (V, D) parameter used as a positional embedding and as the head); frozen
weights; a frozen layer reading the same x as a trainable one; graph breaks between
layers. Feature sizes 8..48 (multiples of 8 plus 12 and 20); token counts mostly not
multiples of 16 (1, 3, 5, 7, 9, 13, 17, 21, 25, 33, and 64).

Tolerance (property 2), per gradient tensor: fp32 relative Frobenius error <= 0.10 and
cosine >= 0.99; under bf16/fp16 autocast <= 0.15 and >= 0.985 (a gradient cancelled below
``GRAD_FLOOR`` of its example's largest: absolute error, see there). Why: the config is
rank=16 of block=16, so HLA keeps every Hadamard coefficient (an orthogonal transform of
each block of 16 tokens, padding tokens are zeros) and drops nothing; what is left is
8-bit quantization of every operand (g_y per token and the projected g_y per tensor with
stochastic rounding; W per column and the saved x per tensor rounded to nearest):
~amax/127/sqrt(12) per element, i.e. ~1-2 % of a Gaussian tensor's RMS, zero-mean, so it
averages out in the GEMMs' reductions instead of growing; it compounds only through the
stacked linears (g_x of a layer feeds every layer below). Measured on ~930 examples of
these strategies against the pass at 77a9483..47ac920: worst relative error of any
gradient 0.034 in fp32 (median over examples of the per-example worst 0.011, 95th
percentile 0.023; worst cosine 0.9994), 0.035 under bf16 autocast and 0.032 under fp16
autocast (the reference is eager under the same autocast; eager and compiled low
precision round differently, hence the looser bound). So the bounds leave ~3x headroom
over that noise, while a wrong pairing, a wrong role or a dropped gradient term gives
errors of order 1.

Runtime: an example compiles 1-4 graphs (0.1-3 s each on the 2-core CPU this was
written on); with the example counts below the module takes ~1.5 min there when the
machine is otherwise idle (~5 min while other heavy jobs ran). Shrinking is off (every
shrink step recompiles); a failure prints the Case, the generated ``forward`` source
and the backend's report, and ``run_case(case)`` / ``check_properties`` replay it (or
``build_case(random.Random(N), ...)`` with the seed hypothesis prints). The regression
tests at the end are the hand-minimised failures, each naming the commit it failed on.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import linecache
import random
import re
import traceback
import warnings
from collections import Counter
from typing import NamedTuple, Optional, Tuple

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, given, reject, settings
from hypothesis import strategies as st

import hotcompile
from hotcompile.passes import cost

from helpers import gelu_new

# ----------------------------------------------------------------------------- config


def near_exact_config(**extra) -> "hotcompile.HOTConfig":
    """rank=16/16, 8-bit everywhere, every size and name eligible, reference kernels
    (and ``extra`` fields on top, overriding these).

    Fields the installed HOTConfig does not have (it is being reworked) are left out, so
    the suite runs against older and newer versions of the config alike."""
    want = dict(rank=16, block=16, gx_bits=8, gx_w_bits=8, gw_bits=8, min_features=0,
                exclude=(), kernels="reference", gx_scale="token")
    have = {f.name for f in dataclasses.fields(hotcompile.HOTConfig)}
    return hotcompile.HOTConfig(**{**{k: v for k, v in want.items() if k in have}, **extra})


TOL = {None: (0.10, 0.99), torch.bfloat16: (0.15, 0.985), torch.float16: (0.15, 0.985)}
# Property 2's floor for cancelled gradients. HOT's error is relative to the operands it
# quantizes, not to their product: where an exact gradient cancels (a key projection over 4
# tokens: g^T x summing to 6.6e-5 of the example's largest gradient norm), its error stays
# at the operands' scale and its relative error means nothing (CPU discovery, fifty-fifth
# stop: 0.13 and 2.5 there, the same over 32 stochastic seeds and with abc=False; in one
# model a layer the pass left exact missed too, at roundoff). So a gradient whose exact norm
# is below GRAD_FLOOR x the largest exact gradient norm of its example is judged on
# absolute error: ||compiled - exact|| <= tol x GRAD_FLOOR x largest, no cosine. Those two
# cases' errors were 8.5e-6 and 2.3e-6 of the largest (at most 0.28 of that allowance); an
# error of the gradient's own size (a dropped or misrouted term) is still caught on any
# gradient above tol x GRAD_FLOOR (3e-5 of the largest in fp32).
GRAD_FLOOR = 3e-4


def largest_norm(grads) -> float:
    """The largest norm of the exact gradients ``grads`` (None entries skipped):
    ``GRAD_FLOOR``'s reference."""
    return max((float(g.detach().double().norm()) for g in grads if g is not None), default=0.0)


def below_floor(ge, largest: float) -> bool:
    """Whether the exact gradient ``ge`` cancelled below ``GRAD_FLOOR`` x ``largest``."""
    return float(ge.detach().double().norm()) < GRAD_FLOOR * largest


def grad_verdict(gc, ge, largest: float, tol_rel: float, tol_cos: float):
    """None if the compiled gradient ``gc`` is within property 2's bounds of the exact
    ``ge``, else what is off; ``largest``: the largest exact gradient norm of the example
    (``GRAD_FLOOR``)."""
    floor = GRAD_FLOOR * largest
    if below_floor(ge, largest):
        err = float((gc.detach().double() - ge.detach().double()).norm())
        if err <= tol_rel * floor:
            return None
        return (f"abs err {err:.3g} > {tol_rel} x {GRAD_FLOOR} x the largest gradient norm "
                f"{largest:.3g} (a gradient cancelled below the floor)")
    e, c = rel_cos(gc, ge)
    if e <= tol_rel and c >= tol_cos:
        return None
    return f"rel err {e:.4f} (tol {tol_rel}), cosine {c:.5f} (tol {tol_cos})"
# where operands are e4m3 (the FP8 forward; on a GPU also g_W's operands): 3 mantissa bits,
# ~2-4% RMS relative noise per operand instead of 8-bit levels' ~1%, compounding through
# stacked layers; still far below a structural error (a wrong pairing or role: ~1, cosine
# ~0; a dropped term of a shared weight's two: ~0.5). fp32 as bf16 since the sixty-second
# stop's discovery: 2 of 376 `gated` cases (seeds 9425, 9448: 9 and 15 tokens through tanh
# and ReLU) read 0.216 and 0.243 (cosine 0.977, 0.970), the same cases with every site's
# forward FP8 (the older path) 0.218 and 0.243, and 0.013 and 0.010 with bf16 forwards
FP8_TOL = {None: (0.25, 0.97), torch.bfloat16: (0.25, 0.97), torch.float16: (0.25, 0.97)}

# feature sizes of parameter linears; activation products get widths and token counts
# outside this set, so their (I, O) signature can never be a parameter linear's
FEATS = (16, 8, 24, 32, 40, 48, 12, 20)
ACTS = (None, "tanh", "relu", "gelu", "gelu_tanh", "gelu_new")  # after a linear (``act_src``)
PROD_W = (28, 36, 44)                      # widths only h @ b (b a model input) produces
GRAM_R = (10, 14)                          # inner size of a parameter x parameter product
GRAM_W = (52, 60)                          # width h @ (W1^T W2) produces
TOKENS = (7, 5, 9, 13, 17, 21, 25, 33, 64, 1, 3)
SEQ = (7, 5, 9, 13, 17, 33, 3)
SPELLINGS = ("nn_linear", "F_linear", "matmul_t", "x_at_W", "W_at_x", "F_linear_wt",
             "einsum", "addmm")
IN_OUT = ("x_at_W", "F_linear_wt", "addmm")   # spellings whose weight is stored (in, out)
_NOT_PARAM_DIMS = set(TOKENS) | set(SEQ) | {1, 2, 3} | set(GRAM_R)
assert not _NOT_PARAM_DIMS & set(FEATS + PROD_W + GRAM_W)


# ----------------------------------------------------------------------------- model spec
class Linear(NamedTuple):
    spell: str
    i: int
    o: int
    bias: bool
    frozen: bool
    act: Optional[str]
    w_colmajor: bool = False       # the parameter's storage is transposed (non-contiguous)


class Shared(NamedTuple):          # one (d, d) parameter used by two layers
    spells: Tuple[str, str]
    d: int
    bias: bool
    frozen: bool
    parallel: bool                 # both uses read the same h (else one after the other)


class Tied(NamedTuple):            # E (v, d): h + E[pos] (embedding), then h @ E^T (head)
    d: int
    v: int
    functional: bool
    frozen: bool


class FrozenPair(NamedTuple):      # trainable(h) + frozen(h): both read the same x
    spells: Tuple[str, str]        # (trainable, frozen)
    i: int
    o: int
    bias: bool
    frozen_first: bool             # the frozen layer (weight and bias frozen) runs first


class Attn(NamedTuple):            # q, k, v linears; softmax(q k^T) v between activations
    spells: Tuple[str, str, str]
    i: int
    p: int
    dv: int
    einsum: bool
    brk: bool                      # graph break between the projections and the products


class InputProd(NamedTuple):       # h @ b, b a model input (not a parameter), (i, o)
    i: int
    o: int
    grad: bool
    brk: bool


class MixedUse(NamedTuple):        # cat([linear(h), h @ b]): one x, a linear and a product
    spell: str
    i: int
    o: int
    pb: int
    grad: bool


class Gram(NamedTuple):            # h @ (W1^T @ W2): a parameter x parameter product
    i: int
    r: int
    g: int


class Swap(NamedTuple):            # h.transpose(0, -2): batch-first <-> sequence-first
    pass


class TokenSlice(NamedTuple):      # h[..., ::2, :]: every other token (a strided view)
    pass


class Break(NamedTuple):
    pass


class Case(NamedTuple):
    seed: int
    layout: str                    # 2d | bsd | sbd | 4d
    lead: Tuple[int, ...]          # all dims but the feature one
    d0: int
    view: str                      # contig | transposed | sliced | strided
    x_grad: bool
    dtype: Optional[torch.dtype]   # autocast dtype (None: fp32)
    blocks: tuple


# ----------------------------------------------------------------------------- the model
def linear_src(spell, h, w, b, i, o, two_d):
    """Source of ``h W^T (+ b)`` spelled ``spell``; w is stored (out, in), or (in, out) for
    IN_OUT spellings; ``two_d``: h is (tokens, features)."""
    lead = "*{h}.shape[:-1]".format(h=h)
    if spell == "F_linear":
        return f"F.linear({h}, {w}, {b})"
    if spell == "F_linear_wt":
        return f"F.linear({h}, {w}.t(), {b})"
    if spell == "matmul_t":
        y = f"{h} @ {w}.t()"
    elif spell == "x_at_W":
        y = f"{h} @ {w}"
    elif spell == "einsum":
        y = f"torch.einsum('...i,oi->...o', {h}, {w})"
    elif spell == "W_at_x":                   # x as (in, tokens)
        y = f"({w} @ {h}.t()).t()" if two_d else \
            f"({w} @ {h}.reshape(-1, {i}).t()).t().reshape({lead}, {o})"
    elif spell == "addmm":                    # transformers' Conv1D
        x2 = h if two_d else f"{h}.reshape(-1, {i})"
        y = f"torch.addmm({b}, {x2}, {w})" if b != "None" else f"torch.mm({x2}, {w})"
        return y if two_d else f"{y}.reshape({lead}, {o})"
    else:
        raise ValueError(spell)
    return y if b == "None" else f"{y} + {b}"


def act_src(e, act):
    return {None: e, "tanh": f"torch.tanh({e})", "relu": f"torch.relu({e})",
            "gelu": f"F.gelu({e})", "gelu_tanh": f"F.gelu({e}, approximate='tanh')",
            "gelu_new": f"gelu_new({e})"}[act]


class Net(torch.nn.Module):
    """The model of ``case``, with a generated straight-line ``forward`` (``self.source``).

    ``self.linears``: ((in, out), trainable) of every parameter linear;
    ``self.products``: the (I, O) signatures of activation and parameter products."""

    def __init__(self, case: Case):
        super().__init__()
        self.mods = torch.nn.ModuleDict()
        self.ps = torch.nn.ParameterDict()
        self.linears, self.products = [], []
        two_d = len(case.lead) == 1
        lead = list(case.lead)                # h's leading dims, tracked through the blocks
        src, n_extra = [], 0

        def P(name):
            return f"self.ps['{name}']"

        def lin(name, spell, i, o, bias, frozen, colmajor=False, frozen_bias=False):
            if spell == "nn_linear":
                m = torch.nn.Linear(i, o, bias=bias)
                if colmajor:
                    m.weight = torch.nn.Parameter(m.weight.detach().t().contiguous().t())
                m.weight.requires_grad_(not frozen)
                if bias:
                    m.bias.requires_grad_(not frozen_bias)
                self.mods[name] = m
                self.linears.append(((i, o), not frozen))
                return f"self.mods['{name}'](h)"
            shape = (i, o) if spell in IN_OUT else (o, i)
            self.ps[name + "_w"] = self._param(shape, i, frozen, colmajor)
            if bias:
                self.ps[name + "_b"] = self._param((o,), 10, frozen_bias)
            self.linears.append(((i, o), not frozen))
            return linear_src(spell, "h", P(name + "_w"), P(name + "_b") if bias else "None",
                              i, o, two_d)

        for k, blk in enumerate(case.blocks):
            if isinstance(blk, Linear):
                e = lin(f"l{k}", blk.spell, blk.i, blk.o, blk.bias, blk.frozen, blk.w_colmajor)
                src.append(f"h = {act_src(e, blk.act)}")
            elif isinstance(blk, Shared):
                w = f"s{k}_w"
                self.ps[w] = self._param((blk.d, blk.d), blk.d, blk.frozen)
                es = []
                for j, spell in enumerate(blk.spells):
                    if blk.bias:
                        self.ps[f"s{k}_b{j}"] = self._param((blk.d,), 10, False)
                    self.linears.append(((blk.d, blk.d), not blk.frozen))
                    es.append(linear_src(spell, "h", P(w), P(f"s{k}_b{j}") if blk.bias
                                         else "None", blk.d, blk.d, two_d))
                if blk.parallel:
                    src.append(f"h = torch.tanh({es[0]} + {es[1]})")
                else:
                    src += [f"h = torch.tanh({es[0]})", f"h = torch.tanh({es[1]})"]
            elif isinstance(blk, Tied):
                self.ps[f"t{k}_w"] = self._param((blk.v, blk.d), blk.d, blk.frozen)
                self.linears.append(((blk.d, blk.v), not blk.frozen))
                e = P(f"t{k}_w")
                src.append(f"h = h + F.embedding(torch.arange(h.shape[-2], device=h.device)"
                           f" % {blk.v}, {e})")
                src.append(f"h = F.linear(h, {e})" if blk.functional else f"h = h @ {e}.t()")
            elif isinstance(blk, FrozenPair):
                a = lin(f"f{k}a", blk.spells[0], blk.i, blk.o, blk.bias, False)
                b = lin(f"f{k}b", blk.spells[1], blk.i, blk.o, blk.bias, True, frozen_bias=True)
                src.append(f"h = torch.tanh({b} + {a})" if blk.frozen_first
                           else f"h = torch.tanh({a} + {b})")
            elif isinstance(blk, Attn):
                for n, s, o in zip("qkv", blk.spells, (blk.p, blk.p, blk.dv)):
                    src.append(f"{n} = {lin(f'a{k}{n}', s, blk.i, o, False, False)}")
                if blk.brk:
                    src.append("torch._dynamo.graph_break()")
                if blk.einsum:
                    src.append("s = torch.einsum('...td,...sd->...ts', q, k)")
                else:
                    src.append("s = q @ k.transpose(-1, -2)")
                src.append(f"p = (s * {blk.p ** -0.5!r}).softmax(-1)")
                src.append("h = torch.einsum('...ts,...sd->...td', p, v)" if blk.einsum
                           else "h = p @ v")
                self.products += [(blk.p, lead[-1]), (lead[-1], blk.dv)]
            elif isinstance(blk, InputProd):
                if blk.brk:
                    src.append("torch._dynamo.graph_break()")
                src.append(f"h = h @ extra[{n_extra}]")
                n_extra += 1
                self.products.append((blk.i, blk.o))
            elif isinstance(blk, MixedUse):
                e = lin(f"m{k}", blk.spell, blk.i, blk.o, False, False)
                src.append(f"h = torch.cat([{e}, h @ extra[{n_extra}]], -1)")
                n_extra += 1
                self.products.append((blk.i, blk.pb))
            elif isinstance(blk, Gram):
                self.ps[f"g{k}_w1"] = self._param((blk.r, blk.i), blk.r, False)
                self.ps[f"g{k}_w2"] = self._param((blk.r, blk.g), blk.r, False)
                src.append(f"h = h @ ({P(f'g{k}_w1')}.t() @ {P(f'g{k}_w2')})")
                self.products += [(blk.r, blk.g), (blk.i, blk.g)]
            elif isinstance(blk, Swap):
                src.append("h = h.transpose(0, -2)")
                lead[0], lead[-1] = lead[-1], lead[0]
            elif isinstance(blk, TokenSlice):
                src.append("h = h[..., ::2, :]")
                lead[-1] = (lead[-1] + 1) // 2
            elif isinstance(blk, Break):
                src.append("torch._dynamo.graph_break()")
        src.append("return h")
        self.source = "def forward(self, x, *extra):\n    h = x\n" + "".join(
            f"    {line}\n" for line in src)
        filename = f"<test_properties Net {id(self):x}>"
        linecache.cache[filename] = (len(self.source), None, self.source.splitlines(True),
                                     filename)
        scope = {"torch": torch, "F": F, "gelu_new": gelu_new}
        exec(compile(self.source, filename, "exec"), scope)
        self._fwd = scope["forward"]
        sigs = {s for s, _ in self.linears}
        assert not sigs & set(self.products), (sigs, self.products)

    @staticmethod
    def _param(shape, fan_in, frozen, colmajor=False):
        t = torch.randn(shape) * fan_in ** -0.5
        if colmajor:
            t = t.t().contiguous().t()
        return torch.nn.Parameter(t, requires_grad=not frozen)

    def forward(self, x, *extra):
        return self._fwd(self, x, *extra)


# ----------------------------------------------------------------------------- strategies
# Every structural choice comes from one Random that hypothesis seeds (``st.randoms(
# use_true_random=True)``: a single drawn integer). Why not one ``draw`` per choice:
# hypothesis's generator then spends most of a small budget on mutated near-copies of
# earlier examples (it copies a drawn span over another of the same strategy): with 20
# examples per test that gave ~10 distinct models, many of them one-block ones, whereas
# every example costs a compile here. Shrinking is off anyway (see the docstring).
LAYOUTS = ("2d", "bsd", "sbd", "4d")


def lead_dims(rnd, layout):
    if layout == "2d":
        return [rnd.choice(TOKENS)]
    if layout == "bsd":
        return [rnd.randint(1, 3), rnd.choice(SEQ)]
    if layout == "sbd":
        return [rnd.choice(SEQ), rnd.randint(1, 3)]
    return [rnd.randint(1, 2), rnd.randint(2, 3), rnd.choice((3, 5, 7))]


def build_case(rnd, kinds, dtypes=(None,), max_blocks=3, layouts=LAYOUTS, x_grad=0.5,
               feats=FEATS) -> Case:
    """A random Case; ``kinds`` lists the block kinds to combine (repeat one to weight it),
    ``layouts`` likewise; ``x_grad``: probability that the input requires grad; ``feats``:
    the parameter linears' feature sizes (a subset of FEATS, whose sizes no product has)."""
    assert set(feats) <= set(FEATS), feats

    def feat():
        return rnd.choice(feats)

    def spell(module=True):
        return rnd.choice(SPELLINGS if module else SPELLINGS[1:])

    def coin():
        return rnd.random() < 0.5

    def frozen():
        return rnd.random() < 1 / 3

    layout = rnd.choice(layouts)
    lead = lead_dims(rnd, layout)
    d = d0 = feat()
    blocks, case_lead = [], tuple(lead)
    for k in range(rnd.randint(1, max_blocks)):
        # a graph break or a view needs something before it; a model needs one real block
        first = [c for c in kinds if c not in ("break", "swap", "token_slice")]
        kind = rnd.choice(first if k == 0 else kinds)
        o = d
        if kind == "linear":
            o = feat()
            blocks.append(Linear(spell(), d, o, coin(), frozen(),
                                 rnd.choice(ACTS), coin()))
        elif kind == "shared":
            blocks.append(Shared((spell(False), spell(False)), d, coin(), frozen(), coin()))
        elif kind == "tied":
            o = feat()
            blocks.append(Tied(d, o, coin(), frozen()))
        elif kind == "frozen_pair":
            o = feat()
            blocks.append(FrozenPair((spell(), spell()), d, o, coin(), coin()))
        elif kind == "attn":
            o = feat()
            blocks.append(Attn((spell(), spell(), spell()), d, feat(), o, coin(), coin()))
        elif kind == "input_prod":
            o = rnd.choice(PROD_W)
            blocks.append(InputProd(d, o, coin(), coin()))
        elif kind == "mixed_use":
            lo, pb = feat(), rnd.choice(PROD_W)
            blocks.append(MixedUse(spell(), d, lo, pb, coin()))
            o = lo + pb
        elif kind == "gram":
            o = rnd.choice(GRAM_W)
            blocks.append(Gram(d, rnd.choice(GRAM_R), o))
        elif kind == "swap" and len(lead) > 1:
            blocks.append(Swap())
            lead[0], lead[-1] = lead[-1], lead[0]
        elif kind == "token_slice" and (lead[-1] + 1) // 2 not in FEATS + PROD_W + GRAM_W:
            blocks.append(TokenSlice())
            lead[-1] = (lead[-1] + 1) // 2
        d = o
    return Case(seed=rnd.randrange(2 ** 16), layout=layout, lead=case_lead, d0=d0,
                view=rnd.choice(("contig", "transposed", "sliced", "strided")),
                x_grad=rnd.random() < x_grad, dtype=rnd.choice(dtypes), blocks=tuple(blocks))


def cases(kinds, dtypes=(None,), max_blocks=3, layouts=LAYOUTS, x_grad=0.5, feats=FEATS):
    """Strategy of random Cases (see build_case)."""
    return st.randoms(use_true_random=True).map(
        lambda rnd: build_case(rnd, kinds, dtypes, max_blocks, layouts, x_grad, feats))


# ----------------------------------------------------------------------------- running
def make_input(case: Case, device="cpu"):
    """(leaf, view): the leaf gets the gradient; the model sees ``view(leaf)``, which is
    non-contiguous unless case.view == 'contig'. Drawn on the CPU, then moved: a case has
    the same values on every device."""
    shape = (*case.lead, case.d0)
    if case.view == "transposed":
        leaf = torch.randn(*shape[:-2], shape[-1], shape[-2])
        view = lambda t: t.transpose(-1, -2)        # noqa: E731
    elif case.view == "sliced":
        leaf = torch.randn(*shape[:-1], shape[-1] + 5)
        view = lambda t: t[..., 2:2 + case.d0]      # noqa: E731
    elif case.view == "strided":
        leaf = torch.randn(*shape[:-2], 2 * shape[-2], shape[-1])
        view = lambda t: t[..., ::2, :]             # noqa: E731
    else:
        leaf, view = torch.randn(shape), lambda t: t
    return leaf.to(device), view


def extra_inputs(case: Case, device="cpu"):
    """The model inputs b of InputProd / MixedUse blocks (not parameters)."""
    return [(torch.randn(b.i, b.o if isinstance(b, InputProd) else b.pb) * b.i ** -0.5).to(device)
            for b in case.blocks if isinstance(b, (InputProd, MixedUse))]


def extra_grads(case: Case):
    return [b.grad for b in case.blocks if isinstance(b, (InputProd, MixedUse))]


def _fresh():
    torch._dynamo.reset()
    table = getattr(hotcompile, "lqs_table", None)
    if table is not None and hasattr(table, "clear"):
        table.clear()


def _step(model, leaf, view, extras, case, compiled_with=None):
    leaf = leaf.detach().clone().requires_grad_(case.x_grad)
    extras = [e.detach().clone().requires_grad_(g) for e, g in zip(extras, extra_grads(case))]
    fn = torch.compile(model, backend=compiled_with) if compiled_with is not None else model
    dev = leaf.device.type
    ctx = torch.autocast(dev, dtype=case.dtype) if case.dtype else torch.autocast(
        dev, enabled=False)
    with ctx:
        out = fn(view(leaf), *extras)
    if out.requires_grad:
        out.float().square().mean().backward()
    return out, leaf, extras


@dataclasses.dataclass
class Result:
    case: Case
    model_e: Net
    model_c: Net
    leaf_e: torch.Tensor
    leaf_c: torch.Tensor
    extras_e: list
    extras_c: list
    report: object
    out_e: torch.Tensor
    out_c: torch.Tensor
    warnings: list


class InductorFailsToo(Exception):
    """Compiling with HOT raised, and plain ``backend="inductor"`` raises on the same model
    too: torch's bug, not HOT's (met: torch 2.13's CPU code generation under bf16 autocast
    on an AVX512 host, "conflicting declaration 'auto at_BFloat16_tmp_acc0_vec'", fifty-fifth
    stop). The suites reject such an example (``checked``) instead of failing on it."""


def _inductor_fails_too(model, leaf, view, extras, case) -> bool:
    _fresh()
    try:
        _step(copy.deepcopy(model), leaf, view, extras, case, compiled_with="inductor")
    except Exception:  # noqa: BLE001 - any raise: Inductor cannot compile this model
        return True
    finally:
        _fresh()
    return False


def run_case(case: Case, device="cpu", config_fn=None, **config) -> Result:
    """Eager and compiled forward+backward of the same model on ``device``; property 1 is
    checked here. ``config``: HOTConfig fields on top of ``config_fn()`` (default
    ``near_exact_config``)."""
    _fresh()
    torch.manual_seed(case.seed)
    model_e = Net(case).to(device)       # built on the CPU: the same weights everywhere
    model_c = copy.deepcopy(model_e)
    leaf, view = make_input(case, device)
    extras = extra_inputs(case, device)
    out_e, leaf_e, extras_e = _step(model_e, leaf, view, extras, case)
    be = hotcompile.backend((config_fn or near_exact_config)(**config))
    torch.manual_seed(case.seed + 1)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out_c, leaf_c, extras_c = _step(model_c, leaf, view, extras, case, compiled_with=be)
    except Exception:  # noqa: BLE001 - property 1, reported with the model
        tail = "".join(traceback.format_exc().splitlines(True)[-40:])
        if _inductor_fails_too(model_e, leaf, view, extras, case):
            raise InductorFailsToo(f"plain Inductor raises on this model too: {case}\n"
                                   f"{model_e.source}{tail}") from None
        raise AssertionError(f"P1: compile/forward/backward raised for {case}\n"
                             f"{model_e.source}{tail}") from None
    _fresh()
    return Result(case, model_e, model_c, leaf_e, leaf_c, extras_e, extras_c, be.report,
                  out_e, out_c, [str(w.message) for w in caught])


def rel_cos(a, b):
    a, b = a.detach().double().flatten(), b.detach().double().flatten()
    nb = b.norm()
    if nb == 0:
        return float(a.norm()), 1.0 if a.norm() == 0 else 0.0
    return float((a - b).norm() / nb), float(a @ b / (a.norm() * nb).clamp_min(1e-300))


def grad_pairs(r: Result):
    """(name, compiled grad, eager grad) for every tensor that requires grad."""
    pe = dict(r.model_e.named_parameters())
    for name, p in r.model_c.named_parameters():
        if p.requires_grad:
            yield name, p.grad, pe[name].grad
    if r.case.x_grad:
        yield "input x", r.leaf_c.grad, r.leaf_e.grad
    for j, (ec, ee) in enumerate(zip(r.extras_c, r.extras_e)):
        if ec.requires_grad:
            yield f"model input b{j}", ec.grad, ee.grad


def grad_errors(r: Result):
    """(errors, floored): (name, relative error, cosine) of every gradient both runs have,
    and the names of those cancelled below ``GRAD_FLOOR`` (judged on absolute error, so
    left out of the errors): what the discovery driver and the GPU suite's log record."""
    pairs = [(n, gc, ge) for n, gc, ge in grad_pairs(r) if gc is not None and ge is not None]
    largest = largest_norm(ge for _, _, ge in pairs)
    floored = [n for n, _, ge in pairs if below_floor(ge, largest)]
    return [(n, *rel_cos(gc, ge)) for n, gc, ge in pairs if n not in floored], floored


def describe(r: Result) -> str:
    c = r.case
    inp = f"x: {c.layout} {(*c.lead, c.d0)} {c.view}, requires_grad={c.x_grad}"
    amp = f", autocast {c.dtype}" if c.dtype else ""
    return f"\ncase: {c}\n{inp}{amp}\n{r.model_c.source}report:\n{r.report}"


_FX_WARNING = re.compile(r"already erased|erase_node|still has \d+ users")
_INTERNAL = re.compile(r"\b\w*(Error|Exception)\b|Traceback|object has no attribute")


def check_properties(r: Result, tol=None) -> None:
    """Properties 1-5 of the module docstring; ``tol``: property 2's bounds by autocast
    dtype (default ``TOL``)."""
    case, report = r.case, r.report
    ctx = describe(r)
    # 1 (continued): the pass itself did not fall back on an internal error, nor left the
    # graph in a state torch.fx warns about (a node replaced or erased twice)
    assert not report.errors, f"P1: joint-graph pass failed and fell back: {report.errors}{ctx}"
    bad = [w for w in r.warnings if _FX_WARNING.search(w)]
    assert not bad, f"P1: graph surgery warnings while compiling: {bad}{ctx}"
    # 2: gradients
    tol_rel, tol_cos = (tol or TOL)[case.dtype]
    assert r.out_c.shape == r.out_e.shape, (
        f"P2: output shape {r.out_c.shape} != {r.out_e.shape}{ctx}")
    pairs = list(grad_pairs(r))
    largest = largest_norm(ge for _, _, ge in pairs)
    for name, gc, ge in pairs:
        if ge is None:
            assert gc is None or gc.abs().max() == 0, (
                f"P2: {name} has a grad only when compiled{ctx}")
            continue
        assert gc is not None, f"P2: {name} got no gradient when compiled{ctx}"
        assert gc.shape == ge.shape, f"P2: {name} grad shape {gc.shape} != {ge.shape}{ctx}"
        assert torch.isfinite(gc).all(), f"P2: {name} grad not finite{ctx}"
        off = grad_verdict(gc, ge, largest, tol_rel, tol_cos)
        assert off is None, f"P2: grad of {name} off: {off}{ctx}"
    # 3: reasons
    for rec in report.layers:
        if rec.reason is None:
            continue
        assert isinstance(rec.reason, str) and len(rec.reason.strip()) >= 10, (
            f"P3: record {rec.name} ({rec.I}, {rec.O}) has no specific reason: {rec.reason!r}{ctx}")
        assert not _INTERNAL.search(rec.reason), (
            f"P3: record {rec.name} ({rec.I}, {rec.O}) stayed exact because the pass hit an "
            f"internal error: {rec.reason!r}{ctx}")
    # 4: activation products are never rewritten
    lin_all = Counter(s for s, _ in r.model_c.linears)
    lin_train = Counter(s for s, t in r.model_c.linears if t)
    rewritten = [rec for rec in report.layers if rec.reason is None]
    for rec in rewritten:
        sig = (rec.I, rec.O)
        assert sig not in r.model_c.products, (
            f"P4: activation product {sig} rewritten: {rec}{ctx}")
    per_sig = Counter((rec.I, rec.O) for rec in rewritten)
    for sig, n in per_sig.items():
        assert n <= lin_all[sig], (
            f"P4: {n} rewritten record(s) with (I, O)={sig} but the model has {lin_all[sig]} "
            f"parameter linear(s) with that (in, out): an activation product or an input "
            f"taken for the weight was rewritten{ctx}")
    assert len(rewritten) <= sum(lin_all.values()), (
        f"P4: {len(rewritten)} rewritten records > {sum(lin_all.values())} parameter linears{ctx}")
    # 5: frozen linears: no g_W, not HLA
    for name, p in r.model_c.named_parameters():
        if not p.requires_grad:
            assert p.grad is None, f"P5: frozen parameter {name} got a gradient{ctx}"
    hla = Counter((rec.I, rec.O) for rec in report.layers
                  if str(rec.gw_path).upper().startswith("HLA"))
    for sig, n in hla.items():
        assert n <= lin_train[sig], (
            f"P5: {n} record(s) with (I, O)={sig} take the HLA g_W path but only "
            f"{lin_train[sig]} trainable linear(s) have that (in, out){ctx}")


def check_case(case: Case, **config) -> Result:
    r = run_case(case, **config)
    check_properties(r)
    return r


# ----------------------------------------------------------------------------- properties
SETTINGS = dict(deadline=None, derandomize=True, database=None, print_blob=False,
                phases=(Phase.explicit, Phase.generate),
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# Each suite's draws (``cases`` arguments) and its check, by name: the tests below run a
# fixed (derandomized) sample of each; ``tests/discover_properties.py`` runs the same suites
# on seeds of its own, for as long as it is given, to find what that sample does not hold.
SUITES = {
    "spellings": dict(kinds=("linear", "linear", "linear", "shared", "break", "swap",
                             "token_slice"), max_blocks=4),
    "frozen_shared_tied": dict(kinds=("linear", "tied", "frozen_pair", "frozen_pair", "shared",
                                      "break"),
                               max_blocks=4, layouts=("2d", "2d", "bsd", "sbd", "4d"),
                               x_grad=0.25),
    "products": dict(kinds=("linear", "linear", "attn", "attn", "input_prod", "mixed_use",
                            "gram", "break", "swap", "token_slice"), max_blocks=4),
    "autocast": dict(kinds=("linear", "linear", "shared", "tied", "frozen_pair", "attn",
                            "input_prod", "mixed_use", "gram", "break", "swap", "token_slice"),
                     dtypes=(torch.bfloat16, torch.float16), max_blocks=3),
    "recompute": dict(kinds=("linear", "linear", "shared", "tied", "frozen_pair", "attn",
                             "mixed_use", "break", "swap", "token_slice"),
                      dtypes=(torch.bfloat16, None), max_blocks=3),
    "fp8_forward": dict(kinds=("linear", "linear", "linear", "shared", "tied", "frozen_pair",
                               "mixed_use", "break", "swap", "token_slice"),
                        dtypes=(torch.bfloat16, None), max_blocks=4,
                        feats=(16, 32, 48, 16, 24)),
}


def check_fp8_forward(case: Case) -> Result:
    """The FP8 forward on a case: row-wise under bf16 autocast, tensor-wise in fp32, every
    site forced; properties 1-5 at ``FP8_TOL``."""
    fwd = "fp8_rowwise" if case.dtype == torch.bfloat16 else "fp8"
    r = run_case(case, forward=fwd, min_speedup=0)
    check_properties(r, FP8_TOL)
    return r


SUITES["gated"] = SUITES["fp8_forward"]


class _CoinTable(cost.CostModel):
    """A cost table whose backward verdicts are coin flips drawn in the order the gate asks
    (one a site) and whose forward verdict is always FP8: sites rewritten whole beside
    sites with an exact backward and the FP8 forward alone, sharing inputs, weights and
    producers as the case's model does."""

    def predict(self, *a, **k):
        return (2.0, 1.0) if self.coin.random() < 0.5 else (1.0, 2.0)

    def predict_forward(self, *a, **k):
        return 2.0, 1.0


def run_coin_gated(case: Case, **config) -> Result:
    """``run_case`` with every cost-gate question answered by a ``_CoinTable`` seeded by the
    case (the gate asks only where ``min_speedup`` > 0)."""
    from unittest import mock
    table = _CoinTable(name="coin", kernels=dict(cost.H200.kernels), host_hot_ms=0.0,
                       host_exact_ms=0.0)
    object.__setattr__(table, "coin", random.Random(case.seed))
    with mock.patch.object(cost, "model_for", lambda device: table):
        return run_case(case, **config)


def check_gated(case: Case) -> Result:
    """The FP8 forward (row-wise under bf16 autocast, tensor-wise in fp32) under a cost gate
    that keeps a random half of the sites' backward exact (``_CoinTable``): the two gates
    decided apart (``rewrite._cost_gate`` returns the sites it kept exact, whose forward is
    gated alone); properties 1-5 at ``FP8_TOL``."""
    fwd = "fp8_rowwise" if case.dtype == torch.bfloat16 else "fp8"
    r = run_coin_gated(case, forward=fwd)
    check_properties(r, FP8_TOL)
    return r


SUITES["configs"] = SUITES["fp8_forward"]


def config_draw(case: Case) -> dict:
    """HOTConfig fields that change the graph's structure, not its numbers' size (8-bit,
    full rank: ``near_exact_config``), drawn from the case's seed: the forward's format, the
    g_x scale, the g_W format, ABC in the forward or not, operands rebuilt in backward, what
    the partitioner keeps, and the cost gate off or tossing coins (``_CoinTable``)."""
    rnd = random.Random(case.seed * 7 + 3)
    forwards = ["bf16", "fp8"] + ["fp8_rowwise"] * (case.dtype == torch.bfloat16)
    return dict(forward=rnd.choice(forwards), gx_scale=rnd.choice(["token", "tensor"]),
                gw_format=rnd.choice(["auto", "int8", "e4m3"]), abc=rnd.random() < 0.8,
                recompute_operands=rnd.random() < 0.3,
                saved_activations=rnd.choice(["auto", "exact", "bf16"]),
                min_speedup=rnd.choice([0, 1.0]))


def check_configs(case: Case) -> Result:
    """The case under ``config_draw``'s fields; properties 1-5 at ``FP8_TOL`` where the
    forward is FP8, else ``TOL``."""
    cfg = config_draw(case)
    r = run_coin_gated(case, **cfg)
    check_properties(r, FP8_TOL if cfg["forward"] != "bf16" else None)
    return r


CHECKS = {name: check_case for name in SUITES}
CHECKS["recompute"] = lambda case: check_case(case, recompute_operands=True)
CHECKS["fp8_forward"] = check_fp8_forward
CHECKS["gated"] = check_gated
CHECKS["configs"] = check_configs


def checked(suite: str, case: Case) -> None:
    """``CHECKS[suite]`` inside a hypothesis test: an example plain Inductor cannot compile
    either is rejected (not HOT's to pass or fail)."""
    try:
        CHECKS[suite](case)
    except InductorFailsToo:
        reject()


@pytest.mark.slow     # 15-25 examples of 1-4 compiles each: 2.5-4.5 min on 2 cores
@settings(max_examples=25, **SETTINGS)
@given(case=cases(**SUITES["spellings"]))
def test_linear_spellings_layouts_fp32(case):
    """Every linear spelling, layout and input view, layouts changing mid-model; bias,
    frozen and column-major weights, shared weights, graph breaks."""
    checked("spellings", case)


@pytest.mark.slow     # 15-25 examples of 1-4 compiles each: 2.5-4.5 min on 2 cores
@settings(max_examples=25, **SETTINGS)
@given(case=cases(**SUITES["frozen_shared_tied"]))
def test_frozen_shared_tied_fp32(case):
    """Frozen layers (alone and reading a trainable layer's x), shared and tied weights.
    Inputs mostly need no grad here (frozen-backbone style: then a frozen layer makes no
    autograd node at all)."""
    checked("frozen_shared_tied", case)


@pytest.mark.slow     # 15-25 examples of 1-4 compiles each: 2.5-4.5 min on 2 cores
@settings(max_examples=25, **SETTINGS)
@given(case=cases(**SUITES["products"]))
def test_activation_products_never_rewritten(case):
    """q @ k^T, p @ v, their einsums, h @ (model input), also after graph breaks; a linear
    and a product reading one x; parameter x parameter products."""
    checked("products", case)


@pytest.mark.slow     # 15-25 examples of 1-4 compiles each: 2.5-4.5 min on 2 cores
@settings(max_examples=20, **SETTINGS)
@given(case=cases(**SUITES["autocast"]))
def test_autocast_bf16_fp16(case):
    """The same under CPU autocast; compared with eager under the same autocast."""
    checked("autocast", case)


@pytest.mark.slow     # 15-25 examples of 1-4 compiles each: 2.5-4.5 min on 2 cores
@settings(max_examples=15, **SETTINGS)
@given(case=cases(**SUITES["recompute"]))
def test_recompute_operands(case):
    """``recompute_operands``: inputs rebuilt in backward (tanh/relu/gelu outputs, views) and
    W read from the parameter, on shared, tied and frozen weights, under autocast and in
    fp32: the same properties."""
    checked("recompute", case)


@pytest.mark.slow     # 15 examples of 1-4 compiles each
@settings(max_examples=15, **SETTINGS)
@given(case=cases(**SUITES["fp8_forward"]))
def test_fp8_forward_rewritten_into_every_spelling(case):
    """The FP8 forward (x's cast, W's operand, the scaled GEMM: ``passes/forward.py``) on
    every spelling, layout and view, two linears back to back included: row-wise under
    bf16 autocast, tensor-wise in fp32. Mostly multiples of 16 wide, so most sites take
    it (24: stays bf16 with its reason). On the CPU ``_scaled_mm`` runs its reference
    kernel; the GPU suite (``test_gpu_properties.py``) runs cuBLAS's."""
    checked("fp8_forward", case)


@pytest.mark.slow     # 10 examples of 1-4 compiles each
@settings(max_examples=10, **SETTINGS)
@given(case=cases(**SUITES["gated"]))
def test_fp8_forward_beside_sites_whose_backward_the_gate_keeps_exact(case):
    """The forward's FP8 gate decided apart from the backward's: a random half of the sites
    keep autograd's backward and take the FP8 forward alone, beside sites rewritten whole,
    on every spelling, layout and view of the FP8 forward suite."""
    checked("gated", case)


@pytest.mark.slow     # 10 examples of 1-4 compiles each
@settings(max_examples=10, **SETTINGS)
@given(case=cases(**SUITES["configs"]))
def test_structural_config_fields_drawn_per_case(case):
    """The FP8 forward suite's models under config fields drawn per case (``config_draw``):
    the forward's format, the g_x scale, the g_W format, ABC's place, operands rebuilt in
    backward, the partitioner's kept tensors, the cost gate off or tossing coins."""
    checked("configs", case)


def test_discovery_run_records_a_pass_and_a_failure(monkeypatch, tmp_path):
    """tests/discover_properties.py: a case of a suite from a seed of its own, checked as the
    suite's test checks it; a failed property is a record with its message, not a crash,
    and the run's exit status says that one failed."""
    import discover_properties as D
    rec = D.run_one("products", 5003)
    assert rec["ok"] and rec["sites"] >= rec["rewritten"] >= 1 and rec["worst_rel"] < 0.10, rec

    def broken(case):
        raise AssertionError("P2: grad of layer0.weight off")
    monkeypatch.setitem(D.P.CHECKS, "products", broken)
    rec = D.run_one("products", 5003)
    assert not rec["ok"] and "P2: grad of layer0.weight off" in rec["error"], rec
    out = tmp_path / "runs.jsonl"
    assert D.main(["products", "5003", "0", str(out)]) == 1
    (line,) = out.read_text().splitlines()
    assert json.loads(line)["ok"] is False


def test_a_cancelled_gradient_is_judged_on_absolute_error():
    """Property 2 below ``GRAD_FLOOR``: a gradient cancelled to 1e-5 of the example's largest
    passes with an error of half its own size (HOT's error follows its operands, not their
    cancelled product); a wrong gradient of 1e-4 of the largest, a 20% error on a normal
    one and a wrong direction are still caught."""
    g = torch.Generator().manual_seed(0)
    big = torch.randn(48, 48, generator=g, dtype=torch.float64)
    largest = float(big.norm())
    tol_rel, tol_cos = TOL[None]
    cancelled = torch.randn(16, 48, generator=g, dtype=torch.float64)
    cancelled *= 1e-5 * largest / cancelled.norm()
    noisy = cancelled + 0.5 * cancelled.norm() * torch.randn(16, 48, generator=g,
                                                            dtype=torch.float64) / 28
    assert rel_cos(noisy, cancelled)[0] > tol_rel              # the old bound failed it
    assert grad_verdict(noisy, cancelled, largest, tol_rel, tol_cos) is None
    small = cancelled * 10                                       # 1e-4 of the largest
    assert "cancelled below the floor" in grad_verdict(-small, small, largest, tol_rel, tol_cos)
    off = big + 0.2 * big.norm() * torch.randn(48, 48, generator=g, dtype=torch.float64) / 48
    assert "rel err" in grad_verdict(off, big, largest, tol_rel, tol_cos)
    assert grad_verdict(big, big, largest, tol_rel, tol_cos) is None
    assert grad_verdict(big.flip(0), big, largest, tol_rel, tol_cos) is not None


def test_the_cancelled_key_projection_discovery_found_now_passes():
    """The fifty-fifth stop's CPU discovery case (products, seed 5005): a key projection's
    gradient over 4 tokens cancels to ~7e-5 of the model's largest and missed the relative
    bound (0.128 > 0.10) by HOT's operand-scale error. Checked as the suite checks it; the
    case must still have that cancelled gradient (else this test no longer tests it)."""
    r = CHECKS["products"](build_case(random.Random(5005), **SUITES["products"]))
    exact = {n: ge for n, _, ge in grad_pairs(r) if ge is not None}
    largest = largest_norm(exact.values())
    assert any(below_floor(ge, largest) for ge in exact.values()), {
        n: float(ge.norm()) for n, ge in exact.items()}


def test_a_compile_error_plain_inductor_shares_is_not_hots(monkeypatch):
    """Property 1 blames HOT only where plain Inductor compiles the model: a raise both
    backends share is ``InductorFailsToo`` (the suites reject that example), one HOT's
    compile alone hits is a P1 failure."""
    import sys
    me = sys.modules[__name__]
    case = build_case(random.Random(5003), **SUITES["products"])
    real = me._step

    def both_fail(model, leaf, view, extras, case, compiled_with=None):
        if compiled_with is not None:
            raise RuntimeError("CppCompileError: C++ compile error")
        return real(model, leaf, view, extras, case)
    monkeypatch.setattr(me, "_step", both_fail)
    with pytest.raises(InductorFailsToo, match="plain Inductor raises"):
        run_case(case)

    def hot_fails(model, leaf, view, extras, case, compiled_with=None):
        if compiled_with is not None and compiled_with != "inductor":
            raise RuntimeError("an error in HOT's pass")
        return real(model, leaf, view, extras, case, compiled_with)
    monkeypatch.setattr(me, "_step", hot_fails)
    with pytest.raises(AssertionError, match="P1: compile/forward/backward raised"):
        run_case(case)


# ----------------------------------------------------------------------------- regressions
# Hand-minimised failures the properties above found; each failed on the code it names.


def _compile_and_compare(model, *inputs, autocast=None):
    """(report, fx warnings) of one compiled forward+backward, after checking every gradient
    against an eager run of a copy of ``model`` within TOL."""
    _fresh()
    ref = copy.deepcopy(model)
    ref_in = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    ctx = (lambda: torch.autocast("cpu", dtype=autocast)) if autocast else \
        (lambda: torch.autocast("cpu", enabled=False))
    with ctx():
        ref(*ref_in).float().square().mean().backward()
    be = hotcompile.backend(near_exact_config())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ctx():
            out = torch.compile(model, backend=be)(*inputs)
        out.float().square().mean().backward()
    tol_rel, tol_cos = TOL[autocast]
    pairs = [(n, p.grad, q.grad) for (n, p), q in zip(model.named_parameters(), ref.parameters())
             if p.requires_grad]
    pairs += [(f"input {j}", a.grad, b.grad) for j, (a, b) in enumerate(zip(inputs, ref_in))
              if a.requires_grad]
    for name, got, want in pairs:
        e, c = rel_cos(got, want)
        assert e <= tol_rel and c >= tol_cos, (name, e, c, str(be.report))
    _fresh()
    return be.report, [str(w.message) for w in caught if _FX_WARNING.search(str(w.message))]


def _rewritten(report, sig):
    return [r for r in report.layers if r.reason is None and (r.I, r.O) == sig]


class _FrozenSibling(torch.nn.Module):
    def __init__(self, spell_b="nn_linear"):
        super().__init__()
        self.a = torch.nn.Linear(16, 24, bias=False)
        self.b = torch.nn.Linear(16, 20, bias=False)
        self.b.requires_grad_(False)
        self.spell_b = spell_b

    def forward(self, x):
        a = self.a(x)                  # the frozen GEMM must come after the trainable one
        b = self.b(x) if self.spell_b == "nn_linear" else x @ self.b.weight.t()
        return torch.cat([a, b], -1)


@pytest.mark.parametrize("spell_b", ["nn_linear", "matmul_t"])
def test_regression_frozen_sibling_without_autograd_node_takes_trainable_g_w(spell_b):
    """OPEN at 77a9483. A frozen linear with no trainable bias whose x needs no grad makes
    no autograd node, so its forward GEMM carries the same seq_nr as the trainable linear
    reading the same 2-D x; the seq_nr check pairs it with the sibling's g_W GEMM: record
    (16, 20) says reason=None, g_W 'HLA', and the one g_W GEMM is rewritten twice
    (torch.fx: 'erase_node(mm_2) on an already erased node'). Found by
    test_frozen_shared_tied_fp32 (FrozenPair on the model input, x_grad=False)."""
    torch.manual_seed(0)
    m = _FrozenSibling(spell_b)
    report, fx_warnings = _compile_and_compare(m, torch.randn(13, 16))
    assert m.b.weight.grad is None
    frozen = [r for r in report.layers if (r.I, r.O) == (16, 20)]
    assert frozen and not any(str(r.gw_path).startswith("HLA") for r in frozen), str(report)
    assert len(_rewritten(report, (16, 24))) == 1, str(report)
    assert not fx_warnings, fx_warnings


def test_regression_frozen_sibling_with_other_width_takes_trainable_g_w():
    """Fixed in cca6578 (failed at ff7a360): with no seq_nr check, a frozen linear
    (40 -> 24) reading the same x as a trainable one (40 -> 16) took the trainable's g_W
    GEMM, whatever its bias: record (40, 24) said HLA."""
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(40, 16), torch.nn.Linear(40, 24)
            self.b.weight.requires_grad_(False)

        def forward(self, x):
            return torch.cat([self.a(x), self.b(x)], -1)

    torch.manual_seed(0)
    m = M()
    report, fx_warnings = _compile_and_compare(m, torch.randn(9, 40))
    assert m.b.weight.grad is None
    assert not any(str(r.gw_path).startswith("HLA") for r in report.layers
                   if (r.I, r.O) == (40, 24)), str(report)
    assert not fx_warnings, fx_warnings


def test_regression_model_input_operand_is_not_a_weight():
    """Fixed in cca6578 (failed at ff7a360): ``h @ b`` with b a model input that requires
    grad (not a parameter) was taken for a linear (any placeholder counted as a weight)
    and rewritten: record (32, 36) with HQ + HLA."""
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(32, 32)

        def forward(self, x, b):
            return torch.tanh(self.lin(x)) @ b

    torch.manual_seed(0)
    report, _ = _compile_and_compare(M(), torch.randn(21, 32),
                                     torch.randn(32, 36, requires_grad=True))
    assert not _rewritten(report, (32, 36)), str(report)
    assert len(report.rewritten) <= 1, str(report)


def test_regression_activations_after_graph_break_are_not_weights():
    """Fixed in cca6578 (failed at ff7a360): after a graph break q, k, v arrive as graph
    inputs; the 2-D ``q @ k.t()`` (36, 21) and ``p @ v`` (21, 24) were rewritten as
    linears with k / v as the weight."""
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q = torch.nn.Linear(32, 36, bias=False)
            self.k = torch.nn.Linear(32, 36, bias=False)
            self.v = torch.nn.Linear(32, 24, bias=False)

        def forward(self, x):
            q, k, v = self.q(x), self.k(x), self.v(x)
            torch._dynamo.graph_break()
            return (q @ k.t() / 6).softmax(-1) @ v

    torch.manual_seed(0)
    report, _ = _compile_and_compare(M(), torch.randn(21, 32, requires_grad=True))
    assert not _rewritten(report, (36, 21)) and not _rewritten(report, (21, 24)), str(report)
    assert len(report.rewritten) <= 3, str(report)


def test_regression_w_at_x_does_not_take_the_input_for_the_weight():
    """Fixed in cca6578 (failed at ff7a360): ``W @ x.t()`` with x the model input (21, 32)
    was rewritten with the roles swapped: x taken for the weight, record (I, O) = (32, 21)
    (HLA over W's rows as tokens, g_W through HQ)."""
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(40, 32) / 6)

        def forward(self, x):
            return torch.relu((self.w @ x.t()).t())

    torch.manual_seed(0)
    report, _ = _compile_and_compare(M(), torch.randn(21, 32, requires_grad=True))
    assert not _rewritten(report, (32, 21)), str(report)
