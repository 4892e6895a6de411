"""The prefix tree of a trace's block hashes, compressed into its core radix tree.

The steps follow the synthesizer design (Dynamo ``benchmarks/prefix_data_generator``):

1. :func:`build_block_graph`: a ``networkx.DiGraph`` with one node per hash id under a super-root
   (:data:`ROOT`). Node attributes: ``visits`` (requests whose path passes the node) and ``end`` (requests
   whose path ends there); edge attribute ``weight`` (requests that take the edge) and ``first_request``.
2. :func:`verify_tree`: every hash id must always follow the same parent (the root for a first block);
   otherwise :class:`TreePropertyError` names the offending hash id and its parents.
3. :func:`mark_leaves`: a node visited once belongs to a unique user prompt (``leaf=True``). Visits never
   grow going down a tree, so once-visited nodes form the tail of exactly one request's path.
4. :func:`merge_chains`: unary chains (a node with one child, where no request ends) become one node with a
   ``length`` (in blocks) and the tuple of original ``blocks``: a radix tree.
5. :func:`strip_leaves`: the once-visited nodes (after merging, one per request at most) are removed; their
   lengths become the empirical leaf-length distribution and their parents count them in ``cache_end``.
6. :func:`add_transition_cdfs`: each core node gets ``out_nodes`` (children, then the :data:`END` and
   :data:`CACHE_END` sentinels) and ``out_cdf``, the cumulative integer weights (child visits, requests that
   end at the node, requests that go on to a unique prompt). Weights sum to the node's ``visits``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import networkx as nx
import numpy as np

from kvmesh_bench.trace import TraceRequest

__all__ = [
    "CACHE_END",
    "END",
    "ROOT",
    "CoreTree",
    "TreePropertyError",
    "add_transition_cdfs",
    "build_block_graph",
    "extract_core_tree",
    "mark_leaves",
    "merge_chains",
    "request_exits",
    "strip_leaves",
    "verify_tree",
]

#: The super-root: parent of every request's first block.
ROOT = "<root>"
#: Transition sentinel: the request ends inside the core tree.
END = "<end>"
#: Transition sentinel: the request leaves the core tree for a unique user prompt (a fresh leaf).
CACHE_END = "<cache end>"


class TreePropertyError(ValueError):
    """The trace's hash ids do not form a prefix tree (some hash id follows two different parents)."""

    def __init__(self, hash_id: Hashable, parents: list[tuple[Hashable, int]], more: int = 0) -> None:
        self.hash_id = hash_id
        self.parents = parents
        described = ", ".join(f"{_name(parent)} (first in request #{row})" for parent, row in parents)
        message = (
            f"tree property violated: hash id {hash_id} has {len(parents)} parents: {described}; "
            "a hash id must always follow the same parent id"
        )
        if more:
            message += f" ({more} more hash id{'s' if more > 1 else ''} with several parents)"
        super().__init__(message)


def _name(node: Hashable) -> str:
    return "the root (first block)" if node == ROOT else f"hash id {node}"


def build_block_graph(requests: Sequence[TraceRequest]) -> nx.DiGraph:
    """One node per hash id under :data:`ROOT`, with visit/end counts and edge weights (see module doc)."""
    visits: Counter[Hashable] = Counter()
    ends: Counter[Hashable] = Counter()
    weights: Counter[tuple[Hashable, Hashable]] = Counter()
    first_request: dict[tuple[Hashable, Hashable], int] = {}
    for row, request in enumerate(requests, start=1):
        parent: Hashable = ROOT
        for block in request.hash_ids:
            visits[block] += 1
            edge = (parent, block)
            if edge not in weights:
                first_request[edge] = row
            weights[edge] += 1
            parent = block
        ends[parent] += 1
    graph: nx.DiGraph[Hashable] = nx.DiGraph()
    graph.add_node(ROOT, visits=len(requests), end=ends[ROOT])
    graph.add_nodes_from((block, {"visits": count, "end": ends[block]}) for block, count in visits.items())
    graph.add_edges_from(
        (parent, child, {"weight": weight, "first_request": first_request[(parent, child)]})
        for (parent, child), weight in weights.items()
    )
    return graph


