"""Data-parallel training over `torch.distributed`, and ZeRO stage 1 on top of it.

In a process group the user initialized (`torchrun`, `init_process_group`) with more than one
rank, a training graph's call runs on the rank's shard of the global batch, as under
`DistributedDataParallel`:

    check     every rank is about to run the same program (one tiny all-gather per call)
    compile   rank 0's parameters and buffers are broadcast once, before the first step
    call      rank 0's buffers are broadcast (DDP's broadcast_buffers), then
              accumulate_grads (once per micro-batch; loss / (micro-batches x ranks))
              all-reduce (sum) of the gradients, in buckets: the mean over the global batch
              apply_update: every rank the same update, so the parameters stay in sync

The program is the one gradient accumulation compiles (training/accumulation.py): the gradients
leave the compiled program between the backward pass and the update, and `torch.distributed`
carries them; tvmgraph has no transport of its own. The buckets are all-reduced asynchronously,
one after the other, so the transfers overlap with each other, not with the backward pass (it is
one VM call).

ZeRO stage 1 (`config.enable_zero(True)`): each parameter is owned by one rank (the largest first,
each to the rank that owns the fewest bytes so far); a rank compiles the update of its own
parameters only and keeps only their optimizer state (about 1/N of it), then every owner
broadcasts its updated parameters. `graph.state_dict()` gathers the whole optimizer state on
every rank (a collective: call it on all ranks).

Any failure of a collective (a rank that died, a timeout) becomes a `DistributedError` naming the
graph, the rank and the step, raised on every rank within the process group's timeout.
"""

from __future__ import annotations

import functools
import hashlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from ..errors import DistributedError

if TYPE_CHECKING:
    from ..config import CompileOptions
    from .plan import TrainingPlan

BUCKET_BYTES = 25 << 20  # DDP's default bucket_cap_mb


@dataclass(frozen=True)
class Ranks:
    """This process's place in the default process group."""

    rank: int
    world: int

    @staticmethod
    def current() -> Ranks | None:
        """The default group's rank and size, or None outside a group of more than one rank."""
        if not (dist.is_available() and dist.is_initialized()):
            return None
        world = dist.get_world_size()
        return Ranks(dist.get_rank(), world) if world > 1 else None


def owners(sizes: Sequence[int], world: int) -> list[int]:
    """The rank that owns each parameter under ZeRO: largest first, to the least loaded rank
    (ties: the lower rank), the same on every rank. Remembered per sizes: every ZeRO step asks."""
    return list(_owners(tuple(sizes), world))


@functools.lru_cache(maxsize=16)
def _owners(sizes: tuple[int, ...], world: int) -> tuple[int, ...]:
    load = [0] * world
    owner = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owner[index] = rank
        load[rank] += sizes[index]
    return tuple(owner)


def program_digest(parts: Sequence[object]) -> int:
    """A 63-bit digest of what makes two ranks' programs the same (no object ids in `parts`)."""
    return int.from_bytes(hashlib.sha256(repr(tuple(parts)).encode()).digest()[:8], "little") >> 1


