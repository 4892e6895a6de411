"""The core radix tree: tree-property check, chain merging, leaf stripping and transition weights."""

import pytest
from kvmesh_bench.datagen.prefix_tree import (
    CACHE_END,
    END,
    ROOT,
    TreePropertyError,
    build_block_graph,
    extract_core_tree,
    mark_leaves,
    merge_chains,
    verify_tree,
)
from kvmesh_bench.trace import TraceRequest


def reqs(*paths):
    return [TraceRequest(i, 512 * len(p), 1, tuple(p)) for i, p in enumerate(paths)]


def merged(*paths):
    graph = build_block_graph(reqs(*paths))
    verify_tree(graph)
    mark_leaves(graph)
    return merge_chains(graph)


def test_tree_violation_names_the_hash_id_and_its_parents():
    # hash id 2 follows 1 in request #1 and 3 in request #3
    with pytest.raises(TreePropertyError) as caught:
        extract_core_tree(reqs([1, 2], [1, 4], [3, 2]))
    assert caught.value.hash_id == 2
    assert caught.value.parents == [(1, 1), (3, 3)]
    assert str(caught.value) == (
        "tree property violated: hash id 2 has 2 parents: hash id 1 (first in request #1), "
        "hash id 3 (first in request #3); a hash id must always follow the same parent id"
    )


def test_tree_violation_with_the_root_as_a_parent_and_a_count_of_the_others():
    # 5 is a first block in request #1 and follows 9 in request #2; 7 also has two parents
    with pytest.raises(TreePropertyError) as caught:
        extract_core_tree(reqs([5, 7], [9, 5], [8, 7]))
    message = str(caught.value)
    assert "hash id 5 has 2 parents: the root (first block) (first in request #1), hash id 9 (first in request #2)" in (
        message
    )
    assert message.endswith("(1 more hash id with several parents)")


def test_a_repeated_id_inside_one_request_breaks_the_tree():
    with pytest.raises(TreePropertyError, match="hash id 1 has 2 parents"):
        extract_core_tree(reqs([1, 2, 1]))


def test_unary_chain_of_three_becomes_one_node_of_length_three():
    graph = merged([0, 1, 2, 3, 4], [0, 1, 2, 3, 5], [0, 6])
    assert graph.nodes[1]["length"] == 3
    assert graph.nodes[1]["blocks"] == (1, 2, 3)
    assert graph.nodes[1]["visits"] == 2
    assert 2 not in graph and 3 not in graph
    assert list(graph.successors(ROOT)) == [0]
    assert list(graph.successors(0)) == [1, 6]
    assert list(graph.successors(1)) == [4, 5]


def test_chain_is_not_merged_past_a_node_where_a_request_ends():
    graph = merged([0, 1, 2], [0, 1, 2], [0, 1])
    assert graph.nodes[0]["blocks"] == (0, 1)  # 0 and 1 are always visited together: merged
    assert graph.nodes[0]["end"] == 1  # ... and one request ends at 1, so 2 stays apart
    assert graph.nodes[2]["length"] == 1
    assert graph.nodes[2]["end"] == 2


def test_leaf_stripping_yields_the_leaf_length_distribution():
    tree = extract_core_tree(reqs([0, 1, 2], [0, 3], [0, 4, 5, 6], [0, 7, 8], [0, 7, 9]))
    assert sorted(tree.leaf_lengths) == [1, 1, 1, 2, 3]  # (3) (8) (9) (1 2) (4 5 6)
    assert set(tree.graph.nodes) == {ROOT, 0, 7}
    assert tree.graph.nodes[0]["cache_end"] == 3
    assert tree.graph.nodes[7]["cache_end"] == 2
    stats = tree.stats()
    assert stats["core_nodes"] == 2 and stats["core_blocks"] == 2
    assert stats["unique_leaves"] == 5 and stats["leaf_length_blocks"]["max"] == 3
    assert stats["requests_with_unique_leaf"] == 1.0
    assert stats["distinct_blocks"] == 10


def test_transition_cdfs_include_end_and_cache_end_and_sum_to_visits():
    tree = extract_core_tree(reqs([0, 1, 2], [0, 1, 2], [0, 1, 3], [0], [0, 4]))
    graph = tree.graph
    assert graph.nodes[ROOT]["out_nodes"] == [0] and graph.nodes[ROOT]["out_cdf"] == [5]
    # node 0: three requests go on to 1, one ends at 0, one continues into the unique leaf (4)
    assert graph.nodes[0]["out_nodes"] == [1, END, CACHE_END]
    assert graph.nodes[0]["out_cdf"] == [3, 4, 5]
    assert graph.nodes[1]["out_nodes"] == [2, CACHE_END]
    assert graph.nodes[1]["out_cdf"] == [2, 3]
    assert graph.nodes[2]["out_nodes"] == [END]
    stats = tree.stats()
    assert stats["core_depth_nodes"] == 3 and stats["branching_max"] == 1
    assert stats["requests_ending_in_core"] == pytest.approx(3 / 5)
