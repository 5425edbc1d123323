"""Data-parallel graphs and ZeRO over torch.distributed: 2 gloo ranks on 127.0.0.1 (tests/distributed/worker.py).

Each test starts two fresh processes (one thread each) and compares what they saved with one
process training on the global batch, or with eager DistributedDataParallel in the same ranks.
"""

from __future__ import annotations

import copy
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.distributed.worker import GLOBAL_BATCH, MICRO_BATCHES, STEPS, adam, data_for, model_for, sgd

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
WORKER = os.environ.get("TEST_WORKER", "-m tests.distributed.worker").split()
# Gradients summed over 2 ranks in another order than one process sums the global batch: float32
# rounding, compounded over 10 steps (a real difference moves parameters by > 1e-3).
TOL = dict(atol=2e-5, rtol=2e-4)


def run_ranks(case: str, tmp_path: Path, world: int = 2, timeout: float = 300, pg_timeout: int = 60) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TVM_NUM_THREADS": "1", "TEST_PG_TIMEOUT": str(pg_timeout),
           "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, *WORKER, case, str(r), str(world), str(port),
                               str(tmp_path)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for r in range(world)]
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"{case}: a rank hung past {timeout} s")
    results = []
    for rank, (p, out) in enumerate(zip(procs, outputs)):
        path = tmp_path / f"rank{rank}.pt"
        if case.endswith("dead") and rank == 1:
            assert p.returncode == 3, out[-3000:]
            continue
        assert p.returncode == 0 and path.exists(), f"rank {rank} exited {p.returncode}:\n{out[-4000:]}"
        results.append(torch.load(path, weights_only=False))
    return results


def one_process(case: str) -> nn.Module:
    """The same training on the global batch in one eager process."""
    model = model_for(case)
    optimizer = adam(model) if "adam" in case else sgd(model)
    for x, y in data_for(case):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model


@pytest.mark.parametrize("case", ["mlp", "mlp_adam", "mlp_accum"])
def test_two_ranks_train_like_one_process_on_the_global_batch(case: str, tmp_path: Path) -> None:
    ranks = run_ranks(case, tmp_path)
    expected = one_process(case).state_dict()
    for rank, result in enumerate(ranks):
        assert result["num_compiled"] == 1
        for name, value in expected.items():
            torch.testing.assert_close(result["state"][name], value, **TOL, msg=lambda m, n=name: f"rank {rank} {n}: {m}")
            # and like eager DDP in the same processes
            torch.testing.assert_close(result["state"][name], result["ref_state"][name], **TOL)
    if case != "mlp_accum":  # each rank's loss is its own shard's, as under DDP
        torch.testing.assert_close(torch.tensor(ranks[1]["losses"]), torch.tensor(ranks[1]["ref_losses"]), **TOL)


def test_grad_scaler_skips_the_same_steps_on_every_rank_like_eager_ddp(tmp_path: Path) -> None:
    """A GradScaler with accumulation; rank 1's shard of step 3 holds an inf: both ranks skip
    that step and back the scale off (the check runs on the all-reduced gradients), as DDP +
    GradScaler in the same processes does."""
    for rank, result in enumerate(run_ranks("mlp_accum_scaler", tmp_path)):
        scales = [s for s, _ in result["scales"]]
        assert scales == [s for _, s in result["scales"]]
        assert scales[:5] == [2.0**16, 2.0**17, 2.0**17, 2.0**16, 2.0**16], scales  # grows, backs off at 3
        for name, value in result["ref_state"].items():
            torch.testing.assert_close(result["state"][name], value, **TOL, msg=lambda m, n=name: f"rank {rank} {n}: {m}")


def test_batch_norm_statistics_stay_per_rank_like_eager_ddp(tmp_path: Path) -> None:
    for rank, result in enumerate(run_ranks("cnn", tmp_path)):
        for name, value in result["ref_state"].items():
            if value.is_floating_point():
                torch.testing.assert_close(result["state"][name], value, **TOL, msg=lambda m, n=name: f"rank {rank} {n}: {m}")
            else:
                assert torch.equal(result["state"][name], value), name
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(result["ref_losses"]), **TOL)


@pytest.mark.parametrize("case", ["zero", "zero2"])
def test_zero_shards_optimizer_state_and_resumes_identically(case: str, tmp_path: Path) -> None:
    """Stage 1 (optimizer state) and stage 2 (also gradients, reduced to their owner) train
    like one process on the global batch."""
    ranks = run_ranks(case, tmp_path)
    expected = one_process("mlp_adam")  # 10 Adam steps on the global batch
    full_bytes = sum(2 * p.numel() * 4 + 4 for p in expected.parameters())  # exp_avg, exp_avg_sq, step
    for rank, result in enumerate(ranks):
        for name, value in expected.state_dict().items():
            torch.testing.assert_close(result["state"][name], value, **TOL, msg=lambda m, n=name: f"rank {rank} {n}: {m}")
            assert torch.equal(result["resumed_state"][name], result["state"][name]), name
        # each rank keeps the state of about half the parameters
        assert 0.2 * full_bytes < result["owned_state_bytes"] < 0.8 * full_bytes
        # the gathered state is torch's whole Adam state on every rank
        saved = result["saved_optimizer"]
        assert sorted(saved["state"]) == list(range(len(list(expected.parameters()))))
        assert all(set(s) == {"step", "exp_avg", "exp_avg_sq"} for s in saved["state"].values())
    for key, state in ranks[0]["saved_optimizer"]["state"].items():
        for name, value in state.items():
            assert torch.equal(value, ranks[1]["saved_optimizer"]["state"][key][name])


