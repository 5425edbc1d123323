"""One rank of a distributed test: `python -m tests.distributed.worker CASE RANK WORLD PORT OUT`.

Each case trains in a gloo process group on 127.0.0.1 and saves what the test compares
(torch.save to OUT/rank<R>.pt); tests/distributed/test_data_parallel.py starts the ranks.
"""

from __future__ import annotations

import copy
import datetime
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import tvmgraph
from tests.conftest import TrainGraph
from tests.models import SmallCNN, mlp

STEPS = 10
GLOBAL_BATCH = 16


def batches(shape: tuple[int, ...], classes: int, steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batches of every step: the same on every rank (one seed)."""
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(GLOBAL_BATCH, *shape, generator=g), torch.randint(0, classes, (GLOBAL_BATCH,), generator=g))
            for _ in range(steps)]


def shard(batch: tuple[torch.Tensor, ...], rank: int, world: int) -> tuple[torch.Tensor, ...]:
    return tuple(t.chunk(world)[rank].contiguous() for t in batch)


def model_for(case: str) -> nn.Module:
    torch.manual_seed(0)
    return SmallCNN(width=4) if case.startswith("cnn") else mlp((12, 32, 32, 5))


def data_for(case: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return batches((3, 8, 8), 10) if case.startswith("cnn") else batches((12,), 5)


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)


def adam(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=1e-2)


def train_graph(case: str, rank: int, world: int) -> dict:
    """The graph on this rank's shard; for a model with batch norm, eager DDP beside it (the same
    per-rank statistics), else only the graph (the test compares with one process)."""
    model = model_for(case)
    if rank == 1:  # rank 1 starts from other weights: the graph must broadcast rank 0's
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    reference = copy.deepcopy(model_for(case))
    optimizer = adam(model) if "adam" in case else sgd(model)
    graph = TrainGraph(model, nn.CrossEntropyLoss(), optimizer)
    if "accum" in case:
        graph.config.set_gradient_accumulation_steps(2)
    # `scaler`: a GradScaler growing every 2 clean steps; at step 3 rank 1's shard holds an inf
    scaler, ref_scaler = (torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=2) for _ in range(2))
    if "scaler" in case:
        graph.set_grad_scaler(scaler)
    else:
        ref_scaler = torch.amp.GradScaler("cpu", enabled=False)  # passes everything through
    ddp = torch.nn.parallel.DistributedDataParallel(reference)
    ref_optimizer = adam(reference) if "adam" in case else sgd(reference)
    losses, ref_losses, scales = [], [], []
    for step, batch in enumerate(data_for(case)):
        x, y = shard(batch, rank, world)
        if "scaler" in case and step == 3 and rank == 1:
            x[0, 0] = float("inf")
        losses.append(float(graph(x, y)))
        ref_optimizer.zero_grad()
        if "accum" in case:  # DDP accumulation: backward per micro-batch, all-reduce on the last
            with ddp.no_sync():
                ref_scaler.scale(nn.functional.cross_entropy(ddp(x[:len(x) // 2]), y[:len(y) // 2]) / 2).backward()
            ref_scaler.scale(nn.functional.cross_entropy(ddp(x[len(x) // 2:]), y[len(y) // 2:]) / 2).backward()
        else:
            loss = nn.functional.cross_entropy(ddp(x), y)
            ref_scaler.scale(loss).backward()
            ref_losses.append(float(loss))
        ref_scaler.step(ref_optimizer)
        ref_scaler.update()
        if "scaler" in case:
            scales.append((scaler.get_scale(), ref_scaler.get_scale()))
    return {"state": {k: v.clone() for k, v in model.state_dict().items()},
            "ref_state": {k: v.clone() for k, v in reference.state_dict().items()},
            "losses": losses, "ref_losses": ref_losses, "num_compiled": graph.num_compiled, "scales": scales}


def zero(case: str, rank: int, world: int) -> dict:
    """ZeRO stage 1 (`zero2`: stage 2) for 5 steps, a state_dict gathered on every rank, a new graph resumed from it for 5 more."""
    model = model_for(case)
    optimizer = adam(model)
    graph = TrainGraph(model, nn.CrossEntropyLoss(), optimizer)
    stage = 2 if case == "zero2" else 1
    graph.config.enable_zero(True, stage=stage)
    data = data_for(case)
    for batch in data[:5]:
        graph(*shard(batch, rank, world))
    owned_state_bytes = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                            if torch.is_tensor(t))
    saved = copy.deepcopy(graph.state_dict())
    resumed_model = model_for(case)
    resumed_optimizer = adam(resumed_model)
    resumed = TrainGraph(resumed_model, nn.CrossEntropyLoss(), resumed_optimizer)
    resumed.config.enable_zero(True, stage=stage)
    resumed.load_state_dict(copy.deepcopy(saved))  # (as in eager, training updates loaded state in place)
    for batch in data[5:]:
        graph(*shard(batch, rank, world))
        resumed(*shard(batch, rank, world))
    return {"state": {k: v.clone() for k, v in model.state_dict().items()},
            "resumed_state": {k: v.clone() for k, v in resumed_model.state_dict().items()},
            "saved_optimizer": saved["optimizers"][0], "owned_state_bytes": owned_state_bytes}


def mismatch(case: str, rank: int, world: int) -> dict:
    """Rank 1 calls with a batch of another shape: every rank gets a DistributedError."""
    model = model_for("mlp")
    graph = TrainGraph(model, nn.CrossEntropyLoss(), sgd(model))
    x, y = shard(data_for("mlp")[0], rank, world)
    if rank == 1:
        x, y = x[:-1], y[:-1]
    try:
        graph(x, y)
    except tvmgraph.errors.DistributedError as e:
        return {"error": str(e)}
    return {"error": None}


def sync_batch_norm(case: str, rank: int, world: int) -> dict:
    """A model with SyncBatchNorm: a clear error on every rank, not a silent per-rank statistic."""
    model = nn.Sequential(nn.Linear(12, 8), nn.SyncBatchNorm(8), nn.Linear(8, 5))
    graph = TrainGraph(model, nn.CrossEntropyLoss(), sgd(model))
    try:
        graph(*shard(data_for("mlp")[0], rank, world))
    except tvmgraph.errors.UnsupportedOptionError as e:
        return {"error": str(e)}
    return {"error": None}


def zero_scaler(case: str, rank: int, world: int) -> dict:
    """ZeRO with a GradScaler: a clear error on every rank (each would check only its share)."""
    model = model_for("mlp")
    graph = TrainGraph(model, nn.CrossEntropyLoss(), sgd(model))
    graph.config.enable_zero(True)
    graph.set_grad_scaler(torch.amp.GradScaler("cpu"))
    try:
        graph(*shard(data_for("mlp")[0], rank, world))
    except tvmgraph.errors.UnsupportedOptionError as e:
        return {"error": str(e)}
    return {"error": None}


def dead_rank(case: str, rank: int, world: int) -> dict:
    """Rank 1 dies after two steps; rank 0's next step must fail with a DistributedError."""
    model = model_for("mlp")
    graph = TrainGraph(model, nn.CrossEntropyLoss(), sgd(model))
    data = data_for("mlp")
    for step, batch in enumerate(data):
        if rank == 1 and step == 2:
            os._exit(3)
        start = time.monotonic()
        try:
            graph(*shard(batch, rank, world))
        except tvmgraph.errors.DistributedError as e:
            return {"error": str(e), "step": step, "seconds": time.monotonic() - start}
    return {"error": None}


