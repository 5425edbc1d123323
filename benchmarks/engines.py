"""The ways of running a case: torch eager, torch.compile, tvmgraph untuned and tuned.

Each engine owns its copy of the model (same initial weights) and, for training, an
SGD-with-momentum optimizer; `step()` runs one inference call or one training step. Mode
`train_amp` is the training step in bfloat16 mixed precision with dynamic loss scaling (eager:
`torch.autocast` + `torch.amp.GradScaler`; tvmgraph: `enable_amp(True)` + `set_grad_scaler`),
to set beside the float32 `train` rows; `infer_amp` the inference call in bfloat16 mixed
precision (eager: under `torch.autocast`; tvmgraph: `enable_amp(True)`).
`tvmgraph` compiles with the default schedules only (tuning off); `frozen` is the same with
`enable_frozen_weights()` (inference only: the matmul weights packed once, not per call);
`tuned` first tunes the graph (`tvmgraph.tune`, `TUNE` sets the budget), then compiles with its
log.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

import tvmgraph

from .suite import Case

LR, MOMENTUM = 0.01, 0.9
ENGINES = ("eager", "compile", "tvmgraph", "frozen", "tuned")
INFERENCE_ONLY = ("frozen",)
MODES = ("infer", "infer_amp", "train", "train_amp")
INFERENCE_MODES = ("infer", "infer_amp")
# `tuned`: None uses the tuning log as it is (the memory probe's subprocess), else
# {"trials": N or None (the default budget), "minutes": M or None}; tuning reports are kept here.
TUNE: dict | None = None
TUNE_REPORTS: dict[str, object] = {}
# Where the models and inputs live: "cpu", or "cuda" (autocast's float16 and a CUDA GradScaler).
DEVICE = "cpu"


class _InferGraph(tvmgraph.nn.Graph):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def build(self, x):
        return self.model(x)


class _TrainGraph(tvmgraph.nn.Graph):
    def __init__(self, model: nn.Module, loss_fn: nn.Module, optimizer: torch.optim.Optimizer):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.add_optimizer(optimizer)

    def build(self, x, y):
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        return loss


def make_step(engine: str, mode: str, case: Case, model: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], object]:
    """A function running one inference call or training step of `model` with `engine`."""
    model = copy.deepcopy(model).to(DEVICE)
    loss_fn = case.loss_fn()
    if engine in ("tvmgraph", "frozen", "tuned"):
        graph = make_graph(mode, case, model)
        if engine == "frozen":
            graph.config.enable_frozen_weights(True)
        inputs = tuple(t.to(DEVICE) for t in case.inputs())
        inference = mode in INFERENCE_MODES
        _tuning(graph, engine, case, mode, inputs[:1] if inference else inputs)
        return (lambda x, y: graph(x)) if inference else graph
    if mode in INFERENCE_MODES:
        model.eval()
        fn = torch.compile(model) if engine == "compile" else model
        amp = mode == "infer_amp"

        def infer(x, y):
            with torch.no_grad(), torch.autocast(DEVICE, enabled=amp):  # the device's default dtype
                return fn(x)

        return infer

    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    amp = mode == "train_amp"
    fn = torch.compile(model) if engine == "compile" else model
    scaler = torch.amp.GradScaler(DEVICE, enabled=amp)  # disabled: scale() and step() are plain

    def train(x, y):
        with torch.autocast(DEVICE, enabled=amp):  # the device's default: bfloat16 on CPU, float16 on CUDA
            loss = loss_fn(fn(x), y)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        return loss

    return train


def make_graph(mode: str, case: Case, model: nn.Module) -> tvmgraph.nn.Graph:
    """tvmgraph's graph of `model` (on DEVICE, used as it is) for `mode`: inference, or a
    training step with SGD momentum (bfloat16/float16 AMP with a grad scaler for train_amp)."""
    if mode in INFERENCE_MODES:
        graph = _InferGraph(model.eval())
        graph.config.enable_amp(mode == "infer_amp")
        return graph
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    graph = _TrainGraph(model.train(), case.loss_fn(), optimizer)
    if mode == "train_amp":
        graph.config.enable_amp(True)
        graph.set_grad_scaler(torch.amp.GradScaler(DEVICE))
    return graph


def _tuning(graph: tvmgraph.nn.Graph, engine: str, case: Case, mode: str, example_args: tuple) -> None:
    """`tvmgraph`, `frozen`: no tuning log; `tuned`: tune first (per TUNE), then compile with the log."""
    if engine in ("tvmgraph", "frozen"):
        graph.config.enable_tuning(False)
        return
    if TUNE is not None:
        report = tvmgraph.tune(graph, *example_args, trials=TUNE.get("trials"), minutes=TUNE.get("minutes"))
        TUNE_REPORTS[f"{case.name} {mode}"] = report
