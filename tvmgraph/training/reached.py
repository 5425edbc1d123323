"""Which parameters `loss.backward()` gives a gradient.

torch leaves `.grad` None on a parameter the loss does not depend on (an unused head, a module
run under `torch.no_grad()`, a value taken through `.detach()` or an integer), and its
optimizers skip such a parameter: no weight decay, no momentum, no state. The training plan
(plan.py) updates only the parameters found here; before, an unused parameter took the
optimizer's step with a zero gradient, and AdamW's weight decay moved it.

- `from_autograd`: tracing runs build() on fake tensors with autograd on, so the leaves of the
  loss's autograd graph are exactly eager's.
- `from_program`: under AMP, build() is traced at the ATen level with autograd off; the
  exported program is read instead: a parameter is reached when a path of floating-point
  values leads from it to the loss, not through `tvmgraph::stop_gradient` (detach, no_grad
  blocks: stop_gradient.py) and not through an op whose result is new values of the input's
  shape only (`zeros_like`, ...).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..stop_gradient import STOP

# Ops whose result takes only the shape (and dtype) of their input, not its values.
_SHAPE_ONLY = {getattr(torch.ops.aten, name).default for name in (
    "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like",
    "new_zeros", "new_ones", "new_empty", "new_full")}


def from_autograd(loss: torch.Tensor, root: torch.nn.Module) -> frozenset[str]:
    """The paths of `root`'s parameters that are leaves of `loss`'s autograd graph."""
    leaves = set()
    for node in _autograd_nodes(loss):
        variable = getattr(node, "variable", None)  # AccumulateGrad: a leaf that gets .grad
        if variable is not None:
            leaves.add(id(variable))
    return frozenset(path for path, p in root.named_parameters() if id(p) in leaves)


def autograd_functions(loss: torch.Tensor) -> list[type]:
    """The `torch.autograd.Function` classes the loss is differentiated through, in the order
    met: their backward() is the user's, which the graph's autodiff does not run."""
    found = []
    for node in _autograd_nodes(loss):
        cls = getattr(node, "_forward_cls", None)  # a Python Function's backward node
        if cls is not None and cls not in found:
            found.append(cls)
    return found


def _autograd_nodes(loss: torch.Tensor) -> Iterator[object]:
    seen, pending = set(), [loss.grad_fn]
    while pending:
        node = pending.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        yield node
        pending.extend(next_node for next_node, _ in node.next_functions)


def from_program(exported: torch.export.ExportedProgram) -> frozenset[str]:
    """The paths of the parameters from which a differentiable path leads to the loss, the
    program's last user output (trace.py appends it)."""
    signature = exported.graph_signature
    loss_name = signature.user_outputs[-1]
    nodes = {node.name: node for node in exported.graph.nodes}
    parameter_of = signature.inputs_to_parameters
    reached, seen, pending = set(), set(), [nodes[loss_name]]
    while pending:
        node = pending.pop()
        if node.name in seen or not _carries_gradient(node):
            continue
        seen.add(node.name)
        if node.op == "placeholder" and node.name in parameter_of:
            reached.add(parameter_of[node.name])
        elif node.op == "call_function" and node.target is not STOP and node.target not in _SHAPE_ONLY:
            pending.extend(node.all_input_nodes)
    return frozenset(reached)


def _carries_gradient(node: torch.fx.Node) -> bool:
    """A floating-point tensor, or a tuple holding one (a multi-output op, read by getitem)."""
    value = node.meta.get("val")
    values = value if isinstance(value, (list, tuple)) else [value]
    return any(isinstance(v, torch.Tensor) and v.is_floating_point() for v in values)