def test_ranks_with_different_shapes_fail_on_every_rank(tmp_path: Path) -> None:
    for result in run_ranks("mismatch", tmp_path):
        assert result["error"] is not None
        assert "different programs" in result["error"] and "rank 0:" in result["error"] and "rank 1:" in result["error"]


def test_sync_batch_norm_is_refused_on_every_rank(tmp_path: Path) -> None:
    for result in run_ranks("syncbn", tmp_path):
        assert result["error"] is not None and "'model.1' is a SyncBatchNorm" in result["error"]


def test_a_grad_scaler_with_zero_is_refused_on_every_rank(tmp_path: Path) -> None:
    for result in run_ranks("zero_scaler", tmp_path):
        assert result["error"] is not None and "grad scaler (set_grad_scaler) with ZeRO" in result["error"]


def test_a_dead_rank_ends_the_others_with_an_error_within_the_timeout(tmp_path: Path) -> None:
    (result,) = run_ranks("dead", tmp_path, pg_timeout=20, timeout=200)
    assert result["error"] is not None and result["step"] == 2, result
    assert "rank 0 of 2" in result["error"] and "Another rank most likely stopped" in result["error"]
    assert result["seconds"] < 60


# ---- pipeline stages (GraphModule.set_stage): each rank runs one stage of the model ----

def one_process_accumulating(case: str, steps: int = STEPS) -> tuple[nn.Module, list[float]]:
    """Eager training on the whole global batch as MICRO_BATCHES accumulated micro-batches."""
    model = model_for(case)
    optimizer = adam(model) if "adam" in case else sgd(model)
    losses = []
    for x, y in data_for(case)[:steps]:
        optimizer.zero_grad()
        total = 0.0
        for xs, ys in zip(x.chunk(MICRO_BATCHES), y.chunk(MICRO_BATCHES)):
            loss = nn.functional.cross_entropy(model(xs), ys)
            (loss / MICRO_BATCHES).backward()
            total += loss.item() / MICRO_BATCHES
        optimizer.step()
        losses.append(total)
    return model, losses


@pytest.mark.parametrize("case", ["pipeline_mlp", "pipeline_mlp_adam", "pipeline_cnn"])
def test_two_pipeline_stages_train_like_one_process(case: str, tmp_path: Path) -> None:
    """GPipe over 2 gloo ranks = eager gradient accumulation in one process: parameters, batch-norm
    statistics and losses; the gathered state resumes the run exactly."""
    ranks = run_ranks(case, tmp_path)
    expected, losses = one_process_accumulating(case.removeprefix("pipeline_"))
    for rank, result in enumerate(ranks):
        assert result["num_compiled"] == 1
        for name, value in expected.state_dict().items():
            got = result["final"][name]
            if value.is_floating_point():
                torch.testing.assert_close(got, value, **TOL, msg=lambda m, n=name: f"rank {rank} {n}: {m}")
            else:
                assert torch.equal(got, value), name
            assert torch.equal(result["resumed"][name], got), name
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(losses), **TOL)
        assert result["resumed_losses"] == result["losses"][7:]
        assert "call graph.state_dict() on every rank first" in result["save_error"]
    # each rank compiled and trained its own stage only
    assert not set(ranks[0]["stage_params"]) & set(ranks[1]["stage_params"])
    assert ranks[0]["stage_params"] and ranks[1]["stage_params"]
    # the gathered optimizer state is torch's, for every parameter, on both ranks
    for result in ranks:
        assert sorted(result["saved"]["optimizers"][0]["state"]) == list(range(len(list(expected.parameters()))))


def test_a_dead_stage_ends_the_other_with_an_error_within_the_timeout(tmp_path: Path) -> None:
    (result,) = run_ranks("pipeline_dead", tmp_path, pg_timeout=20, timeout=200)
    assert result["error"] is not None and result["step"] == 2, result
    assert "rank 0 of 2" in result["error"] and "Another rank most likely stopped" in result["error"]
    assert result["seconds"] < 60


def test_a_transformer_in_two_stages_trains_like_one_process(tmp_path: Path) -> None:
    """Attention (scaled_dot_product_attention, no dropout) recomputed on stage 0: the same
    parameters and losses as the unsplit graph with accumulation, to float32 rounding."""
    for rank, result in enumerate(run_ranks("pipeline_encoder", tmp_path)):
        for name, value in result["ref_state"].items():
            torch.testing.assert_close(result["state"][name], value, **TOL, msg=lambda m, n=name: f"rank {rank} {n}: {m}")
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(result["ref_losses"]), **TOL)


@pytest.mark.parametrize("case, error", [
    ("pipeline_dropout", "PipelineError: .*pipeline stage 0 calls aten.dropout.* Put the random ops"),
    ("pipeline_ranks", r"PipelineError: .*pipeline stage\(s\) \[1\] run no op of build\(\).*Number the stages 0..n-1"),
])
def test_pipeline_stages_that_cannot_run_fail_on_every_rank(case: str, error: str, tmp_path: Path) -> None:
    for result in run_ranks(case, tmp_path):
        assert result["error"] is not None and re.search(error, result["error"], re.S), result["error"]


def test_the_torchrun_example_trains_with_pipeline_stages() -> None:
    """docs/distributed.md's example, as a user runs it: two stages learn the digits."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          str(port), "examples/train_ddp.py", "--pipeline", "--epochs", "3"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    accuracy = float(re.search(r"accuracy on the training images: ([\d.]+)", run.stdout).group(1))
    assert accuracy > 0.8, run.stdout
