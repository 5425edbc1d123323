"""Tuning logs as compiles see them: where they live, how they are applied, what invalidates a
compiled program, and what happens to a damaged log. The logs here are written without
measuring (tests/tuning_logs.py); tests/numeric/test_tuning.py runs the real search."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import tvm
from torch import nn

import tvmgraph
from autotune.log import CHOICES, Choices, TuningLog, target_key
from autotune.tuner import _choose
from tests.conftest import assert_close
from tests.tuning_logs import kernels_of, write_log
from tvmgraph import artifact
from tvmgraph.errors import ConfigError, TuningError
from tvmgraph.target import target_for

CPU = target_for(torch.device("cpu"))
REPO = Path(__file__).resolve().parents[2]


class TunedMLP(tvmgraph.nn.Graph):
    """A graph class of its own: no other test's compile may find its logs."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def build(self, x):
        return self.model(x)


def mlp() -> tuple[TunedMLP, tuple[torch.Tensor]]:
    model = nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 8)).eval()
    return TunedMLP(model), (torch.randn(16, 64),)


def _use_cache_dir(monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    import autotune.log

    monkeypatch.setattr(autotune.log, "tuning_root", lambda: root)


def _messages(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() for r in caplog.records)


def test_log_directory_is_per_graph_name_and_target(tmp_path: Path) -> None:
    """<root>/<graph name>/<target key>; the key names the CPU and the TVM version, and two
    CPUs never share a log (MetaSchedule's lookup would ignore the target)."""
    log = TuningLog.for_graph("TunedMLP", CPU, tmp_path)
    assert log.directory.parent == tmp_path / "TunedMLP"
    assert tvm.__version__ in log.directory.name and str(CPU.attrs["mcpu"]) in log.directory.name
    other = tvm.target.Target({"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "neoverse-n1"})
    assert target_key(other) != target_key(CPU)
    assert target_key(tvm.target.Target({"kind": "cuda", "arch": "sm_80"})) != target_key(
        tvm.target.Target({"kind": "cuda", "arch": "sm_90"}))
    with pytest.raises(ConfigError, match="tuning log name '../x'"):
        TuningLog.for_graph("../x", CPU, tmp_path)


def test_a_log_is_applied_by_any_later_compile_of_that_graph_name(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """A graph compiled in a new process applies the log of its class name with no user action,
    says so at debug(1), and computes what eager computes."""
    graph, args = mlp()
    log = write_log(graph, args, "TunedMLP", CPU, tmp_path / "tuning")
    script = (
        "import torch, tvmgraph, logging, sys\n"
        "from tests.unit.test_autotune import mlp\n"
        "logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
        "torch.manual_seed(0)\n"
        "graph, args = mlp()\n"
        "graph.debug(1)\n"
        "print('max error', float((graph(*args) - graph.model(*args)).abs().max()))\n"
    )
    env = {"TVMGRAPH_CACHE_DIR": str(tmp_path), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, cwd=REPO,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"tuning log {log.directory}: 2 tuned kernel(s)" in out.stdout
    assert "ApplyTuningLog: 2 of 2 kernels scheduled from the tuning log" in out.stdout
    assert float(out.stdout.split("max error")[1]) < 1e-5


def test_kernels_scheduled_from_a_log_match_eager(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    _use_cache_dir(monkeypatch, tmp_path)
    graph, args = mlp()
    write_log(graph, args, "TunedMLP", CPU)
    graph.debug(1)
    with caplog.at_level(logging.INFO, logger="tvmgraph"):
        out = graph(*args)
    assert "2 of 2 kernels scheduled from the tuning log" in _messages(caplog)
    with torch.no_grad():
        assert_close(out, graph.model(*args))


def test_tuning_off_compiles_without_the_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             caplog: pytest.LogCaptureFixture) -> None:
    """graph.config.enable_tuning(False) (or TVMGRAPH_TUNING=off, read into the same option)
    leaves every kernel to the default schedules."""
    _use_cache_dir(monkeypatch, tmp_path)
    graph, args = mlp()
    write_log(graph, args, "TunedMLP", CPU)
    graph.config.enable_tuning(False)
    graph.debug(1)
    with caplog.at_level(logging.INFO, logger="tvmgraph"):
        graph(*args)
    assert "scheduled from the tuning log" not in _messages(caplog)
    from tvmgraph.config import Settings

    monkeypatch.setenv("TVMGRAPH_TUNING", "off")
    assert Settings().tuning is False
    monkeypatch.setenv("TVMGRAPH_TUNING", "maybe")
    with pytest.raises(ConfigError, match="TVMGRAPH_TUNING='maybe'"):
        Settings()


def test_a_named_log_is_used_instead_of_the_class_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    _use_cache_dir(monkeypatch, tmp_path)
    graph, args = mlp()
    write_log(graph, args, "shared-mlp", CPU, kernels=1)
    graph.config.enable_tuning(name="shared-mlp")
    graph.debug(1)
    with caplog.at_level(logging.INFO, logger="tvmgraph"):
        graph(*args)
    assert "1 of 2 kernels scheduled from the tuning log" in _messages(caplog)
    with pytest.raises(ConfigError, match="tuning log name 'a/b'"):
        graph.config.enable_tuning(name="a/b")


def test_the_compiled_cache_key_follows_the_records_applied(tmp_path: Path) -> None:
    """Another record set is another program: the digest of the applied records is a key part."""
    graph, args = mlp()
    traced = graph.trace(*args)
    log = write_log(graph, args, "TunedMLP", CPU, tmp_path)

    def key() -> str:
        applied = log.applied()
        return artifact.graph_key("TunedMLP", traced, None, graph.config, CPU, "default",
                                  applied.digest if applied else "none")

    first = key()
    assert first == key()
    write_log(graph, args, "TunedMLP", CPU, tmp_path, tuned_us=2.0)  # a second record per kernel, slower
    assert key() == first  # the best records did not change
    write_log(graph, args, "TunedMLP", CPU, tmp_path, tuned_us=0.5)
    assert key() != first
    choices = json.loads((log.directory / CHOICES).read_text())
    for k in choices["kernels"]:
        k["use_tuned"] = False
    (log.directory / CHOICES).write_text(json.dumps(choices))
    assert log.applied() is None and key() != first


def test_a_truncated_or_corrupt_log_keeps_its_good_records(tmp_path: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """A tuner killed mid-write leaves half a line; MetaSchedule's reader would refuse the whole
    file. Here the line is dropped with a warning, the other records are applied, and the tuner's
    repair() rewrites the files so that MetaSchedule reads them again."""
    from tvm.s_tir import meta_schedule as ms

    graph, args = mlp()
    log = write_log(graph, args, "TunedMLP", CPU, tmp_path)
    good = log.records_path.read_text()
    with log.records_path.open("a") as f:
        f.write('[0, [["garbage"]]]\n[1, [[["SampleCategorical"')  # a bad record, then a truncated one
    with caplog.at_level(logging.WARNING, logger="tvmgraph.autotune"):
        applied = log.applied()
    assert applied is not None and applied.kernels == 2
    assert "dropped 2 unreadable line(s) (truncated or corrupt); the other records are used" in _messages(caplog)
    with pytest.raises(Exception):  # noqa: B017  (MetaSchedule's own reader: any error)
        ms.database.JSONDatabase(str(log.workloads_path), str(log.records_path))
    assert log.repair() == 2
    assert [json.loads(line) for line in log.records_path.read_text().splitlines()] == [
        json.loads(line) for line in good.splitlines()]
    assert len(ms.database.JSONDatabase(str(log.workloads_path), str(log.records_path))) == 2


def test_a_record_whose_trace_tvm_would_read_out_of_bounds_is_dropped(tmp_path: Path) -> None:
    """Valid JSON, damaged trace: its instructions cut short (decisions kept), a decision at
    instruction 999, a tile decision one factor short. TVM's TuningRecord.from_json reads such a
    trace out of bounds: every compile of the graph died of SIGSEGV, the tuner's repair of
    glibc's abort. Checked in a child process, so that a crash fails this test only."""
    graph, args = mlp()
    log = write_log(graph, args, "TunedMLP", CPU, tmp_path)
    records = [json.loads(line) for line in log.records_path.read_text().splitlines()]
    damaged = []
    for damage in ("cut", "index", "tile"):
        record = json.loads(json.dumps(records[0]))
        insts, decisions = record[1][0]
        if damage == "cut":
            record[1][0] = [insts[:2], decisions]
        elif damage == "index":
            decisions[0][0] = 999
        else:
            tile = next(d for d in decisions if insts[d[0]][0] == "SamplePerfectTile")
            tile[1] = tile[1][:-1]
        record[1][1] = [1e-9]  # faster than the good record: it would be applied first
        damaged.append(record)
    with log.records_path.open("a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in damaged))
    script = ("import sys; from pathlib import Path; from autotune.log import TuningLog\n"
              "log = TuningLog(Path(sys.argv[1])); applied = log.applied(); _, records, dropped = log.read(warn=False)\n"
              "print(applied.kernels, len(records), dropped)")
    run = subprocess.run([sys.executable, "-c", script, str(log.directory)], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2], timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["2", str(len(records)), "3"]


def test_a_directory_in_place_of_a_log_file_means_default_schedules(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """IsADirectoryError ended every compile of the graph in 'CompileError ... a tvmgraph bug'."""
    graph, args = mlp()
    log = write_log(graph, args, "TunedMLP", CPU, tmp_path)
    log.records_path.unlink()
    log.records_path.mkdir()
    with caplog.at_level(logging.WARNING, logger="tvmgraph.autotune"):
        assert log.applied() is None
    assert "dropped 1 unreadable line(s)" in _messages(caplog)


def test_a_damaged_choices_file_means_default_schedules(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    graph, args = mlp()
    log = write_log(graph, args, "TunedMLP", CPU, tmp_path)
    (log.directory / CHOICES).write_text('{"format": 1, "kernels": [')
    with caplog.at_level(logging.WARNING, logger="tvmgraph.autotune"):
        assert log.applied() is None
    assert "choices.json is unreadable" in _messages(caplog)


def test_a_tuned_schedule_is_used_only_where_it_measured_faster() -> None:
    """The default schedule is a candidate like the others: a kernel keeps it unless a tuned
    record beat it by more than the timing noise; failed candidates never win."""
    from types import SimpleNamespace

    def record(kernel: str, us: float):
        return SimpleNamespace(workload=SimpleNamespace(mod=kernel), run_secs=[us * 1e-6])

    kernels = [SimpleNamespace(name=n, workload=n, flops=1.0, calls=1, default_s=d * 1e-6, mod=n)
               for n, d in (("faster", 10.0), ("slower", 10.0), ("noise", 10.0), ("failed", 10.0))]
    records = [record("faster", 4.0), record("faster", 7.0), record("slower", 12.0), record("noise", 9.9),
               record("failed", 1e10 * 1e6)]

    class Database:
        def has_workload(self, mod):
            return True

        def get_all_tuning_records(self):
            return records

    import autotune.tuner as tuner

    choices = {c.name: c for c in _choose(kernels, kernels, Database()).kernels}
    assert choices["faster"].use_tuned and choices["faster"].tuned_us == pytest.approx(4.0)
    assert not choices["slower"].use_tuned and not choices["noise"].use_tuned
    assert not choices["failed"].use_tuned and choices["failed"].tuned_us is None
    assert tuner.FASTER < 1


def test_a_tuned_schedule_is_retimed_beside_the_default_before_it_is_chosen() -> None:
    """A default timed slow once (here: claimed 1 s) must not lose to a record that claims to be
    fast (1 ns): both are timed again, side by side, and the choice follows those times."""
    from tvm.s_tir import meta_schedule as ms

    from autotune import measure, tuner
    from tests.tuning_logs import sampled_record

    graph, args = mlp()
    kernel = max(kernels_of(graph, args, CPU), key=lambda k: k.flops)
    kernel.default_s = 1.0
    database = ms.database.MemoryDatabase()
    database.commit_workload(kernel.mod)
    database.commit_tuning_record(sampled_record(kernel, CPU, 1e-9))
    assert _choose([kernel], [kernel], database).kernels[0].use_tuned  # on the claimed times

    target = measure.tuning_target(CPU)
    retimed = tuner._retime([kernel], database, target, measure.builder(), measure.runner())
    assert 1e-7 < kernel.default_s < 0.1 and 1e-7 < retimed[kernel.workload] < 1.0  # real times now
    choice = _choose([kernel], [kernel], database, retimed).kernels[0]
    assert choice.default_us == pytest.approx(kernel.default_s * 1e6)
    assert choice.tuned_us == pytest.approx(retimed[kernel.workload] * 1e6)
    assert choice.use_tuned == (retimed[kernel.workload] < tuner.FASTER * kernel.default_s)


def test_a_log_disabled_by_the_graph_check_applies_nothing(tmp_path: Path) -> None:
    graph, args = mlp()
    log = write_log(graph, args, "TunedMLP", CPU, tmp_path)
    choices = log.read_choices()
    log.write_choices(Choices(choices.kernels, graph_untuned_ms=1.0, graph_tuned_ms=1.2, enabled=False))
    assert log.applied() is None


def test_tune_needs_inputs_or_a_call() -> None:
    graph, _ = mlp()
    with pytest.raises(TuningError, match=r"never been called|has not been called"):
        tvmgraph.tune(graph)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to compile CUDA")
def test_a_cuda_log_is_applied_at_build_without_a_gpu(tmp_path: Path) -> None:
    """Compile-only: the records of a log for a CUDA target schedule its kernels in a CUDA build
    made on a machine with no GPU; the kernels without a record get dlight's schedules."""
    graph, args = mlp()
    cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    log = write_log(graph, args, "TunedMLP", cuda, tmp_path, kernels=1)
    lowered = graph.trace(*args).lower()
    messages: list[str] = []
    _, executable = lowered.build(cuda, graph.config, report=messages.append, tuning=log.applied())
    assert any("1 of 2 kernels scheduled from the tuning log" in m for m in messages), messages
    host = executable.mod.imports[0]
    kinds = [m.kind for m in host.imports]
    assert "cuda" in kinds and "__global__" in host.imports[kinds.index("cuda")].inspect_source()


def test_kernels_are_listed_with_default_schedules(tmp_path: Path) -> None:
    graph, args = mlp()
    kernels = kernels_of(graph, args, CPU)
    assert len(kernels) == 2
    assert all(k.default["main"].attrs["tirx.is_scheduled"] for k in kernels)
    assert not any((k.mod["main"].attrs or {}).get("tirx.is_scheduled", False) for k in kernels)
    assert sorted(k.flops for k in kernels)[-1] >= 2 * 16 * 64 * 96


def test_tune_command_refuses_what_it_cannot_do(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Bad arguments are clear errors before any tuning: a missing factory, --arch without
    --target cuda or not an architecture, CUDA with no GPU to measure on and no --rpc, a factory
    returning a module, a time budget that is not one."""
    from tvmgraph.cli import main

    script = tmp_path / "model.py"
    script.write_text("import torch\nfrom tests.unit.test_autotune import mlp\n\ndef factory():\n    return mlp()\n")
    with pytest.raises(TuningError, match="is not SCRIPT.py:FACTORY"):
        main(["tune", str(tmp_path / "missing.py:factory")])
    with pytest.raises(TuningError, match="has no function nope"):
        main(["tune", f"{script}:nope"])
    with pytest.raises(TuningError, match="--arch sm_80 is for --target cuda"):
        main(["tune", f"{script}:factory", "--arch", "sm_80"])
    if not torch.cuda.is_available():
        with pytest.raises(TuningError, match="no GPU to measure on; .* --rpc HOST:PORT"):
            main(["tune", f"{script}:factory", "--target", "cuda"])
    with pytest.raises(ConfigError, match="--rpc takes HOST:PORT"):
        main(["tune", f"{script}:factory", "--rpc", "nohost"])
    # Each of these ended in a traceback (TVM's target parser; AttributeError on .config).
    with pytest.raises(TuningError, match="--arch sm_xx is not a CUDA architecture"):
        main(["tune", f"{script}:factory", "--target", "cuda", "--arch", "sm_xx"])
    script.write_text(script.read_text() + "\ndef module():\n    return torch.nn.Linear(4, 2), (torch.randn(2, 4),)\n")
    with pytest.raises(TuningError, match="the graph is a Linear, not a tvmgraph.nn.Graph; wrap the module"):
        main(["tune", f"{script}:module"])
    for minutes in ("0", "-1", "nan"):
        with pytest.raises(ConfigError, match=f"minutes={float(minutes)!r}; pass a number of minutes > 0"):
            main(["tune", f"{script}:factory", "--minutes", minutes])


def test_kernels_with_symbolic_shapes_are_not_tuned() -> None:
    """MetaSchedule crashed on a dynamic task in TVM 0.27: such kernels keep the default schedule."""
    from tvm import te

    from autotune.tasks import _static

    def doubled(n):
        a = te.placeholder((n, 4), "float32", name="a")
        return te.create_prim_func([a, te.compute((n, 4), lambda i, j: a[i, j] * 2, name="b")])

    assert _static(doubled(8))
    assert not _static(doubled(tvm.tirx.Var("n", "int64")))


def test_a_called_graph_is_tuned_for_the_inputs_it_saw() -> None:
    """tvmgraph.tune(graph) after a call lowers the program of that call's signature."""
    from autotune.tuner import _lowered

    graph, args = mlp()
    graph(*args)
    lowered, options, device, example = _lowered(graph, ())
    assert lowered is graph.compiled.lowered and device == torch.device("cpu")
    assert [tuple(a.shape) for a in example] == [tuple(a.shape) for a in args]
    assert options == graph.config.snapshot()


def test_an_accumulating_graph_is_tuned_at_its_micro_batch() -> None:
    """The calls run accumulate_grads on batch / n rows: tuning the full batch would tune kernels of
    shapes no call runs."""
    from autotune.tuner import _lowered
    from tests.conftest import TrainGraph

    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    graph = TrainGraph(model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.1))
    graph.config.set_gradient_accumulation_steps(4)
    lowered, _, _, args = _lowered(graph, (torch.randn(32, 8), torch.randint(0, 4, (32,))))
    assert lowered.entry == "accumulate_grads"
    assert [tuple(a.shape) for a in args] == [(8, 8), (8,)]
    assert [tuple(int(d) for d in p.ty.shape) for p in lowered.mod["accumulate_grads"].params[:2]] == [(8, 8), (8,)]


def _scaled_copy():
    """A small kernel, built for this CPU: b = a * 2 over 2^16 floats."""
    from tvm import te

    a = te.placeholder((1 << 16,), name="a")
    func = te.create_prim_func([a, te.compute(a.shape, lambda i: a[i] * 2.0, name="b")])
    return tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}),
                       target=target_for(torch.device("cpu")))


def test_a_hopeless_candidate_runs_once_and_the_runner_gives_up_early() -> None:
    """Once the defaults are measured, the runner stops waiting at 100x the slowest default
    (5 s at least) and times a candidate slower than 10x it once instead of 4 times."""
    from tvm.s_tir import meta_schedule as ms

    from autotune import measure

    plain, capped = measure.runner(), measure.runner(slowest_default_s=0.002)
    assert plain.timeout_sec == measure.RUN_TIMEOUT_S and capped.timeout_sec == measure.MIN_TIMEOUT_S
    assert measure.runner(slowest_default_s=0.2).timeout_sec == 20.0
    evaluator = capped.f_run_evaluator
    assert isinstance(evaluator, measure.CappedEvaluator) and evaluator.cap_s == pytest.approx(0.02)

    lib = _scaled_copy().mod
    lib.entry_name = "main"  # what MetaSchedule's worker sets on the module it loads
    dev = tvm.cpu()
    args = [[tvm.runtime.tensor(torch.randn(1 << 16).numpy(), dev), tvm.runtime.empty((1 << 16,), "float32", dev)]]
    config = ms.runner.EvaluatorConfig(number=1, repeat=3, min_repeat_ms=20)
    calls = []
    timer = lib.time_evaluator

    def counting_time_evaluator(*a, **k):
        calls.append(k.get("repeat", a[3] if len(a) > 3 else None))
        return timer(*a, **k)

    lib.time_evaluator = counting_time_evaluator
    fast = measure.CappedEvaluator(cap_s=10.0)(lib, dev, config, args)
    assert calls == [1, 3] and len(fast) == 3  # one timing run, then the full evaluation
    calls.clear()
    slow = measure.CappedEvaluator(cap_s=0.0)(lib, dev, config, args)
    assert calls == [1] and len(slow) == 3 and len(set(slow)) == 1  # the one run, reported 3 times


def test_a_kernel_metaschedule_cannot_schedule_is_left_to_tvmgraphs_schedule(caplog: pytest.LogCaptureFixture) -> None:
    """MetaSchedule's generic rules refuse tvmgraph's attention kernel (its design space fails in
    `reverse-compute-at`), and the refusal ended `tvmgraph tune` on every graph with attention
    (the benchmark transformer's inference). Such a kernel is left out of the search, named at
    INFO; the others are searched."""
    from autotune import measure
    from autotune.tasks import Kernel
    from autotune.tuner import searchable
    from tests.numeric.test_cpu_schedules import te_matmul
    from tvmgraph.schedules.attention import attention_kernel

    def kernel(name: str, func: tvm.tirx.PrimFunc) -> Kernel:
        mod = tvm.IRModule({"main": func})
        return Kernel(name, mod, name, 1, 0.0, mod)

    # 16 features: whole vectors of them (the transformer's 64 too), the layout MetaSchedule refuses
    attention = kernel("attention", attention_kernel(4, 16, 16, 8, 16, 16, 0.5, False, False))
    product = kernel("matmul", te_matmul(16, 32, 8, False, False))
    target = measure.tuning_target(CPU)
    with caplog.at_level(logging.INFO, logger="tvmgraph.autotune"):
        kept = searchable([attention, product], target, "Graph_0")
    assert [k.name for k in kept] == ["matmul"]
    assert "MetaSchedule cannot schedule kernel attention" in _messages(caplog)
