"""Pipeline parallelism over `torch.distributed`: each rank runs one stage of the model (GPipe).

`graph.<module>.to(tvmgraph.nn.GraphModule).set_stage(stage_id, placement)` gives modules a
stage; `config.set_gradient_accumulation_steps(n)` sets the micro-batches that flow through the
stages. Every rank runs the same script and calls the graph with the same arguments (the whole
batch); the graph traces build() once, cuts it into stages (pipeline_split.py), and each rank
compiles the programs of its own stage only:

    forward   (every stage but the last) received activations -> the activations it sends;
    backward  received activations and the gradients of what it sent -> the gradients of what
              it received, and its parameters' gradients summed over the micro-batches
              (accumulate_grads, training/accumulation.py, with the gradients of the received
              tensors as extra results); on the last stage: forward, loss and backward at once;
    update    apply_update on the stage's own parameters, once per call.

A call runs GPipe's schedule with re-materialization: the forward pass of every micro-batch
(each stage receives, computes, sends on), then their backward passes, in which each stage
recomputes its forward pass from the activations it received (so a stage keeps only those
between the two phases, not its intermediate values). Activations and their gradients travel by
`torch.distributed` point-to-point (isend/recv); the loss is the mean over micro-batches, as
with gradient accumulation, and with build()'s outputs goes from the last stage to every rank, so
that every rank's call returns the same values. Batch-norm statistics are updated by the
forward pass only (the recomputation's are dropped), once per micro-batch, as in eager
accumulation.

Parameters start in sync: before the first step every rank takes rank 0's parameters and
buffers (as in data parallel training). Afterwards a stage's parameters and optimizer state are
current only on the rank that runs it; `graph.state_dict()` is a collective that brings them to
every rank.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from .. import entry as entries
from ..errors import DistributedError, PipelineError, UnsupportedOptionError
from ..spec import Signature, TensorSpec, flatten
from ..trace import trace_build
from .accumulation import combine, micro_batches
from .data_parallel import Collectives, Ranks, program_digest
from .pipeline_split import PipelineSplit, StageProgram, check_stage_ops, split_stages, stage_modules
from .plan import TrainingPlan

if TYPE_CHECKING:
    from ..config import CompileOptions
    from ..debug import GraphLog
    from ..stages import CompiledGraph, TracedGraph

STAGE_MODULE = "stage"


def stage_ranks(graph: str, stages: Sequence[tuple[str, int, int]]) -> dict[int, int]:
    """{stage: rank} of `GraphConfig.pipeline_stages`, checked against the process group."""
    rank_of: dict[int, int] = {}
    for path, stage, rank in stages:
        if rank_of.setdefault(stage, rank) != rank:
            raise PipelineError(f"{graph}: pipeline stage {stage} is placed on ranks {rank_of[stage]} and {rank} "
                                f"('{path}'); every module of one stage runs on the same rank.")
    ranks = Ranks.current()
    count = max(rank_of) + 1
    world = ranks.world if ranks is not None else 1
    if ranks is None or world != count or sorted(rank_of.values()) != list(range(world)) or \
            sorted(rank_of) != list(range(count)):
        raise DistributedError(
            f"{graph}: set_stage gives {count} pipeline stage(s) on ranks {dict(sorted(rank_of.items()))} "
            f"(stage: rank), but the process group has {world} rank(s). Run one rank per stage (torchrun "
            f"--nproc_per_node {count}), number the stages 0..{count - 1} and place each on its own rank.")
    return rank_of


class PipelineEntry:
    """The compiled entry of a pipelined training graph on this rank; `Graph.__call__` runs it
    like a `CompiledGraph` (`run`, `traced`, `training`)."""

    data_parallel = None

    def __init__(self, traced: TracedGraph, split: PipelineSplit, rank_of: Mapping[int, int], ranks: Ranks,
                 steps: int, forward: CompiledGraph | None, backward: CompiledGraph, module: nn.Module,
                 modules: Mapping[str, nn.Module]):
        self.traced = traced
        self.split = split
        self.rank_of = dict(rank_of)
        self.ranks = ranks
        self.stage = next(s for s, r in rank_of.items() if r == ranks.rank)
        self.program = split.stages[self.stage]
        self.steps = steps
        self.forward = forward
        self.backward = backward
        self.device = backward.device  # where received tensors go (NCCL sends from the GPU)
        self.module = module  # the stage's FX module: its parameters and buffers are the model's
        self.modules = modules  # the graph's, whole
        self.collectives = Collectives(traced.graph_name, ranks)
        self.synced = False
        # Whether this rank holds every stage's current parameters (after gather_state, until
        # the next step): what tvmgraph.save needs.
        self.gathered = True
        self.comm_seconds = 0.0
        out = [n for n in split.stages[split.last].module.graph.nodes if n.op == "output"][0]
        *outputs, loss = (v.meta["val"] for v in out.args[0])
        self._outputs = [TensorSpec.of(v) for v in outputs]  # of one micro-batch
        self._loss_dtype = loss.dtype

    # What Graph reads from its last entry.
    training = property(lambda self: self.backward.training)
    plan = property(lambda self: self.backward.plan)
    lowered = property(lambda self: self.backward.lowered)

    def as_text(self) -> str:
        return self.backward.as_text()

    def run(self, flat: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
        self._check_and_sync()
        micro = micro_batches(flat, self.steps)
        last = self.stage == self.split.last
        sends: list[Any] = []
        trained = [p for g in self.backward.plan.groups for p in g.params]
        grads = [torch.zeros_like(p, memory_format=torch.contiguous_format) for p in trained]
        outputs, losses, saved = [], [], []
        for inputs in micro:  # the forward phase
            args = self._receive_activations() + [inputs[i] for i in self.program.arguments]
            if last:
                user, loss, grads = self._backward(args, [], grads, sends)
                outputs.append(user)
                losses.append(loss)
            else:
                sent = self.forward.run(args)[0]
                self._send_activations(sent, sends)
                saved.append(args)
        for args in saved:  # the backward phase (every stage but the last)
            _, _, grads = self._backward(args, self._receive_gradients(), grads, sends)
        self._wait(sends)
        self.backward.accumulation.update(self.backward, grads)
        self.gathered = False
        return self._results(outputs, losses)

    # ---- one micro-batch ----

    def _backward(self, args: list[torch.Tensor], cotangents: list[torch.Tensor], grads: list[torch.Tensor],
                  sends: list) -> tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor]]:
        """The stage's backward program on one micro-batch: gradients summed into `grads`, the
        received tensors' gradients sent back. A stage that ran its forward program already
        keeps the batch-norm statistics of that run, not of the recomputation."""
        keep = None if self.forward is None else [b.detach().clone() for b in self.module.buffers()]
        user, loss, tail, _ = self.backward.run_entry(args + cotangents, grads)
        if keep is not None:
            with torch.no_grad():
                for b, old in zip(self.module.buffers(), keep):
                    b.copy_(old)
        grads, received = list(tail[:len(grads)]), list(tail[len(grads):])
        self._send_gradients(received, sends)
        return user, loss, grads

    def _boundaries(self, names: Sequence[str]) -> list:
        return [self.split.boundaries[n] for n in names]

    def _tag(self, name: str, backward: bool) -> int:
        return 2 * list(self.split.boundaries).index(name) + int(backward)

    def _receive_activations(self) -> list[torch.Tensor]:
        out = []
        for b in self._boundaries(self.program.received):
            t = torch.empty(b.shape, dtype=b.dtype, device=self.device)
            self._p2p(dist.recv, t, self.rank_of[b.producer], self._tag(b.name, False), "receiving activations")
            out.append(t)
        return out

    def _send_activations(self, tensors: Sequence[torch.Tensor], sends: list) -> None:
        for b, t in zip(self._boundaries(self.program.sent), tensors):
            t = t.contiguous()
            for consumer in b.consumers:
                sends.append((self._p2p(dist.isend, t, self.rank_of[consumer], self._tag(b.name, False),
                                        "sending activations"), t))

    def _receive_gradients(self) -> list[torch.Tensor]:
        """The gradient of each floating-point tensor this stage sent, summed over its readers."""
        out = []
        for b in self._boundaries(self.program.sent):
            if not b.dtype.is_floating_point:
                continue
            total = torch.zeros(b.shape, dtype=b.dtype, device=self.device)
            for consumer in b.consumers:
                t = torch.empty(b.shape, dtype=b.dtype, device=self.device)
                self._p2p(dist.recv, t, self.rank_of[consumer], self._tag(b.name, True), "receiving gradients")
                total += t
            out.append(total)
        return out

    def _send_gradients(self, tensors: Sequence[torch.Tensor], sends: list) -> None:
        floating = [b for b in self._boundaries(self.program.received) if b.dtype.is_floating_point]
        for b, t in zip(floating, tensors):
            t = t.contiguous()
            sends.append((self._p2p(dist.isend, t, self.rank_of[b.producer], self._tag(b.name, True),
                                    "sending gradients"), t))

    def _p2p(self, op: Callable, tensor: torch.Tensor, peer: int, tag: int, what: str) -> Any:
        start = time.perf_counter()
        try:
            return op(tensor, peer, tag=tag)
        except Exception as e:  # noqa: BLE001  (gloo and NCCL raise their own classes)
            raise self.collectives._failed(f"{what} (stage {self.stage}, peer rank {peer})", e) from e
        finally:
            self.comm_seconds += time.perf_counter() - start

    def _wait(self, sends: list) -> None:
        for work, _ in sends:
            try:
                work.wait()
            except Exception as e:  # noqa: BLE001
                raise self.collectives._failed(f"sending from stage {self.stage}", e) from e

    # ---- the call ----

    def _check_and_sync(self) -> None:
        """Every rank runs the same program; before the first step, rank 0's model everywhere."""
        sig = self.traced.signature
        params = [(n, tuple(p.shape), str(p.dtype)) for n, p in self.module.named_parameters()]
        digest = program_digest([sig.args, sig.leaves, sig.module_modes, sorted(self.rank_of.items()),
                                 len(self.split.stages)])
        inputs = ", ".join(leaf.describe() for leaf in sig.leaves)
        self.collectives.check_same_program(digest, f"inputs ({inputs}), stage {self.stage} with {len(params)} "
                                                    f"parameters")
        if not self.synced:
            tensors = [t for m in self.modules.values() for t in [*m.parameters(), *m.buffers()]]
            self.collectives.broadcast(list({id(t): t for t in tensors}.values()), 0,
                                       "broadcasting rank 0's parameters and buffers")
            self.synced = True

    def _results(self, outputs: list[list[torch.Tensor]], losses: list[torch.Tensor]
                 ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """build()'s outputs and the mean loss, from the last stage to every rank."""
        source = self.rank_of[self.split.last]
        if self.stage == self.split.last:
            values = [combine(parts) for parts in zip(*outputs)] + [torch.stack(losses).mean()]
        else:
            shapes = [(s.shape[0] * self.steps, *s.shape[1:]) if s.shape else () for s in self._outputs]
            values = [torch.empty(shape, dtype=s.dtype, device=self.device) for shape, s in zip(shapes, self._outputs)]
            values.append(torch.empty((), dtype=self._loss_dtype, device=self.device))
        values = [v.contiguous() for v in values]
        self.collectives.broadcast(values, source, "broadcasting the loss and outputs from the last stage")
        return values[:-1], values[-1]

    def gather_state(self, optimizers: Sequence[torch.optim.Optimizer]) -> list[dict]:
        """Each stage's parameters and buffers from the rank that trains them to every rank, and
        each optimizer's torch state_dict with the state of every parameter (a collective)."""
        for stage, program in enumerate(self.split.stages):
            tensors = [*program.module.parameters(), *program.module.buffers()]
            self.collectives.broadcast(tensors, self.rank_of[stage], f"gathering stage {stage}'s parameters")
        self.gathered = True
        own = {id(p) for p in self.module.parameters()}
        return self.collectives.gather_optimizer_states(optimizers, lambda p: id(p) in own)


def compile_pipeline(graph_class: str, traced: TracedGraph, flat: Sequence[torch.Tensor],
                     optimizers: list, modules: Mapping[str, nn.Module], options: CompileOptions,
                     device: torch.device, log: GraphLog, whole: TrainingPlan | None = None) -> PipelineEntry:
    """Cut `traced` (build() on one micro-batch) into stages and compile this rank's (the module
    docstring); `flat`: the micro-batch's arguments, `whole`: the graph's plan, checked."""
    graph = traced.graph_name
    if not traced.result.has_backward or not optimizers:
        raise UnsupportedOptionError(f"{graph}: set_stage splits a training graph into pipeline stages; this graph "
                                     f"does not train (build() must call loss.backward() and the graph must have an "
                                     f"optimizer). Run an inference graph whole on each rank (no set_stage).")
    for what, on in (("enable_amp", options.amp), ("a grad scaler", whole is not None and whole.loss_scaling),
                     ("activation checkpointing", options.activation_checkpointing),
                     ("enable_dynamic_batch", options.dynamic_batch), ("enable_zero", options.zero_rank is not None)):
        if on:
            raise UnsupportedOptionError(f"{graph}: pipeline stages (set_stage) with {what} are not implemented "
                                         f"yet; turn {what} off for this graph, or train it without set_stage. "
                                         f"(Each stage already recomputes its forward pass in the backward pass.)")
    split = split_stages(traced.result.exported, stage_modules(options.pipeline_stages), graph)
    rank_of = stage_ranks(graph, options.pipeline_stages)
    ranks = Ranks.current()
    assert ranks is not None
    stage = next(s for s, r in rank_of.items() if r == ranks.rank)
    program = split.stages[stage]
    last = stage == split.last
    for earlier in split.stages[:-1]:  # every rank, so that every rank raises the same error
        check_stage_ops(earlier, graph)
    steps = options.gradient_accumulation_steps
    received = [torch.zeros(b.shape, dtype=b.dtype, device=device)
                for b in (split.boundaries[n] for n in program.received)]
    arguments = [flat[i] for i in program.arguments]
    named = [(f"{STAGE_MODULE}.{n}", p) for n, p in program.module.named_parameters()]
    plan = TrainingPlan.build(graph, optimizers, named, options.recompute_attention, only_present=True)
    stage_modules_ = {STAGE_MODULE: program.module}
    base = dataclasses.replace(options, pipeline_stages=(), data_parallel=1, zero_rank=None,
                               activation_checkpointing=())
    forward = None
    if not last:
        forward = _compile_stage(graph_class, graph, f"stage{stage}_forward", _forward_build(program.module),
                                 received + arguments, stage_modules_, None,
                                 dataclasses.replace(base, gradient_accumulation_steps=1), device, log)
        sent = [split.boundaries[n] for n in program.sent]
        cotangents = [torch.zeros(b.shape, dtype=b.dtype, device=device) for b in sent if b.dtype.is_floating_point]
        if not cotangents:
            raise PipelineError(f"{graph}: pipeline stage {stage} sends no floating-point tensor to later stages, so "
                                f"no gradient can reach its parameters. Move the stage boundary.")
        build = _surrogate_build(program.module, len(received) + len(arguments),
                                 [b.dtype.is_floating_point for b in sent])
        example = received + arguments + cotangents
        stage_options = dataclasses.replace(base, gradient_accumulation_steps=1, pipeline_stage=(stage, len(received)))
    else:
        build, example = _last_build(program.module), received + arguments
        stage_options = dataclasses.replace(base, gradient_accumulation_steps=steps,
                                            pipeline_stage=(stage, len(received)))
    backward = _compile_stage(graph_class, graph, f"stage{stage}_backward", build, example, stage_modules_, plan,
                              stage_options, device, log)
    entry = PipelineEntry(traced, split, rank_of, ranks, steps, forward, backward, program.module, modules)
    log.info(1, f"pipeline stage {stage} of {len(split.stages)} on rank {ranks.rank}: receives "
                f"{program.received or 'the arguments'}, sends {program.sent or 'the loss'}")
    return entry


def _forward_build(module: nn.Module) -> Callable:
    def build(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(module(*args))
    return build


def _surrogate_build(module: nn.Module, count: int, floating: Sequence[bool]) -> Callable:
    """The backward pass of a stage that sends its results on: the gradient of
    sum(<sent, its gradient>) is the stage's vector-Jacobian product."""
    def build(*args: torch.Tensor) -> None:
        sent = module(*args[:count])
        cotangents = iter(args[count:])
        terms = [(t * next(cotangents)).sum() for t, f in zip(sent, floating) if f]
        total = terms[0]
        for term in terms[1:]:
            total = total + term
        total.backward()
    return build


def _last_build(module: nn.Module) -> Callable:
    def build(*args: torch.Tensor) -> list[torch.Tensor]:
        *outputs, loss = module(*args)
        loss.backward()
        return list(outputs)
    return build


def _compile_stage(graph_class: str, graph: str, part: str, build: Callable, example: list[torch.Tensor],
                   modules: Mapping[str, nn.Module], plan: TrainingPlan | None, options: CompileOptions,
                   device: torch.device, log: GraphLog) -> CompiledGraph:
    from ..stages import TracedGraph

    name = f"{graph}.{part}"
    leaves, tree = flatten(tuple(example), "args")
    result = trace_build(name, build, dict(modules), tree, leaves, [f"in{i}" for i in range(len(leaves))])
    signature = Signature(tree, tuple(TensorSpec.of(t) for t in leaves), (), (), None, options)
    traced = TracedGraph(name, signature, tree, result)
    return entries.compile_or_load(graph_class, traced, plan, device, options, modules, log, build)
