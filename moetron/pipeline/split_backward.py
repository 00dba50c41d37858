"""Split backward (zero-bubble B / W): input gradients now (`backward_input`), weight gradients
later (`WeightGradients`) from the gradients captured where the graph's input path ends, without
redoing the input path."""

from __future__ import annotations

import collections
import functools
from collections.abc import Sequence

import torch
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge, Node


@functools.cache
def _function_nodes_outlive_outputs() -> bool:
    """Whether a custom autograd Function's node stays usable once the tensors it made are freed
    (torch 2.13: yes; 2.11: its Python object outlives the graph's node, and autograd refuses it)."""
    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * 2

    node = Probe.apply(torch.ones(1, requires_grad=True)).grad_fn  # its output is freed here
    try:
        node._input_metadata
    except RuntimeError:
        return False
    return True


def _node(t: torch.Tensor) -> Node:
    """The autograd node a gradient for `t` enters (its AccumulateGrad node for a leaf)."""
    if t.grad_fn is not None:
        return t.grad_fn
    return t.view_as(t).grad_fn.next_functions[0][0]


class WeightGradients:
    """The weight-gradient half of a split backward, captured by `backward_input`.

    The graph from the outputs splits into nodes that lead to an input (the input path, run
    by `backward_input`) and nodes that lead only to weights. `backward_input` records the
    gradients entering each input-path node that has a weight-only child; `run` then
    differentiates from those nodes to the weights, one connected weight-only region at a
    time, so the input path is not run again. (Where one recorded node reaches another
    through the input path inside one region, e.g. a weight used both by a tied head and an
    MTP embedding, that stretch is re-run and the recorded gradient is pinned with a hook.)
    """

    def __init__(self, groups, captured, root_seeds, keep=()):
        # The nodes held here keep the weight side of the graph alive until run(); the
        # rest (above the recorded nodes) is freed with the outputs, unless `keep` holds them.
        self.groups = groups  # [(frontier nodes, [(root node, nr)], [AccumulateGrad nodes])]
        self.captured = captured  # frontier node -> gradients entering it
        self.root_seeds = root_seeds  # (node, nr) -> gradient, for outputs off the input path
        self.keep = keep  # the outputs, where a recorded custom Function's node would die with them

    def run(self) -> None:
        for frontier, roots, weights in self.groups:
            edges, seeds = [], []
            for node in frontier:
                for i, g in enumerate(self.captured.get(node, ())):
                    if g is not None:
                        edges.append(GradientEdge(node, i))
                        seeds.append(g)
            for node, nr in roots:
                edges.append(GradientEdge(node, nr))
                seeds.append(self.root_seeds[(node, nr)])
            if not edges:
                continue
            handles = []
            if len(frontier) > 1:  # pin recorded gradients against a re-run of the input path
                for node in frontier:
                    grads = self.captured.get(node)
                    if grads is not None:
                        handles.append(node.register_prehook(lambda _, g=grads: g))
            try:  # accumulates through the weights' own AccumulateGrad nodes (their hooks run)
                torch.autograd.backward(edges, seeds, retain_graph=True,
                                        inputs=[acc.variable for acc in weights])
            finally:
                for h in handles:
                    h.remove()
        self.groups = self.captured = self.root_seeds = self.keep = None


def backward_input(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                   inputs: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor | None], WeightGradients]:
    """Gradients of `inputs` only; the weight gradients are left to the returned object."""
    out_nodes = [_node(o) for o in outputs]
    input_nodes = {_node(x) for x in inputs if x.requires_grad}
    children: dict[Node, list[Node]] = {}
    parents: dict[Node, list[Node]] = collections.defaultdict(list)
    stack = list(dict.fromkeys(out_nodes))
    seen = set(stack)
    # Discovery order, the same on every rank running the same graph. Iterating the set would
    # follow memory addresses, and the weight regions (whose backward may all-reduce, e.g. the
    # grads of sequence-parallel norms) would run in a different order on each TP rank.
    order = list(stack)
    while stack:
        node = stack.pop()
        kids = [fn for fn, _ in node.next_functions if fn is not None]
        children[node] = kids
        for fn in kids:
            parents[fn].append(node)
            if fn not in seen:
                seen.add(fn)
                order.append(fn)
                stack.append(fn)

    def reaching(targets) -> set[Node]:
        found, todo = set(targets), list(targets)
        while todo:
            for p in parents[todo.pop()]:
                if p not in found:
                    found.add(p)
                    todo.append(p)
        return found

    on_input_path = reaching(input_nodes & seen)
    weight_nodes = [n for n in order if hasattr(n, "variable") and n not in input_nodes]
    to_weights = reaching(weight_nodes)
    weight_only = to_weights - on_input_path

    # Union-find over weight-only nodes and the input-path nodes feeding them.
    parent: dict[Node, Node] = {}

    def find(n: Node) -> Node:
        while parent.setdefault(n, n) is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    frontier = []
    for node in order:
        kids = [k for k in children[node] if k in weight_only]
        if node in weight_only or kids:
            find(node)
        for k in kids:
            parent[find(k)] = find(node)
        if kids and node in on_input_path:
            frontier.append(node)
    root_seeds = {}
    for o, g, node in zip(outputs, grads, out_nodes):
        if node in weight_only:
            edge = torch.autograd.graph.get_gradient_edge(o)
            root_seeds[(edge.node, edge.output_nr)] = g
    regions: dict[Node, tuple[list, list, list]] = {}
    for node in frontier:
        regions.setdefault(find(node), ([], [], []))[0].append(node)
    for node, nr in root_seeds:
        regions.setdefault(find(node), ([], [], []))[1].append((node, nr))
    for node in weight_nodes:
        if node in weight_only:
            regions.setdefault(find(node), ([], [], []))[2].append(node)

    captured: dict[Node, tuple] = {}
    handles = [n.register_prehook(lambda g, n=n: captured.__setitem__(n, tuple(g))) for n in frontier]
    try:
        wanted = [x for x in inputs if x.requires_grad]
        path_outputs = [(o, g) for o, g, n in zip(outputs, grads, out_nodes) if n in on_input_path]
        dx = list(torch.autograd.grad([o for o, _ in path_outputs], wanted, [g for _, g in path_outputs],
                                      retain_graph=True, allow_unused=True)) if wanted and path_outputs \
            else [None] * len(wanted)
    finally:
        for h in handles:
            h.remove()
    it = iter(dx)
    input_grads = [next(it) if x.requires_grad else None for x in inputs]
    groups = [r for r in regions.values() if r[2]]
    keep = ()
    if not _function_nodes_outlive_outputs() and any(isinstance(n, BackwardCFunction) for n in frontier):
        keep = tuple(outputs)  # torch 2.11: the graph above them stays until run(), as its nodes need
    return input_grads, WeightGradients(groups, captured, root_seeds, keep)