def verify_tree(graph: nx.DiGraph) -> None:
    """Raise :class:`TreePropertyError` naming the first hash id with more than one parent."""
    offenders = [node for node, degree in graph.in_degree() if degree > 1]
    if not offenders:
        return
    node = offenders[0]
    parents = sorted(
        ((parent, graph.edges[parent, node]["first_request"]) for parent in graph.predecessors(node)),
        key=lambda item: item[1],
    )
    raise TreePropertyError(node, parents, more=len(offenders) - 1)


def mark_leaves(graph: nx.DiGraph) -> None:
    """Set ``leaf=True`` on every node visited exactly once (part of one unique user prompt)."""
    for node, data in graph.nodes(data=True):
        data["leaf"] = node != ROOT and data["visits"] == 1


def merge_chains(graph: nx.DiGraph) -> nx.DiGraph:
    """Contract unary chains into single nodes with a ``length`` (a radix tree).

    A node is merged with its only child when no request ends at it (so both have the same visit count).
    The merged node keeps the key of its first block; ``blocks`` lists the original hash ids in order.
    Needs :func:`mark_leaves` to have run. Children keep their first-appearance order.
    """
    merged: nx.DiGraph[Hashable] = nx.DiGraph()
    root = graph.nodes[ROOT]
    merged.add_node(ROOT, length=0, visits=root["visits"], end=root["end"], leaf=False, blocks=())
    stack: list[tuple[Hashable, Hashable]] = [(ROOT, child) for child in reversed(list(graph.successors(ROOT)))]
    successors = graph.succ
    nodes = graph.nodes
    while stack:
        parent, start = stack.pop()
        blocks = [start]
        current = start
        while nodes[current]["end"] == 0 and len(successors[current]) == 1:
            (child,) = successors[current]
            if nodes[child]["visits"] != nodes[current]["visits"]:  # pragma: no cover - impossible in a tree
                break
            blocks.append(child)
            current = child
        data = nodes[start]
        merged.add_node(
            start,
            length=len(blocks),
            visits=data["visits"],
            end=nodes[current]["end"],
            leaf=data["leaf"],
            blocks=tuple(blocks),
        )
        merged.add_edge(parent, start, weight=data["visits"])
        stack.extend((start, child) for child in reversed(list(successors[current])))
    return merged


def strip_leaves(merged: nx.DiGraph) -> tuple[nx.DiGraph, list[int]]:
    """Remove the leaf nodes of a merged tree (in place) and return it with the leaf lengths in blocks.

    Each core node gets ``cache_end``: the number of requests that continued from it into a unique leaf.
    """
    leaf_lengths: list[int] = []
    leaves: list[Hashable] = []
    for _, data in merged.nodes(data=True):
        data["cache_end"] = 0
    for node, data in merged.nodes(data=True):
        if data["leaf"]:
            (parent,) = merged.pred[node]
            merged.nodes[parent]["cache_end"] += 1
            leaf_lengths.append(data["length"])
            leaves.append(node)
    merged.remove_nodes_from(leaves)
    return merged, leaf_lengths


def add_transition_cdfs(core: nx.DiGraph) -> None:
    """Give each core node its outcomes (``out_nodes``) and cumulative integer weights (``out_cdf``)."""
    for node, data in core.nodes(data=True):
        outcomes: list[Hashable] = []
        cdf: list[int] = []
        total = 0
        for child in core.successors(node):
            weight = core.nodes[child]["visits"]
            total += weight
            outcomes.append(child)
            cdf.append(total)
        for sentinel, weight in ((END, data["end"]), (CACHE_END, data["cache_end"])):
            if weight > 0:
                total += weight
                outcomes.append(sentinel)
                cdf.append(total)
        if total != data["visits"]:  # pragma: no cover - guarded by verify_tree
            raise AssertionError(f"transition weights of {node} sum to {total}, not {data['visits']}")
        data["out_nodes"] = outcomes
        data["out_cdf"] = cdf


