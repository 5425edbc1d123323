"""tvmgraph.save / tvmgraph.load: saved graphs run without the model's code, are checked before
any native code loads, and refuse what does not match their manifest."""

from __future__ import annotations

import copy
import io
import os
import json
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import tvmgraph
from tests.conftest import Fn, ModuleGraph, TrainGraph, assert_close
from tests.models import EncoderBlock, SmallCNN, mlp
from tvmgraph import deploy
from tvmgraph.artifact_format import document_digest, sha256_file
from tvmgraph.errors import GraphPickleError, SaveError, SavedGraphError, SavedGraphInputError

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def saved_mlp(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = mlp().eval()
    graph = ModuleGraph(model)
    x = torch.randn(4, 32)
    graph(x)
    path = tmp_path_factory.mktemp("saved") / "mlp"
    assert tvmgraph.save(graph, path) == path
    return path, model, x


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _rewrite_manifest(path: Path, **changes) -> None:
    """Change manifest fields and re-sign it, as a newer or foreign tvmgraph would have written it."""
    doc = json.loads((path / "manifest.json").read_text())
    for key, value in changes.items():
        target, _, field = key.partition("__")
        if field:
            doc[target][field] = value
        else:
            doc[key] = value
    doc["sha256"] = document_digest(doc)
    (path / "manifest.json").write_text(json.dumps(doc))


def test_saved_graph_matches_eager_with_torch_and_numpy_inputs(saved_mlp) -> None:
    """A loaded graph gives the eager model's outputs; torch in gives torch out, numpy in numpy out."""
    path, model, x = saved_mlp
    loaded = tvmgraph.load(path)
    expected = model(x).detach()
    out = loaded(x)
    assert isinstance(out, torch.Tensor)
    assert_close(out, expected)
    out_np = loaded(x.numpy())
    assert isinstance(out_np, np.ndarray)
    assert_close(torch.from_numpy(out_np), expected)


def test_manifest_lists_specs_target_versions_and_every_file(saved_mlp) -> None:
    """manifest.json has the format version, graph name, input/output specs, the target, the
    versions, and the sha256 of every other file in the directory."""
    path, _, _ = saved_mlp
    doc = json.loads((path / "manifest.json").read_text())
    assert doc["format"] == 1 and doc["graph"].startswith("ModuleGraph_") and doc["program"] == "inference"
    assert doc["inputs"] == [{"name": "args_0", "dtype": "float32", "shape": [4, 32]}]
    assert doc["outputs"] == [{"name": "output_0", "dtype": "float32", "shape": [4, 10]}]
    assert doc["target"]["kind"] == "llvm" and doc["target"]["machine"] == "x86_64"
    assert set(doc["versions"]) >= {"tvmgraph", "tvm", "torch"}
    on_disk = {p.name for p in path.iterdir()} - {"manifest.json"}
    assert set(doc["files"]) == on_disk == {"graph.so", "params.safetensors"}
    for name, info in doc["files"].items():
        assert info["sha256"] == sha256_file(path / name)
    assert doc["sha256"] == document_digest(doc)


BLOCK_TORCH = """
import sys, numpy as np
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this process")
sys.meta_path.insert(0, Block())
"""

TORCH_BLOCKED = BLOCK_TORCH + """
import tvmgraph
graph = tvmgraph.load(sys.argv[1])
x = np.frombuffer(open(sys.argv[2], "rb").read(), dtype=np.float32).reshape(4, 32)
out = graph(x)
assert isinstance(out, np.ndarray), type(out)
assert not any(m == "torch" or m.startswith("torch.") for m in sys.modules)
assert "tvm.relax" not in sys.modules
sys.stdout.write(out.astype(np.float32).tobytes().hex())
"""


def test_load_runs_in_a_fresh_process_without_torch_or_the_model_code(saved_mlp, tmp_path: Path) -> None:
    """A new process that cannot import torch (and never sees tests/models.py), with only TVM's
    runtime library loaded, loads the saved graph and reproduces the eager outputs from numpy
    inputs."""
    path, model, x = saved_mlp
    (tmp_path / "x.bin").write_bytes(x.numpy().tobytes())
    done = subprocess.run([sys.executable, "-c", TORCH_BLOCKED, str(path), str(tmp_path / "x.bin")],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "TVM_USE_RUNTIME_LIB": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    out = np.frombuffer(bytes.fromhex(done.stdout), dtype=np.float32).reshape(4, 10)
    assert_close(torch.from_numpy(out.copy()), model(x).detach())


@pytest.mark.parametrize("damage, file, reason", [
    ("flip_library", "graph.so", "does not match its recorded checksum"),
    ("remove_params", "params.safetensors", "is missing"),
    ("remove_manifest", "manifest.json", "is missing"),
    ("edit_manifest", "manifest.json", "does not match its recorded checksum"),
    ("newer_format", "manifest.json", "format 2 is newer than the format this tvmgraph reads (1)"),
    ("other_platform", "manifest.json", "the graph was built for linux aarch64"),
])
def test_load_refuses_a_damaged_or_foreign_directory_before_loading_native_code(
        saved_mlp, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str, file: str, reason: str) -> None:
    """Every refusal is a SavedGraphError naming the file and the reason, raised before the
    library is handed to the dynamic loader."""
    import tvm

    path = _copy(saved_mlp[0], tmp_path / "copy")
    if damage == "flip_library":
        data = bytearray((path / "graph.so").read_bytes())
        data[len(data) // 2] ^= 0xFF
        (path / "graph.so").write_bytes(bytes(data))
    elif damage == "remove_params":
        (path / "params.safetensors").unlink()
    elif damage == "remove_manifest":
        (path / "manifest.json").unlink()
    elif damage == "edit_manifest":
        doc = json.loads((path / "manifest.json").read_text())
        doc["inputs"][0]["shape"] = [8, 32]
        (path / "manifest.json").write_text(json.dumps(doc))
    elif damage == "newer_format":
        _rewrite_manifest(path, format=2)
    else:
        _rewrite_manifest(path, target__machine="aarch64")
    loaded = []
    monkeypatch.setattr(tvm.runtime, "load_module", lambda *a, **k: loaded.append(a))
    with pytest.raises(SavedGraphError) as info:
        tvmgraph.load(path)
    assert f"{file}: {reason}" in str(info.value)
    assert str(path) in str(info.value)
    assert loaded == []


class Masked(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.mask = torch.ones(4)  # a plain tensor attribute: read at each call, like a buffer

    def forward(self, x):
        return self.fc(x) * self.mask


def test_a_plain_tensor_attribute_replaced_after_the_first_call_is_saved_as_it_is_now(tmp_path: Path) -> None:
    """The graph's calls read it live; the saved program held the value traced (found by a
    sweep: 0.88 off)."""
    model, x = Masked(), torch.randn(3, 4)
    graph = ModuleGraph(model)
    graph(x)
    model.mask = torch.full((4,), 2.0)
    assert_close(graph(x), model(x))
    loaded = tvmgraph.load(tvmgraph.save(graph, str(tmp_path / "masked")))
    assert_close(loaded(x), model(x).detach())


def test_load_of_a_missing_directory_says_so(tmp_path: Path) -> None:
    """A path that is not a directory is refused by name."""
    with pytest.raises(SavedGraphError, match="does not exist"):
        tvmgraph.load(tmp_path / "nothing")


def test_calls_with_wrong_inputs_are_clear_errors(saved_mlp) -> None:
    """Shape, dtype, count, type and a torch/numpy mix are checked against the manifest."""
    loaded = tvmgraph.load(saved_mlp[0])
    x = saved_mlp[2]
    cases = [
        ((torch.randn(5, 32),), r"input 'args_0' is float32\[5, 32\] but the graph was saved for float32\[4, 32\]"),
        ((x.double(),), r"input 'args_0' is float64\[4, 32\]"),
        ((x.numpy().astype(np.int64),), r"is int64\[4, 32\]"),
        ((x, x), r"takes 1 argument\(s\) but 2 were given; .*\(args_0: float32\[4, 32\]\)"),
        (([1.0] * 32,), r"is a list, not a numpy array"),
    ]
    for args, message in cases:
        with pytest.raises(SavedGraphInputError, match=message):
            loaded(*args)
    with pytest.raises(SavedGraphInputError, match=r"takes its arguments by position.*keyword argument\(s\) 'x'"):
        loaded(x=x)  # a bare TypeError before
    assert_close(loaded(x), saved_mlp[1](x).detach())  # still usable after the refusals


def test_save_is_atomic_and_replaces_an_older_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save that fails midway leaves no directory and no temporary files; saving over a saved
    graph replaces it."""
    model = mlp((8, 4)).eval()
    graph = ModuleGraph(model)
    x = torch.randn(2, 8)
    graph(x)

    def fail(*args):
        raise RuntimeError("linker died")

    monkeypatch.setattr(deploy, "export", fail)
    with pytest.raises(RuntimeError, match="linker died"):
        tvmgraph.save(graph, tmp_path / "g")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    tvmgraph.save(graph, tmp_path / "g")
    with torch.no_grad():
        model[0].weight.mul_(2)
    tvmgraph.save(graph, tmp_path / "g")
    assert [p.name for p in tmp_path.iterdir()] == ["g"]
    assert_close(tvmgraph.load(tmp_path / "g")(x), model(x).detach())
    (tmp_path / "other").mkdir()
    with pytest.raises(SaveError, match="exists and is not a saved graph"):
        tvmgraph.save(graph, tmp_path / "other")


def test_a_graph_saved_over_a_loaded_one_runs_its_own_code(tmp_path: Path) -> None:
    """Saved, loaded, then another graph saved at the same path and loaded in the same process:
    the dynamic loader handed back the library already loaded from that path, and the second
    load ran the first graph's kernels (ReLU) on the second graph's weights (Tanh's model)."""
    x = torch.randn(3, 8)
    relu, tanh = (torch.nn.Sequential(torch.nn.Linear(8, 4), act).eval() for act in (torch.nn.ReLU(), torch.nn.Tanh()))
    for model in (relu, tanh):
        graph = ModuleGraph(model)
        graph(x)
        tvmgraph.save(graph, tmp_path / "g")
        assert_close(tvmgraph.load(tmp_path / "g")(x), model(x).detach())


def test_pickling_a_graph_points_at_tvmgraph_save() -> None:
    """pickle.dumps and torch.save of a graph raise GraphPickleError (a TypeError) naming tvmgraph.save."""
    graph = ModuleGraph(mlp((8, 4)))
    with pytest.raises(GraphPickleError, match=r"tvmgraph.save\(graph, path\)"):
        pickle.dumps(graph)
    with pytest.raises(TypeError, match="cannot be pickled"):
        torch.save(graph, io.BytesIO())


def test_save_of_a_state_dict_works_like_torch_save(tmp_path: Path) -> None:
    """tvmgraph.save(graph.state_dict(), file) writes what torch.load reads back."""
    graph = ModuleGraph(mlp((8, 4)))
    tvmgraph.save(graph.state_dict(), tmp_path / "sd.pt")
    restored = torch.load(tmp_path / "sd.pt")
    assert_close(restored["modules"]["model"]["0.weight"], graph.model[0].weight.detach())


def test_save_needs_a_called_graph_or_example_args(tmp_path: Path) -> None:
    """An uncalled graph cannot be saved without example_args; with them it is traced and saved."""
    model = mlp((8, 4)).eval()
    graph = ModuleGraph(model)
    with pytest.raises(SaveError, match=r"has not been called.*example_args=\(x,\)"):
        tvmgraph.save(graph, tmp_path / "g")
    x = torch.randn(3, 8)
    tvmgraph.save(graph, tmp_path / "g", example_args=(x,))
    assert graph.num_compiled == 0
    assert_close(tvmgraph.load(tmp_path / "g")(x), model(x).detach())


def _train_and_save(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, path: Path):
    model.train()
    graph = TrainGraph(model, torch.nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.05))
    graph(x, y)  # one training step
    tvmgraph.save(graph, path)
    assert model.training, "saving switched the modules back to their own modes"
    model.eval()
    with torch.no_grad():
        return torch.nn.functional.mse_loss(model(x), y)


@pytest.mark.parametrize("name", ["mlp", pytest.param("cnn", marks=pytest.mark.slow),
                                  pytest.param("transformer", marks=pytest.mark.slow)])
def test_training_graph_saves_its_inference_program(name: str, tmp_path: Path) -> None:
    """A training graph saves build() in eval mode without the optimizer update: the loaded
    graph gives the eager model's eval-mode outputs (dropout off, batch norm on running stats)
    and does not train."""
    if name == "mlp":
        model, x, y = mlp(), torch.randn(4, 32), torch.randn(4, 10)
    elif name == "cnn":
        model, x, y = SmallCNN(dropout=0.5), torch.randn(2, 3, 16, 16), torch.randn(2, 10)
    else:
        model, x, y = EncoderBlock(dropout=0.1), torch.randn(2, 6, 32), torch.randn(2, 6, 32)
    expected = _train_and_save(model, x, y, tmp_path / name)
    loaded = tvmgraph.load(tmp_path / name)
    assert loaded.manifest["program"] == "inference"
    assert_close(loaded(x, y), expected)
    assert_close(loaded(x, y), expected)  # no update between calls


FACTORY = """
import torch
import tvmgraph
from torch import nn


class Net(tvmgraph.nn.Graph):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2)).eval()

    def build(self, x):
        return self.model(x)


def make():
    return Net(), (torch.ones(3, 6),)
"""


def _elf_machine(path: Path) -> int:
    data = path.read_bytes()[:20]
    assert data[:4] == b"\x7fELF"
    return int.from_bytes(data[18:20], "little")


def test_cli_export_for_the_host_runs_here(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`tvmgraph export SCRIPT.py:FACTORY --target host -o DIR` saves FACTORY()'s graph; it loads
    and matches the eager module."""
    from tvmgraph import cli

    (tmp_path / "net.py").write_text(FACTORY)
    assert cli.main(["export", f"{tmp_path / 'net.py'}:make", "--target", "host", "-o", str(tmp_path / "out")]) == 0
    assert "saved Net_" in capsys.readouterr().out
    torch.manual_seed(1)
    eager = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    assert _elf_machine(tmp_path / "out" / "graph.so") == 62  # EM_X86_64
    assert_close(tvmgraph.load(tmp_path / "out")(torch.ones(3, 6)), eager(torch.ones(3, 6)).detach())
    with pytest.raises(SaveError, match="has no function nothing"):
        cli.main(["export", f"{tmp_path / 'net.py'}:nothing", "-o", str(tmp_path / "x")])
    # The console script prints the error as one line, no traceback, and exits with 1.
    assert cli.run(["export", f"{tmp_path / 'net.py'}:nothing", "-o", str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"tvmgraph: error: tvmgraph export: {tmp_path / 'net.py'} has no function nothing()\n")
    assert "Traceback" not in err and "docs/errors.md" in err


@pytest.mark.slow
def test_cli_export_for_aarch64_cross_links_an_arm64_library(tmp_path: Path) -> None:
    """--target aarch64 builds and links (zig cc) an AArch64 ELF library; loading it here is
    refused as the wrong platform, before its code is loaded."""
    pytest.importorskip("ziglang")
    from tvmgraph import cli

    (tmp_path / "net.py").write_text(FACTORY)
    out = tmp_path / "a64"
    assert cli.main(["export", f"{tmp_path / 'net.py'}:make", "--target", "aarch64", "-o", str(out)]) == 0
    assert _elf_machine(out / "graph.so") == 183  # EM_AARCH64
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["target"]["machine"] == "aarch64" and '"mtriple":"aarch64-linux-gnu"' in manifest["target"]["string"]
    with pytest.raises(SavedGraphError, match="built for linux aarch64"):
        tvmgraph.load(out)


def test_cuda_export_compiles_without_a_gpu_and_says_what_the_target_needs(tmp_path: Path) -> None:
    """target='cuda' builds with dlight's default schedules here (no GPU); the library carries
    the CUDA kernels and the manifest lists the GPU, driver and runtime compiler it needs."""
    model = mlp((8, 4)).eval()
    out = tvmgraph.save(ModuleGraph(model), tmp_path / "cuda", example_args=(torch.randn(2, 8),),
                        target="cuda", arch="sm_80")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["target"]["device"] == "cuda" and manifest["target"]["kind"] == "cuda"
    needs = " ".join(manifest["target"]["needs"])
    assert "compute capability 8.0 (sm_80)" in needs and "NVRTC" in needs
    assert b"__global__" in (out / "graph.so").read_bytes()  # CUDA C source, compiled at load
    import tvm

    if not tvm.cuda(0).exist:
        with pytest.raises(SavedGraphError, match="runs on cuda, which this machine does not have"):
            tvmgraph.load(out)


def test_save_rejects_unknown_targets(tmp_path: Path) -> None:
    """target and arch are checked by name."""
    graph = ModuleGraph(mlp((8, 4)))
    with pytest.raises(SaveError, match="target='riscv'; use one of 'host', 'x86_64', 'aarch64', 'cuda'"):
        tvmgraph.save(graph, tmp_path / "g", example_args=(torch.randn(2, 8),), target="riscv")
    with pytest.raises(SaveError, match="arch='sm_90' is for target='cuda'"):
        tvmgraph.save(graph, tmp_path / "g", example_args=(torch.randn(2, 8),), target="x86_64", arch="sm_90")
    for arch in ("sm_xx", "banana"):  # TVM's target parser failed with a traceback on them
        with pytest.raises(SaveError, match=f"arch='{arch}' is not a CUDA architecture; give one as sm_<version>"):
            tvmgraph.save(graph, tmp_path / "g", example_args=(torch.randn(2, 8),), target="cuda", arch=arch)
    assert not (tmp_path / "g").exists()


def test_a_runtime_only_process_never_imports_torch_even_when_installed(saved_mlp, tmp_path: Path) -> None:
    """With TVM_USE_RUNTIME_LIB=1, loading and calling on numpy arrays leaves torch unimported
    (tvm-ffi would import it on its own), and torch tensors passed later still work."""
    script = textwrap.dedent("""
        import sys, numpy as np, tvmgraph
        graph = tvmgraph.load(sys.argv[1])
        graph(np.zeros((4, 32), dtype=np.float32))
        assert "torch" not in sys.modules, "torch was imported"
        import torch
        out = graph(torch.zeros(4, 32))
        assert isinstance(out, torch.Tensor) and out.shape == (4, 10)
    """)
    done = subprocess.run([sys.executable, "-c", script, str(saved_mlp[0])], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "TVM_USE_RUNTIME_LIB": "1"})
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.skipif(not (Path("/usr/bin/apt-get").exists() and Path("/usr/bin/dpkg").exists()),
                    reason="scripts/aarch64_emulation.sh prepares its root from Debian packages")
# Its first run downloads about 800 MB (arm64 Python, aarch64 wheels): opt in, not in every CI run.
@pytest.mark.skipif(not os.environ.get("TVMGRAPH_TEST_EMULATION") and not os.environ.get("TVMGRAPH_TEST_EMU_DIR"),
                    reason="set TVMGRAPH_TEST_EMULATION=1 (or TVMGRAPH_TEST_EMU_DIR) to run the aarch64 build under qemu")
def test_aarch64_build_runs_under_emulation_like_the_x86_64_build(tmp_path: Path) -> None:
    """The CNN exported for aarch64 runs under qemu-user (scripts/aarch64_emulation.sh: arm64
    Python, aarch64 TVM wheels, no torch) and gives the x86-64 build's outputs."""
    pytest.importorskip("ziglang")
    torch.manual_seed(0)
    graph = ModuleGraph(SmallCNN().eval())
    x = torch.randn(2, 3, 16, 16)
    tvmgraph.save(graph, tmp_path / "a64", example_args=(x,), target="aarch64")
    tvmgraph.save(graph, tmp_path / "x86", example_args=(x,), target="x86_64")
    np.save(tmp_path / "x.npy", x.numpy())
    done = subprocess.run([str(REPO / "scripts" / "aarch64_emulation.sh"), "run", str(tmp_path / "a64"),
                           str(tmp_path / "x.npy"), str(tmp_path / "out.npy")],
                          capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "PYTHON": sys.executable})
    assert done.returncode == 0, done.stderr[-3000:]
    expected = tvmgraph.load(tmp_path / "x86")(x)
    assert_close(torch.from_numpy(np.load(tmp_path / "out.npy")), expected)


def test_an_inference_save_packs_its_weights_once_when_loaded(tmp_path: Path) -> None:
    """A saved inference program's weights change only through it: its matmuls read them in
    panels that `pack_weights` makes once at load (relay_passes/weight_packing.py), with the
    eager model's outputs, also after calls in between."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512)).eval()
    graph = ModuleGraph(model)
    x = torch.randn(64, 256)
    tvmgraph.save(graph, tmp_path / "mlp", example_args=(x,))
    loaded = tvmgraph.load(tmp_path / "mlp")
    assert len(loaded._packed) == 2
    with torch.no_grad():
        expected = model(x)
    for _ in range(3):
        assert_close(loaded(x), expected)
        loaded(torch.randn(64, 256))


class _WithConstant(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 2.0))

    def forward(self, x):
        offset = torch.tensor([1.0, 2.0, 3.0, 4.0])  # a lifted constant: saved in constants.bin
        return self.linear(x) * self.scale + offset, [x.sum(), None]


def test_buffers_constants_and_nested_outputs_survive_a_save(tmp_path: Path) -> None:
    """Buffers (safetensors), lifted constants (constants.bin) and a nested output structure
    with None come back as eager computes them."""
    model = _WithConstant()
    graph = ModuleGraph(model)
    x = torch.randn(3, 4)
    graph(x)
    tvmgraph.save(graph, tmp_path / "g")
    assert (tmp_path / "g" / "constants.bin").is_file()
    out, (total, none) = tvmgraph.load(tmp_path / "g")(x)
    expected, (expected_total, _) = model(x)
    assert_close(out, expected.detach())
    assert_close(total, expected_total)
    assert none is None


def test_an_output_whose_size_depends_on_the_values_survives_a_save(tmp_path: Path) -> None:
    """x[mask]'s length is known only when the program runs: the manifest says -1 (saving
    failed on it), and each call returns as many elements as eager selects."""
    model = torch.nn.Linear(4, 6).eval()
    graph = ModuleGraph(Fn(lambda x: model(x)[model(x) > 0]))
    x = torch.randn(3, 4)
    tvmgraph.save(graph, tmp_path / "g", example_args=(x,))
    assert json.loads((tmp_path / "g" / "manifest.json").read_text())["outputs"][0]["shape"] == [-1]
    loaded = tvmgraph.load(tmp_path / "g")
    for _ in range(2):
        x = torch.randn(3, 4)
        with torch.no_grad():
            assert_close(loaded(x), model(x)[model(x) > 0])


def _batches(n: int, x_shape: tuple, y_shape: tuple) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(x_shape, generator=gen), torch.randn(y_shape, generator=gen)) for _ in range(n)]


@pytest.mark.parametrize("optimizer", ["sgd_momentum", "adamw", "adafactor"])
def test_saved_train_step_trains_like_the_graph(optimizer: str, tmp_path: Path) -> None:
    """program='train_step' saves forward, backward and update with the optimizer state: the
    loaded step, fed numpy batches, gives the graph's losses and parameters step for step (SGD
    saved before any step, so its momentum starts on the first loaded call; AdamW and Adafactor,
    whose state differs in shape from parameter to parameter, after one)."""
    torch.manual_seed(0)
    model = mlp()
    params = model.parameters()
    opt = (torch.optim.SGD(params, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-3) if optimizer == "sgd_momentum"
           else torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1) if optimizer == "adamw"
           else torch.optim.Adafactor(params, lr=2e-2, weight_decay=0.1))
    graph = TrainGraph(model, torch.nn.MSELoss(), opt)
    batches = _batches(5, (4, 32), (4, 10))
    if optimizer == "sgd_momentum":
        tvmgraph.save(graph, tmp_path / "step", example_args=batches[0], program="train_step")
    else:
        graph(*batches.pop(0))
        tvmgraph.save(graph, tmp_path / "step", program="train_step")
    loaded = tvmgraph.load(tmp_path / "step")
    assert loaded.program == loaded.manifest["program"] == "train_step"
    assert loaded.manifest["entry"] == "train_step"
    for x, y in batches:
        expected = graph(x, y)
        got = loaded(x.numpy(), y.numpy())
        assert_close(torch.from_numpy(np.asarray(got)), expected.detach(), rtol=1e-5, atol=1e-6)
    trained = loaded.state_dict()
    for name, p in model.named_parameters():
        assert_close(torch.from_numpy(trained[f"model.{name}"]), p.detach(), rtol=1e-5, atol=1e-6)


def test_saved_train_step_learning_rate_can_be_changed(tmp_path: Path) -> None:
    """set_hyperparameter('lr', v) on the loaded step does what setting the optimizer's lr does
    to the graph; an unknown key, or one on an inference save, is a clear error."""
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    graph = TrainGraph(model, torch.nn.MSELoss(), opt)
    (x, y), (x2, y2) = _batches(2, (4, 32), (4, 10))
    graph(x, y)
    tvmgraph.save(graph, tmp_path / "step", program="train_step")
    loaded = tvmgraph.load(tmp_path / "step")
    assert loaded.hyperparameters == [{"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0}]
    loaded.set_hyperparameter("lr", 1e-3)
    opt.param_groups[0]["lr"] = 1e-3
    assert_close(torch.from_numpy(np.asarray(loaded(x2.numpy(), y2.numpy()))), graph(x2, y2).detach())
    trained = loaded.state_dict()
    for name, p in model.named_parameters():
        assert_close(torch.from_numpy(trained[f"model.{name}"]), p.detach(), rtol=1e-5, atol=1e-6)
    with pytest.raises(SavedGraphInputError, match="has no hyperparameter 'momentum'; it has lr, beta1"):
        loaded.set_hyperparameter("momentum", 0.9)
    with pytest.raises(SavedGraphInputError, match="group=3; the saved train step has 1 param group"):
        loaded.set_hyperparameter("lr", 0.1, group=3)
    tvmgraph.save(graph, tmp_path / "infer")
    with pytest.raises(SavedGraphInputError, match="inference program, which has no optimizer"):
        tvmgraph.load(tmp_path / "infer").set_hyperparameter("lr", 0.1)


def test_a_saved_train_step_refuses_a_hyperparameter_its_program_left_out(tmp_path: Path) -> None:
    """Saved with weight_decay=0 (its program has no decay term), set_hyperparameter(
    'weight_decay', 0.5) was accepted and ignored: 0.17 off eager after 4 steps. Values on the
    same side of zero still work."""
    torch.manual_seed(0)
    model = mlp()
    graph = TrainGraph(model, torch.nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    graph(*_batches(1, (4, 32), (4, 10))[0])
    tvmgraph.save(graph, tmp_path / "step", program="train_step")
    loaded = tvmgraph.load(tmp_path / "step")
    with pytest.raises(SavedGraphInputError, match="was saved with weight_decay 0, and its program leaves that "
                                                   "term out; weight_decay=0.5 needs another program"):
        loaded.set_hyperparameter("weight_decay", 0.5)
    with pytest.raises(SavedGraphInputError, match="was saved with momentum non-zero"):
        loaded.set_hyperparameter("momentum", 0.0)
    loaded.set_hyperparameter("momentum", 0.5)
    assert loaded.hyperparameters[0]["momentum"] == 0.5 and loaded.hyperparameters[0]["weight_decay"] == 0.0


@pytest.mark.parametrize("change", ["eval", "frozen_layer", "nesterov"])
def test_save_without_example_args_saves_the_model_as_it_is_now(change: str, tmp_path: Path) -> None:
    """A change made after the graph's last call and before the save (model.eval(); a layer
    frozen; nesterov turned on) was not in the saved program: save reused the last call's trace
    unchecked (1.77 off eager; training 0.05-0.11 off after 3 steps)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    reference = copy.deepcopy(model)
    batches = _batches(4, (4, 6), (4, 3))
    if change == "eval":
        graph = ModuleGraph(model)
        graph(batches[0][0])
        reference(batches[0][0])  # train mode: batch norm updates its running statistics
        for m in (model, reference):
            m.eval()  # and reads them now
        tvmgraph.save(graph, tmp_path / "g")
        assert_close(tvmgraph.load(tmp_path / "g")(batches[1][0]), reference(batches[1][0]).detach())
        return
    opt, eager_opt = (torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (model, reference))
    graph = TrainGraph(model, torch.nn.MSELoss(), opt)
    eager_step = _eager_step(reference, eager_opt)
    eager_step(*batches[0])
    graph(*batches[0])
    for m, o in ((model, opt), (reference, eager_opt)):
        if change == "frozen_layer":
            m[0].requires_grad_(False)
        else:
            o.param_groups[0]["nesterov"] = True
    tvmgraph.save(graph, tmp_path / "step", program="train_step")
    loaded = tvmgraph.load(tmp_path / "step")
    for x, y in batches[1:]:
        assert_close(torch.from_numpy(np.asarray(loaded(x.numpy(), y.numpy()))), eager_step(x, y), rtol=1e-5, atol=1e-6)
    trained = loaded.state_dict()
    for name, p in reference.named_parameters():
        assert_close(torch.from_numpy(trained[f"model.{name}"]), p.detach(), rtol=1e-5, atol=1e-6)


def _eager_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer):
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step