MICRO_BATCHES = 4


def stage_paths(case: str) -> list[str]:
    """The two stages of the case's model (the rest of it runs on the stage of its inputs)."""
    return ["model.features", "model.classifier"] if case.startswith("pipeline_cnn") else ["model.0", "model.2"]


def pipeline_graph(case: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> TrainGraph:
    graph = TrainGraph(model, nn.CrossEntropyLoss(), optimizer)
    for stage, path in enumerate(stage_paths(case)):
        module = graph
        for name in path.split("."):
            module = module[int(name)] if name.isdigit() else getattr(module, name)
        module.to(tvmgraph.nn.GraphModule).set_stage(stage, [stage])
    graph.config.set_gradient_accumulation_steps(MICRO_BATCHES)
    return graph


def pipeline(case: str, rank: int, world: int) -> dict:
    """Two pipeline stages, 4 micro-batches, the whole global batch on every rank: 7 steps, the
    state gathered on every rank, a new graph resumed from it for 3 more beside the first."""
    model = model_for(case.removeprefix("pipeline_"))
    if rank == 1:  # rank 1 starts from other weights: the graph must broadcast rank 0's
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    optimizer = adam(model) if "adam" in case else sgd(model)
    graph = pipeline_graph(case, model, optimizer)
    data = data_for(case.removeprefix("pipeline_"))
    losses = [float(graph(*batch)) for batch in data[:7]]
    saved = copy.deepcopy(graph.state_dict())
    resumed_model = model_for(case.removeprefix("pipeline_"))
    resumed_optimizer = adam(resumed_model) if "adam" in case else sgd(resumed_model)
    resumed = pipeline_graph(case, resumed_model, resumed_optimizer)
    resumed.load_state_dict(copy.deepcopy(saved))
    resumed_losses = []
    for batch in data[7:]:
        losses.append(float(graph(*batch)))
        resumed_losses.append(float(resumed(*batch)))
    try:  # this rank holds one stage's trained weights: saving first needs the gather
        tvmgraph.save(graph, Path(os.environ["TEST_OUT"]) / f"graph{rank}")
        save_error = None
    except tvmgraph.errors.SaveError as e:
        save_error = str(e)
    final = graph.state_dict()
    resumed_final = resumed.state_dict()
    return {"saved": saved, "final": final["modules"]["model"], "resumed": resumed_final["modules"]["model"],
            "losses": losses, "resumed_losses": resumed_losses, "num_compiled": graph.num_compiled,
            "save_error": save_error,
            "stage_params": sorted(n for n, _ in graph.compiled.module.named_parameters())}


class Encoder(nn.Module):
    """Two transformer encoder layers (attention without dropout) between a projection and a head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(12, 32)
        self.layers = nn.ModuleList([nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
                                     for _ in range(2)])
        self.head = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h.mean(1))


def pipeline_encoder(case: str, rank: int, world: int) -> dict:
    """A transformer cut between its two layers, against the same graph trained in this process
    alone with gradient accumulation (data parallel off): AdamW, 5 steps."""
    torch.manual_seed(0)
    model = Encoder()
    alone = copy.deepcopy(model)
    graph = TrainGraph(model, nn.CrossEntropyLoss(), torch.optim.AdamW(model.parameters(), lr=1e-2))
    graph.model.embed.to(tvmgraph.nn.GraphModule).set_stage(0)
    graph.model.layers[0].to(tvmgraph.nn.GraphModule).set_stage(0)
    graph.model.layers[1].to(tvmgraph.nn.GraphModule).set_stage(1)
    graph.model.head.to(tvmgraph.nn.GraphModule).set_stage(1)
    reference = TrainGraph(alone, nn.CrossEntropyLoss(), torch.optim.AdamW(alone.parameters(), lr=1e-2))
    reference.config.enable_data_parallel(False)
    for g in (graph, reference):
        g.config.set_gradient_accumulation_steps(MICRO_BATCHES)
    g = torch.Generator().manual_seed(1)
    losses, ref_losses = [], []
    for _ in range(5):
        x, y = torch.randn(GLOBAL_BATCH, 6, 12, generator=g), torch.randint(0, 5, (GLOBAL_BATCH,), generator=g)
        losses.append(float(graph(x, y)))
        ref_losses.append(float(reference(x, y)))
    return {"state": graph.state_dict()["modules"]["model"], "ref_state": alone.state_dict(),
            "losses": losses, "ref_losses": ref_losses}


def pipeline_dead(case: str, rank: int, world: int) -> dict:
    """Rank 1 (the last stage) dies after two steps: rank 0's next call must fail with a
    DistributedError within the timeout."""
    model = model_for("mlp")
    graph = pipeline_graph("pipeline_mlp", model, sgd(model))
    for step, batch in enumerate(data_for("mlp")):
        if rank == 1 and step == 2:
            os._exit(3)
        start = time.monotonic()
        try:
            graph(*batch)
        except tvmgraph.errors.DistributedError as e:
            return {"error": str(e), "step": step, "seconds": time.monotonic() - start}
    return {"error": None}


def pipeline_error(case: str, rank: int, world: int) -> dict:
    """Stages that cannot run: a clear error on every rank."""
    if case == "pipeline_dropout":  # random numbers on a stage that recomputes its forward pass
        model = nn.Sequential(nn.Linear(12, 32), nn.Dropout(0.5), nn.ReLU(), nn.Linear(32, 5))
        stages = [("0", 0, 0), ("1", 0, 0), ("3", 1, 1)]
    else:  # stages 0 and 2 on two ranks: stage 1 is missing
        model = mlp((12, 32, 32, 5))
        stages = [("0", 0, 0), ("4", 2, 1)]
    graph = TrainGraph(model, nn.CrossEntropyLoss(), sgd(model))
    for index, stage, placement in stages:
        graph.model[int(index)].to(tvmgraph.nn.GraphModule).set_stage(stage, placement)
    try:
        graph(*data_for("mlp")[0])
    except tvmgraph.errors.TvmGraphError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return {"error": None}


CASES = {"mlp": train_graph, "mlp_adam": train_graph, "mlp_accum": train_graph, "cnn": train_graph,
         "mlp_accum_scaler": train_graph,
         "zero": zero, "zero2": zero, "mismatch": mismatch, "syncbn": sync_batch_norm, "zero_scaler": zero_scaler, "dead": dead_rank,
         "pipeline_mlp": pipeline, "pipeline_encoder": pipeline_encoder,
         "pipeline_dead": pipeline_dead, "pipeline_mlp_adam": pipeline, "pipeline_cnn": pipeline,
         "pipeline_dropout": pipeline_error, "pipeline_ranks": pipeline_error}


def main() -> None:
    case, rank, world, port, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=int(os.environ.get("TEST_PG_TIMEOUT", "60"))))
    os.environ["TEST_OUT"] = str(out)
    result = CASES[case](case, rank, world)
    torch.save(result, out / f"rank{rank}.pt")
    if not case.endswith("dead"):
        dist.barrier()
    # torch's teardown of a gloo group sometimes aborts the process ("terminate called without an
    # active exception"), always with a dead peer: the results are saved, leave without it.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
