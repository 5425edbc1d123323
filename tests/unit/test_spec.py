"""Argument trees and call signatures (tvmgraph.spec)."""

from __future__ import annotations

import pytest
import torch

from tvmgraph.spec import NotATreeError, Signature, TensorSpec, TreeDef, flatten


def test_flatten_unflatten_round_trip() -> None:
    a, b, c = torch.ones(1), torch.zeros(2), torch.ones(3)
    tree = (a, [b, None, (c,)], None)
    leaves, treedef = flatten(tree)
    assert leaves == [a, b, c]
    assert treedef.num_leaves == 3
    rebuilt = treedef.unflatten(leaves)
    assert isinstance(rebuilt, tuple) and isinstance(rebuilt[1], list) and isinstance(rebuilt[1][2], tuple)
    assert rebuilt[0] is a and rebuilt[1][0] is b and rebuilt[1][1] is None and rebuilt[1][2][0] is c
    assert repr(treedef) == "(T, [T, None, (T,)], None)"


def test_a_tuple_of_tensors_flattens_to_the_same_tree_as_any_other_tuple() -> None:
    """Graph arguments take a shortcut (one shared TreeDef per length): it must equal what the
    general walk builds, or a call would miss its compiled entry; a tuple holding anything else
    (a list, None, a Parameter is still a tensor) takes the walk."""
    a, b = torch.ones(1), torch.nn.Parameter(torch.zeros(2))
    leaves, fast = flatten((a, b))
    assert leaves == [a, b] and isinstance(leaves, list)
    assert fast == TreeDef("tuple", (TreeDef("tensor"), TreeDef("tensor"))) and hash(fast) == hash(
        TreeDef("tuple", (TreeDef("tensor"), TreeDef("tensor"))))
    assert flatten((b, a))[1] is fast
    assert flatten(())[1] == TreeDef("tuple", ())
    _, mixed = flatten((a, [b]))
    assert mixed == TreeDef("tuple", (TreeDef("tensor"), TreeDef("list", (TreeDef("tensor"),)))) != fast
    with pytest.raises(NotATreeError):
        flatten((a, 1.0))


def test_leaf_paths_name_nested_leaves() -> None:
    _, treedef = flatten([torch.ones(1), [torch.ones(1), torch.ones(1)]])
    assert treedef.leaf_paths("xs") == ["xs.0", "xs.1.0", "xs.1.1"]


def test_flatten_reports_where_a_bad_value_is() -> None:
    with pytest.raises(NotATreeError) as info:
        flatten((torch.ones(1), [torch.ones(1), {"a": 1}]))
    assert info.value.path == "[1][1]['a']" and info.value.value == 1
    with pytest.raises(NotATreeError) as info:
        flatten([{0: torch.ones(1)}])  # a dict's keys must be strings
    assert info.value.path == "[0]"


def test_dicts_round_trip_in_key_order() -> None:
    a, b = torch.ones(1), torch.zeros(2)
    leaves, treedef = flatten({"logits": a, "aux": (None, {"b": b})})
    assert leaves == [a, b] and treedef.leaf_paths("out") == ["out.logits", "out.aux.1.b"]
    rebuilt = treedef.unflatten(leaves)
    assert list(rebuilt) == ["logits", "aux"] and rebuilt["aux"][1]["b"] is b
    assert repr(treedef) == "{'logits': T, 'aux': (None, {'b': T})}"
    assert flatten({"b": a, "a": a})[1] != flatten({"a": a, "b": a})[1]  # order is part of the structure


def test_unflatten_rejects_extra_leaves() -> None:
    _, treedef = flatten((torch.ones(1),))
    with pytest.raises(ValueError, match="more leaves"):
        treedef.unflatten([torch.ones(1), torch.ones(1)])


def test_tensor_spec_repr() -> None:
    spec = TensorSpec.of(torch.ones(64, 784))
    assert repr(spec) == "Tensor([64, 784], float32, cpu)"
    assert spec.describe() == "float32[64, 784]"


def _signature(*shapes: tuple[int, ...], modes: tuple[bool, ...] = (False,)) -> Signature:
    leaves, tree = flatten(tuple(torch.ones(s) for s in shapes))
    return Signature(tree, tuple(TensorSpec.of(t) for t in leaves), modes)


def test_equal_signatures_hash_alike() -> None:
    assert _signature((2, 3)) == _signature((2, 3))
    assert len({_signature((2, 3)), _signature((2, 3)), _signature((4, 3))}) == 2


def test_differences_list_every_change() -> None:
    old = _signature((2, 3), (5,), modes=(False, False))
    new = _signature((4, 3), (6,), modes=(True, False))
    diffs = new.differences(old, ["x", "y"], ["model", "model.0"])
    assert diffs == [
        "argument 'x' was float32[2, 3] on cpu, now float32[4, 3] on cpu",
        "argument 'y' was float32[5] on cpu, now float32[6] on cpu",
        "module mode changed: 'model' eval -> train",
    ]


def test_differences_report_structure_changes() -> None:
    old = _signature((2,))
    _, tree = flatten(([torch.ones(2)],))
    new = Signature(tree, (TensorSpec.of(torch.ones(2)),), (False,))
    assert new.differences(old, ["x"], ["model"]) == ["argument structure (T,) became ([T],)"]
    assert isinstance(tree, TreeDef)
