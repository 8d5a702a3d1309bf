"""The sets of aten ops the passes walk through, each named for what it means.

Why one module: "a view" means different things to different passes. The token analysis
follows shape-only views (a token dimension survives a reshape, not a transpose); the weight
and gradient casts follow layout changes too; the partitioner-cost analysis follows anything
that leaves the same data, casts and clones included, and the kept-tensor analysis also
what reads a part of it (``saved_readers.VIEWS``). Before this module six passes each owned
a set of their own with one of those meanings; the names below say which one a pass uses,
and a new op is added in one place.
"""
from __future__ import annotations

import torch

aten = torch.ops.aten
prims = torch.ops.prims

# a dtype cast and nothing else (autocast's copies, the partitioner's casts)
CASTS = frozenset({prims.convert_element_type.default, aten._to_copy.default})

# the same elements in the same order, only the shape changes
RESHAPES = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default})

# a shape change that adds or removes size-1 or merged dimensions
SHAPE_VIEWS = RESHAPES | {aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
                          aten.unsqueeze.default, aten.flatten.using_ints, aten.unflatten.int}

# the same elements in another order
TRANSPOSES = frozenset({aten.permute.default, aten.t.default, aten.transpose.int})

# what a weight or its gradient goes through between its GEMM and its parameter
LAYOUT_VIEWS = RESHAPES | TRANSPOSES

# X's data under another name: a pass that asks "is X kept anyway?" looks through these
SAME_DATA = LAYOUT_VIEWS | CASTS | {aten.clone.default, aten.alias.default,
                                    aten.expand.default, aten.squeeze.dim,
                                    aten.unsqueeze.default}