class Collectives:
    """The collectives one graph runs, each turning a failure into a DistributedError."""

    def __init__(self, graph: str, ranks: Ranks):
        self.graph = graph
        self.ranks = ranks

    def _failed(self, what: str, e: BaseException) -> DistributedError:
        return DistributedError(
            f"{self.graph}: rank {self.ranks.rank} of {self.ranks.world}: {what} failed ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}). Another rank most likely stopped (an error, a crash, "
            f"or it did not call the graph); see its log. Every rank must call the graph the same number of times "
            f"with inputs of the same shapes.")

    def check_same_program(self, digest: int, describe: str) -> None:
        """Raise on every rank when the ranks are not about to run the same program."""
        mine = torch.tensor([digest], dtype=torch.int64)
        gathered = [torch.empty_like(mine) for _ in range(self.ranks.world)]
        try:
            dist.all_gather(gathered, mine)
        except Exception as e:  # noqa: BLE001  (gloo and NCCL raise their own classes)
            raise self._failed("checking that every rank runs the same program", e) from e
        if all(int(g) == digest for g in gathered):
            return
        descriptions: list[object] = [None] * self.ranks.world
        try:
            dist.all_gather_object(descriptions, describe)
        except Exception as e:  # noqa: BLE001
            raise self._failed("gathering each rank's program", e) from e
        lines = "\n".join(f"  rank {r}: {d}" for r, d in enumerate(descriptions))
        raise DistributedError(
            f"{self.graph}: the ranks called the graph with different programs (input shapes, dtypes, "
            f"models or options differ):\n{lines}\nEvery rank must run the same model on a batch of the same "
            f"shape (split the global batch evenly: DistributedSampler with drop_last=True).")

    def broadcast(self, tensors: Sequence[torch.Tensor], src: int, what: str) -> None:
        """Every tensor of `tensors` (same list on every rank) set to rank `src`'s value, in place."""
        try:
            for bucket in _buckets(tensors):
                if len(bucket) == 1 and bucket[0].is_contiguous():
                    dist.broadcast(bucket[0].detach(), src)
                    continue
                flat = torch.cat([t.detach().reshape(-1) for t in bucket])
                dist.broadcast(flat, src)
                if self.ranks.rank != src:
                    _unflatten_into(flat, bucket)
        except Exception as e:  # noqa: BLE001
            raise self._failed(what, e) from e

    def all_reduce_sum(self, tensors: Sequence[torch.Tensor]) -> None:
        """Sum `tensors` over the ranks in place, bucket by bucket, all buckets in flight at once."""
        try:
            pending = []
            for bucket in _buckets(tensors):
                flat = torch.cat([t.reshape(-1) for t in bucket]) if len(bucket) > 1 else bucket[0]
                pending.append((dist.all_reduce(flat, async_op=True), flat, bucket))
            for work, flat, bucket in pending:
                work.wait()
                if len(bucket) > 1:
                    _unflatten_into(flat, bucket)
        except Exception as e:  # noqa: BLE001
            raise self._failed("all-reducing the gradients", e) from e

    def reduce_sum(self, tensors: Sequence[torch.Tensor], owner: Sequence[int]) -> None:
        """Sum each tensor of `tensors` over the ranks into the rank `owner` names for it (ZeRO
        stage 2: half the traffic of an all-reduce), bucket by bucket, all in flight at once."""
        try:
            pending = []
            for rank in range(self.ranks.world):
                for bucket in _buckets([t for t, o in zip(tensors, owner) if o == rank]):
                    flat = torch.cat([t.reshape(-1) for t in bucket]) if len(bucket) > 1 else bucket[0]
                    pending.append((dist.reduce(flat, rank, async_op=True), flat, bucket, rank))
            for work, flat, bucket, rank in pending:
                work.wait()
                if len(bucket) > 1 and rank == self.ranks.rank:
                    _unflatten_into(flat, bucket)
        except Exception as e:  # noqa: BLE001
            raise self._failed("reducing the gradients to their owners", e) from e

    def gather_optimizer_states(self, optimizers: Sequence[torch.optim.Optimizer],
                                owned: Callable[[torch.Tensor], bool] = lambda p: True) -> list[dict]:
        """Each optimizer's torch state_dict with the state of every parameter, each taken from
        the rank that holds it: the state this rank keeps of the parameters `owned` selects goes
        to every rank (a collective)."""
        index = {id(p): (i, j) for i, o in enumerate(optimizers)
                 for j, p in enumerate(p for g in o.param_groups for p in g["params"])}
        mine = {index[id(p)]: {k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in o.state[p].items()}
                for o in optimizers for p in list(o.state) if owned(p)}
        merged: dict[tuple[int, int], dict] = {}
        for part in self.gather_objects(mine, "gathering the optimizer state"):
            merged.update(part)
        docs = []
        for i, optimizer in enumerate(optimizers):
            doc = optimizer.state_dict()
            doc["state"] = {j: state for (o, j), state in sorted(merged.items()) if o == i}
            docs.append(doc)
        return docs

    def gather_objects(self, value: object, what: str) -> list[object]:
        out: list[object] = [None] * self.ranks.world
        try:
            dist.all_gather_object(out, value)
        except Exception as e:  # noqa: BLE001
            raise self._failed(what, e) from e
        return out