def test_saved_train_step_keeps_batch_norm_statistics(tmp_path: Path) -> None:
    """A CNN with batch norm: the loaded step updates running statistics as the graph does."""
    torch.manual_seed(0)
    model = SmallCNN()
    graph = TrainGraph(model, torch.nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    batches = _batches(3, (2, 3, 16, 16), (2, 10))
    graph(*batches.pop(0))
    tvmgraph.save(graph, tmp_path / "cnn", program="train_step")
    loaded = tvmgraph.load(tmp_path / "cnn")
    for x, y in batches:
        assert_close(loaded(x, y), graph(x, y).detach(), rtol=1e-4, atol=1e-5)
    trained = loaded.state_dict()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        assert_close(torch.from_numpy(trained[f"model.{name}"]), t.detach(), rtol=1e-4, atol=1e-5)


TRAIN_TORCH_BLOCKED = BLOCK_TORCH + """
import tvmgraph
step = tvmgraph.load(sys.argv[1])
data = np.load(sys.argv[2])
losses = [float(step(data[f"x{i}"], data[f"y{i}"])) for i in range(3)]
assert not any(m == "torch" or m.startswith("torch.") for m in sys.modules)
np.savez(sys.argv[3], losses=np.array(losses), **step.state_dict())
"""


def test_saved_train_step_trains_in_a_process_without_torch(tmp_path: Path) -> None:
    """A fresh process that cannot import torch loads the saved step and trains 3 steps on numpy
    batches: its losses and parameters are the graph's."""
    torch.manual_seed(0)
    model = mlp()
    graph = TrainGraph(model, torch.nn.MSELoss(), torch.optim.RMSprop(model.parameters(), lr=1e-3, momentum=0.5))
    batches = _batches(4, (4, 32), (4, 10))
    graph(*batches.pop(0))
    tvmgraph.save(graph, tmp_path / "step", program="train_step")
    np.savez(tmp_path / "data.npz", **{f"{k}{i}": t.numpy() for i, b in enumerate(batches) for k, t in zip("xy", b)})
    done = subprocess.run([sys.executable, "-c", TRAIN_TORCH_BLOCKED, str(tmp_path / "step"),
                           str(tmp_path / "data.npz"), str(tmp_path / "out.npz")],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "TVM_USE_RUNTIME_LIB": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    out = np.load(tmp_path / "out.npz")
    expected = [float(graph(x, y)) for x, y in batches]
    np.testing.assert_allclose(out["losses"], expected, rtol=1e-5)
    for name, p in model.named_parameters():
        assert_close(torch.from_numpy(out[f"model.{name}"]), p.detach(), rtol=1e-5, atol=1e-6)


def test_train_step_save_refuses_what_it_cannot_carry(tmp_path: Path) -> None:
    """An inference graph, gradient accumulation and an unknown program are clear errors."""
    torch.manual_seed(0)
    model = mlp()
    inference = ModuleGraph(model)
    with pytest.raises(SaveError, match="the graph has no optimizer; save its inference program"):
        tvmgraph.save(inference, tmp_path / "a", example_args=(torch.randn(4, 32),), program="train_step")
    graph = TrainGraph(model, torch.nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(SaveError, match="program='eval'; use one of 'inference', 'train_step'"):
        tvmgraph.save(graph, tmp_path / "b", program="eval")
    with pytest.raises(SaveError, match="no compiled train step to save; call it once, or pass inputs"):
        tvmgraph.save(graph, tmp_path / "b", program="train_step")
    graph.config.set_gradient_accumulation_steps(2)
    with pytest.raises(tvmgraph.errors.UnsupportedOptionError, match="turn gradient accumulation and data "):
        tvmgraph.save(graph, tmp_path / "c", example_args=(torch.randn(4, 32), torch.randn(4, 10)),
                      program="train_step")
    assert not any(p.name in "abc" for p in tmp_path.iterdir())


def test_loaded_graph_takes_misaligned_and_strided_torch_inputs(saved_mlp) -> None:
    """Kernels assume 64-byte aligned, compact inputs (tvmgraph/inputs.py): a view starting
    4 bytes into its storage crashed the loaded graph with SIGSEGV before it was copied. Such
    views, transposes and lazily negated tensors now give eager's outputs."""
    path, model, x = saved_mlp
    loaded = tvmgraph.load(path)
    misaligned = torch.cat([torch.zeros(1), x.flatten()])[1:].view(4, 32)
    assert misaligned.data_ptr() % 64 and misaligned.is_contiguous()
    transposed = x.t().contiguous().t()
    negated = (-x)._neg_view()  # x, with its negation a lazy bit
    for arg in (misaligned, transposed, negated):
        assert_close(loaded(arg), model(x).detach())
