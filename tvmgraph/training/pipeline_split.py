"""Cutting a traced training program into pipeline stages (`GraphModule.set_stage`).

Every op of build()'s torch.export program runs on one stage:

- an op called from a module given a stage runs on that stage (the innermost such module);
- any other op runs on the latest stage among its inputs (stage 0 when it reads only the
  call's arguments or parameters), so the loss computed after the last module runs on the
  last stage, which also returns build()'s outputs.

A stage is then its own FX program: `forward(*received, *arguments)`, where `received` are the
tensors earlier stages computed and this one reads (its "boundary" inputs) and `arguments` the
call's arguments it reads (every rank is called with the same arguments, so they are never
sent); it returns the tensors that later stages read, or, on the last stage, build()'s outputs
and the loss. The stage reads the parameters and buffers of its own modules: the same
`nn.Parameter` objects, so an optimizer step on them is the model's.

What cannot be cut is a `PipelineError` naming the module and the fix: a module on stage s
reading what a later stage computed (the stages must follow the order of the computation), a
parameter used on two stages (tied weights), a stage with no op, a value passed between stages
that is not a tensor.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import fx

from ..errors import PipelineError
from ..random_ops import draws_random_numbers

GUARDS_MODULE = "_guards_fn"  # what ExportedProgram.module() adds to check the call's shapes


@dataclass
class StageProgram:
    """One stage: its FX program and where its inputs come from."""

    index: int
    module: fx.GraphModule
    received: list[str] = field(default_factory=list)  # boundary names, in input order
    arguments: list[int] = field(default_factory=list)  # flat call arguments read, after `received`
    sent: list[str] = field(default_factory=list)  # boundary names returned (every stage but the last)


@dataclass(frozen=True)
class Boundary:
    """A tensor that stage `producer` computes and the stages `consumers` read."""

    name: str
    producer: int
    consumers: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class PipelineSplit:
    stages: list[StageProgram]
    boundaries: dict[str, Boundary]

    @property
    def last(self) -> int:
        return len(self.stages) - 1


def split_stages(exported: torch.export.ExportedProgram, stage_of_module: Mapping[str, int],
                 graph: str) -> PipelineSplit:
    """Cut `exported` (build() with its loss last among the outputs) into the stages of
    `stage_of_module` (module path in the graph -> stage); see the module docstring."""
    gm = exported.module()
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target == GUARDS_MODULE:
            gm.graph.erase_node(node)
    count = max(stage_of_module.values()) + 1
    stage, arguments = _assign(gm.graph, stage_of_module, count, graph)
    used = sorted({s for n, s in stage.items() if n.op not in ("placeholder", "get_attr", "output")})
    if used != list(range(count)):
        empty = sorted(set(range(count)) - set(used))
        paths = [p for p, s in stage_of_module.items() if s in empty]
        raise PipelineError(f"{graph}: pipeline stage(s) {empty} run no op of build() (modules given those stages: "
                            f"{', '.join(paths) or 'none'}). Number the stages 0..n-1 in the order build() calls "
                            f"them, each with at least one module that build() calls.")
    boundaries = _boundaries(gm.graph, stage, count, graph)
    stages = [_stage_program(gm, stage, s, count, boundaries, arguments) for s in range(count)]
    return PipelineSplit(stages, boundaries)


def _module_stage(node: fx.Node, stage_of_module: Mapping[str, int]) -> tuple[int, str] | None:
    """(stage, path) of the innermost module given a stage that `node` was called from."""
    found = None
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        for staged, s in stage_of_module.items():
            if path == staged or path.startswith(staged + "."):
                if found is None or len(staged) > len(found[1]):
                    found = (s, staged)
    return found


def _assign(g: fx.Graph, stage_of_module: Mapping[str, int], count: int,
            graph: str) -> tuple[dict[fx.Node, int], dict[fx.Node, int]]:
    """The stage of every op (the module docstring), and each placeholder's argument index."""
    stage: dict[fx.Node, int] = {}
    arguments: dict[fx.Node, int] = {}
    for node in g.nodes:
        if node.op == "placeholder":
            arguments[node] = len(arguments)
            continue
        if node.op == "get_attr":
            continue
        inputs = [stage[a] for a in node.all_input_nodes if a in stage]
        latest = max(inputs, default=0)
        if node.op == "output":
            stage[node] = count - 1
            continue
        own = _module_stage(node, stage_of_module)
        if own is not None and own[0] < latest:
            raise PipelineError(
                f"{graph}: '{own[1]}' runs on pipeline stage {own[0]} but reads a value that stage {latest} "
                f"computes ({node.target}). The stages must follow the order of the computation: give "
                f"'{own[1]}' stage {latest} or later, or the modules before it earlier stages.")
        stage[node] = own[0] if own is not None else latest
    for node in g.nodes:
        if node.op != "get_attr":
            continue
        readers = sorted({stage[u] for u in node.users})
        if len(readers) > 1:
            raise PipelineError(
                f"{graph}: '{node.target}' is read on pipeline stages {readers} (a weight tied between modules "
                f"of different stages, such as a shared embedding and output layer). A tensor of the model "
                f"lives on one stage: put the modules that share it on the same stage.")
        stage[node] = readers[0] if readers else 0
    return stage, arguments


