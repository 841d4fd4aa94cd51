"""Graphs that call an op no graph executable can hold (a kernel given as source, kernels/_source.py):
split at each such call into partitions (docs/kernels.md, "The lower-level form").

    AOTAutograd graph:   a → mul → [mylib::axpy] → getitem → sum → out
    split:               partition 0 (mul)  |  partition 1 (axpy, getitem)  |  partition 2 (sum)
                         one executable        the op's own launch              one executable

A kernel the compiler cannot see into (C++ over data pointers) is a region boundary: the graph around it
stays compiled, one executable per partition, instead of the whole graph running op by op. Partitions
follow the graph's order (a node joins the partition open when it comes), so each one only reads the
graph's inputs and earlier partitions' results.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
from torch.fx.passes.split_module import split_module

#: Ops graphs call as they are, between compiled partitions (`kernels/_source.py` registers each source
#: kernel's operator through `call_between`).
BETWEEN: set[Any] = set()


def call_between(op: Any) -> None:
    """Graphs compiled from now on call `op` as it is (its own launch), compiling the rest around it."""
    BETWEEN.add(op)


def _between(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in BETWEEN


class Partition:
    """One partition of a split graph: `gm` (its graph) and whether it is compiled (else it holds one
    `BETWEEN` call and the getitems of its results, or returns nothing, and runs as it is). A compiled
    partition's graph returns a tuple; `single`: the parent graph reads its one value, not a tuple."""

    def __init__(self, gm: torch.fx.GraphModule, compiled: bool, single: bool) -> None:
        self.gm, self.compiled, self.single = gm, compiled, single


def split(gm: torch.fx.GraphModule,
          compile_part: Callable[[Partition], Callable[..., Any]]) -> torch.fx.GraphModule | None:
    """None when `gm` calls no `BETWEEN` op. Else the graph that calls its partitions in order: each
    partition the function `compile_part(partition)` returns, called with the partition's inputs."""
    if not any(_between(n) for n in gm.graph.nodes):
        return None
    # 1. Number the partitions: each BETWEEN call (with the getitems of its results) is one of its own.
    ids: dict[torch.fx.Node, int] = {}
    part = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        if _between(node):
            part += 1
            ids[node] = part
            part += 1
        elif node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node) and _between(node.args[0]):
            ids[node] = ids[node.args[0]]
        else:
            ids[node] = part
    parent = split_module(gm, None, lambda n: ids[n], keep_original_order=True)
    # 2. Each partition's call becomes a call of what `compile_part` made of it (a plain function call:
    # no nn.Module call around it).
    for node in list(parent.graph.nodes):
        if node.op != "call_module":
            continue
        sub = parent.get_submodule(str(node.target))
        out = next((n for n in sub.graph.nodes if n.op == "output"), None)
        compiled = out is not None and not any(_between(n) for n in sub.graph.nodes)
        single = compiled and not isinstance(out.args[0], (tuple, list))
        if single:  # a compiled graph returns a tuple of its results
            out.args = ((out.args[0],),)
            sub.recompile()
        node.op, node.target = "call_function", compile_part(Partition(sub, compiled, single))
    parent.delete_all_unused_submodules()
    parent.graph.lint()
    parent.recompile()
    return parent