def _buckets(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Consecutive tensors of one dtype, about BUCKET_BYTES each (a bigger tensor goes alone)."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if not buckets or size + nbytes > BUCKET_BYTES or buckets[-1][0].dtype != t.dtype:
            buckets.append([])
            size = 0
        buckets[-1].append(t)
        size += nbytes
    return buckets


def _unflatten_into(flat: torch.Tensor, bucket: Sequence[torch.Tensor]) -> None:
    offset = 0
    with torch.no_grad():
        for t in bucket:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def update_plan(plan: TrainingPlan, options: CompileOptions, graph: str) -> TrainingPlan:
    """The parameters this rank's program updates: under ZeRO its share, else all of `plan`'s."""
    if options.zero_rank is None:
        return plan
    return plan.owned(graph, options.zero_rank, options.data_parallel)


def trained_parameters(optimizers: Sequence[torch.optim.Optimizer]) -> list[torch.nn.Parameter]:
    """The parameters the graph updates, in the order of its TrainingPlan (training/plan.py)."""
    return [p for o in optimizers for g in o.param_groups for p in g["params"] if p.requires_grad]


class DataParallel:
    """A training graph's data-parallel state on this rank (the module docstring)."""

    def __init__(self, graph: str, ranks: Ranks):
        self.graph = graph
        self.ranks = ranks
        self.collectives = Collectives(graph, ranks)
        self.synced = False
        self._digests: dict[object, tuple[int, str]] = {}
        self.comm_seconds = 0.0  # time in the gradient all-reduce and ZeRO's broadcasts (benchmarks)

    def before_call(self, key: object, describe: Callable[[], tuple[list[object], str]],
                    modules: Mapping[str, nn.Module]) -> None:
        """Check that every rank runs the same program (`describe()`: what must agree, and how to
        say it), then bring rank 0's parameters (first call) and buffers (every call) to every rank."""
        digest = self._digests.get(key)
        if digest is None:
            parts, text = describe()
            digest = self._digests[key] = (program_digest(parts), text)
        self.collectives.check_same_program(*digest)
        tensors = [t for m in modules.values() for t in m.buffers()]
        if not self.synced:
            tensors = [p for m in modules.values() for p in m.parameters()] + tensors
        self.collectives.broadcast(_unique(tensors), 0, "broadcasting rank 0's parameters and buffers")
        self.synced = True

    def reduce_gradients(self, grads: Sequence[torch.Tensor], zero_stage: int = 0) -> None:
        """Sum the gradients over the ranks (each already divided by the number of ranks); under
        ZeRO stage 2 each gradient is summed on the rank that owns its parameter only (the others
        hold a partial sum, which they drop)."""
        start = time.perf_counter()
        if zero_stage == 2:
            self.collectives.reduce_sum(grads, owners([g.numel() for g in grads], self.ranks.world))
        else:
            self.collectives.all_reduce_sum(grads)
        self.comm_seconds += time.perf_counter() - start

    def after_update(self, params: Sequence[torch.Tensor], zero: bool) -> None:
        """ZeRO: every owner broadcasts the parameters it updated."""
        if not zero:
            return
        start = time.perf_counter()
        owner = owners([p.numel() for p in params], self.ranks.world)
        for rank in range(self.ranks.world):
            mine = [p for p, o in zip(params, owner) if o == rank]
            self.collectives.broadcast(mine, rank, f"broadcasting the parameters rank {rank} updated")
        self.comm_seconds += time.perf_counter() - start

    def gather_optimizer_states(self, optimizers: Sequence[torch.optim.Optimizer]) -> list[dict]:
        """ZeRO: each optimizer's torch state_dict with the state of every parameter (a collective)."""
        return self.collectives.gather_optimizer_states(optimizers)

    def keep_owned_state(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """ZeRO, after loading a whole optimizer state: drop the state of parameters other ranks own."""
        params = trained_parameters(optimizers)
        owner = owners([p.numel() for p in params], self.ranks.world)
        for p, o in zip(params, owner):
            if o != self.ranks.rank:
                for optimizer in optimizers:
                    optimizer.state.pop(p, None)


def _unique(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """`tensors` without repeats (a tied weight is one parameter)."""
    seen: set[int] = set()
    return [t for t in tensors if not (id(t) in seen or seen.add(id(t)))]