def _boundaries(g: fx.Graph, stage: Mapping[fx.Node, int], count: int, graph: str) -> dict[str, Boundary]:
    """Every value that a later stage reads than the one computing it."""
    found: dict[str, Boundary] = {}
    for node in g.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        later = tuple(sorted({stage[u] for u in node.users if stage[u] > stage[node]}))
        if not later:
            continue
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            raise PipelineError(f"{graph}: pipeline stage {stage[node]} passes {node.name} "
                                f"({type(value).__name__}) to stage {later[0]}; only tensors can go from one stage "
                                f"to another. Move the stage boundary so that a tensor crosses it.")
        found[node.name] = Boundary(node.name, stage[node], later, tuple(value.shape), value.dtype)
    return found


def _stage_program(gm: fx.GraphModule, stage: Mapping[fx.Node, int], index: int, count: int,
                   boundaries: Mapping[str, Boundary], arguments: Mapping[fx.Node, int]) -> StageProgram:
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    program = StageProgram(index, gm)
    nodes = list(gm.graph.nodes)
    for node in nodes:  # received tensors first, in the order they were computed
        b = boundaries.get(node.name)
        if node.op not in ("placeholder", "get_attr") and b is not None and index in b.consumers:
            env[node] = g.placeholder(node.name)
            env[node].meta = dict(node.meta)
            program.received.append(node.name)
    for node in nodes:  # then the call's arguments that this stage reads
        if node.op == "placeholder" and any(stage[u] == index for u in node.users):
            env[node] = g.node_copy(node)
            program.arguments.append(arguments[node])
    for node in nodes:
        if node.op in ("placeholder", "output") or stage[node] != index:
            continue
        env[node] = g.node_copy(node, lambda n: env[n])
    if index < count - 1:
        program.sent = [name for name, b in boundaries.items() if b.producer == index]
        by_name = {n.name: n for n in nodes}
        g.output(tuple(env[by_name[name]] for name in program.sent))
    else:
        out = next(n for n in nodes if n.op == "output")
        g.output(fx.map_arg(out.args[0], lambda n: env[n]))
    program.module = fx.GraphModule(gm, g, f"Stage{index}")
    return program


def check_stage_ops(program: StageProgram, graph: str) -> None:
    """A stage other than the last runs its forward pass twice, once to send its activations and
    once more, recomputed, in the backward pass: a random op (dropout) would draw another
    mask the second time, so it is refused there."""
    for node in program.module.graph.nodes:
        target = node.target
        if draws_random_numbers(node):
            raise PipelineError(
                f"{graph}: pipeline stage {program.index} calls {target} (random), and tvmgraph recomputes each "
                f"stage's forward pass in its backward pass (GPipe's re-materialization), which would draw new "
                f"random numbers. Put the random ops (dropout) on the last stage, or train without them "
                f"(p=0, or module.eval() for those modules).")


def stage_modules(stages: Sequence[tuple[str, int, int]]) -> dict[str, int]:
    """{module path: stage} of `GraphConfig.pipeline_stages`."""
    return {path: stage for path, stage, _ in stages}