@dataclass
class CoreTree:
    """The core radix tree (shared prefixes) of a trace and the lengths of its unique leaves."""

    graph: nx.DiGraph
    leaf_lengths: list[int]
    num_requests: int
    num_blocks: int  # distinct hash ids in the trace

    def stats(self) -> dict[str, Any]:
        """Core tree size, depth, branching and the node- and leaf-length distributions."""
        graph = self.graph
        depth_nodes = {ROOT: 0}
        depth_blocks = {ROOT: 0}
        for parent, child in nx.bfs_edges(graph, ROOT):
            depth_nodes[child] = depth_nodes[parent] + 1
            depth_blocks[child] = depth_blocks[parent] + graph.nodes[child]["length"]
        core_nodes = [node for node in graph if node != ROOT]
        children = [graph.out_degree(node) for node in core_nodes if graph.out_degree(node) > 0]
        ends_in_core = sum(data["end"] for _, data in graph.nodes(data=True))
        return {
            "distinct_blocks": self.num_blocks,
            "core_nodes": len(core_nodes),
            "core_blocks": sum(graph.nodes[node]["length"] for node in core_nodes),
            "core_depth_nodes": max(depth_nodes.values()),
            "core_depth_blocks": max(depth_blocks.values()),
            "root_children": graph.out_degree(ROOT),
            "internal_nodes": len(children),
            "branching_mean": float(np.mean(children)) if children else 0.0,
            "branching_max": max(children, default=0),
            "node_length_blocks": summarize([graph.nodes[node]["length"] for node in core_nodes]),
            "unique_leaves": len(self.leaf_lengths),
            "leaf_length_blocks": summarize(self.leaf_lengths),
            "requests_with_unique_leaf": len(self.leaf_lengths) / self.num_requests,
            "requests_ending_in_core": ends_in_core / self.num_requests,
        }


def summarize(values: Sequence[float] | np.ndarray) -> dict[str, float | None]:
    """count, mean, p50, p90, p99, min and max of the values. An empty sequence has no statistics: None
    (JSON null, printed n/a), never 0, which would read as a measured zero (a one-request trace has no gaps)."""
    array = np.asarray(values, dtype=float)
    if array.size == 0:
        return {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None, "min": None, "max": None}
    p50, p90, p99 = np.percentile(array, [50, 90, 99])
    return {
        "count": int(array.size),
        "mean": float(array.mean()),
        "p50": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "min": float(array.min()),
        "max": float(array.max()),
    }


def extract_core_tree(requests: Sequence[TraceRequest]) -> CoreTree:
    """Run steps 1-6 of the module doc; raises :class:`TreePropertyError` for a trace that is not a tree."""
    graph = build_block_graph(requests)
    verify_tree(graph)
    mark_leaves(graph)
    num_blocks = graph.number_of_nodes() - 1
    core, leaf_lengths = strip_leaves(merge_chains(graph))
    add_transition_cdfs(core)
    return CoreTree(graph=core, leaf_lengths=leaf_lengths, num_requests=len(requests), num_blocks=num_blocks)


def request_exits(core: nx.DiGraph, requests: Sequence[TraceRequest]) -> list[tuple[list[Hashable], int]]:
    """Each request's walk through the core tree: the core nodes it passes (from :data:`ROOT`, in order)
    and how many of its blocks they cover (its shared prefix); the rest of its blocks are its unique leaf."""
    succ = core.succ
    nodes = core.nodes
    out: list[tuple[list[Hashable], int]] = []
    for request in requests:
        ids = request.hash_ids
        path: list[Hashable] = [ROOT]
        node: Hashable = ROOT
        i = 0
        while i < len(ids) and ids[i] in succ[node]:
            node = ids[i]
            i += nodes[node]["length"]
            path.append(node)
        out.append((path, i))
    return out
