"""The single-process parts of data-parallel training (tvmgraph/training/data_parallel.py);
tests/distributed/ runs two ranks."""

from __future__ import annotations

import pytest
import torch

from tests.models import mlp
from tvmgraph import errors
from tvmgraph.config import GraphConfig
from tvmgraph.training import data_parallel as dp


def test_owners_balance_bytes_largest_first_and_agree_everywhere() -> None:
    sizes = [1024, 32, 384, 32, 160, 5]
    owner = dp.owners(sizes, 2)
    assert owner == [0, 1, 1, 1, 1, 1]  # 1024 alone against 613
    assert dp.owners(sizes, 2) == owner
    load = [sum(s for s, o in zip(sizes, owner) if o == r) for r in range(3)]
    assert load[2] == 0
    three = dp.owners([10] * 7, 3)
    assert sorted(three.count(r) for r in range(3)) == [2, 2, 3]


def test_program_digest_changes_with_any_part_and_fits_int64() -> None:
    parts = ["inputs", (16, 12), ("SGD", 0.9)]
    digest = dp.program_digest(parts)
    assert digest == dp.program_digest(list(parts))
    assert digest != dp.program_digest(["inputs", (15, 12), ("SGD", 0.9)])
    assert 0 <= digest < 2**63


def test_buckets_keep_dtypes_apart_and_cap_their_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dp, "BUCKET_BYTES", 64)
    tensors = [torch.zeros(8), torch.zeros(8), torch.zeros(8), torch.zeros(4, dtype=torch.float64), torch.zeros(40)]
    buckets = dp._buckets(tensors)
    assert [len(b) for b in buckets] == [2, 1, 1, 1]
    assert buckets[2][0].dtype == torch.float64


def test_unflatten_into_restores_each_tensor() -> None:
    bucket = [torch.zeros(2, 3), torch.zeros(4)]
    dp._unflatten_into(torch.arange(10.0), bucket)
    assert torch.equal(bucket[0], torch.arange(6.0).view(2, 3)) and torch.equal(bucket[1], torch.arange(6.0, 10.0))


def test_no_process_group_means_no_ranks() -> None:
    assert dp.Ranks.current() is None


def test_zero_stages_and_data_parallel_option() -> None:
    config = GraphConfig()
    config.enable_zero(True)
    assert config.zero is True
    with pytest.raises(errors.UnsupportedOptionError, match=r"enable_zero\(stage=3\) is not implemented"):
        config.enable_zero(True, stage=3)
    config.enable_zero(True, stage=2)
    assert config.snapshot((1, 2)).zero_stage == 2 and config.snapshot().zero_stage == 0
    config.enable_zero(False, stage=2)
    assert config.zero_stage == 1 and config.snapshot((1, 2)).zero_stage == 0
    config.enable_zero(True)
    with pytest.raises(errors.ConfigError, match="takes stage 1, 2 or 3, got 0"):
        config.enable_zero(True, stage=0)
    config.enable_data_parallel(False)
    assert config.snapshot((0, 2)).data_parallel == 1
    config.enable_data_parallel(True)
    snap = config.snapshot((1, 2))
    assert (snap.data_parallel, snap.zero_rank) == (2, 1)
    assert config.snapshot().data_parallel == 1  # outside a process group


def test_zero_plan_keeps_each_rank_its_parameters_and_refuses_clipping() -> None:
    from tvmgraph.training.plan import TrainingPlan

    model = mlp((12, 32, 32, 5))
    optimizer = torch.optim.Adam(model.parameters())
    named = [(f"model.{n}", p) for n, p in model.named_parameters()]
    plan = TrainingPlan.build("G", [(optimizer, None)], named)
    shares = [plan.owned("G", r, 2) for r in range(2)]
    assert sorted(t for s in shares for t in s.targets) == sorted(plan.targets)
    assert shares[0].targets == ["model.2.weight"]
    optimizer.param_groups[0]["clip_grad_max_norm"] = 1.0
    clipped = TrainingPlan.build("G", [(optimizer, None)], named)
    with pytest.raises(errors.OptimizerError, match="gradient clipping .* with ZeRO is not implemented"):
        clipped.owned("G", 0, 2)
