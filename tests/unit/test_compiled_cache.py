"""The persistent compiled cache: what the key depends on, hits, corruption, atomic writes."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import tvmgraph
from tvmgraph import compiled_cache
from tvmgraph.compiled_cache import ENTRY, FORMAT, CompiledCache
from tvmgraph import artifact, cli, errors
from tvmgraph.config import Settings
from tvmgraph.lower import InputSource, LoweredSignature
from tvmgraph.training.train_step import TrainStepLayout
from tvmgraph.stages import TracedGraph
from tvmgraph.target import target_for
from tests.conftest import ModuleGraph, TrainGraph, assert_close
from tests.models import mlp


def key_of(graph: tvmgraph.nn.Graph, *args: torch.Tensor) -> str:
    traced = graph.trace(*args)
    return artifact.graph_key(type(graph).__name__, traced, None, graph.config, target_for(args[0].device), "default")


def test_key_ignores_graph_name_and_parameter_values() -> None:
    x = torch.randn(4, 32)
    first, second = ModuleGraph(mlp()), ModuleGraph(mlp())  # other names, other weights
    assert first.name != second.name
    assert key_of(first, x) == key_of(second, x)


@pytest.mark.parametrize("change", ["batch", "dtype", "mode", "structure"])
def test_key_changes_with_what_changes_the_program(change: str) -> None:
    model, x = mlp(), torch.randn(4, 32)
    base = key_of(ModuleGraph(model), x)
    if change == "batch":
        x = torch.randn(5, 32)
    elif change == "dtype":
        model, x = model.double(), x.double()
    elif change == "mode":
        model = nn.Sequential(model, nn.Dropout(0.5)).eval()
        base = key_of(ModuleGraph(model), x)
        model.train()
    else:
        model = mlp((32, 64, 65, 10))
    assert key_of(ModuleGraph(model), x) != base


def test_key_parts_are_logged_for_explaining_misses(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="tvmgraph.cache"):
        key_of(ModuleGraph(mlp()), torch.randn(2, 32))
    for part in ("program", "constants", "signature", "training", "options", "target", "versions", "tvmgraph"):
        assert f"part {part}" in caplog.text


def test_second_graph_loads_instead_of_compiling(monkeypatch: pytest.MonkeyPatch) -> None:
    model, x = mlp(), torch.randn(3, 32)
    expected = ModuleGraph(model)(x)  # compiles and stores
    lowerings = []
    original = TracedGraph.lower
    monkeypatch.setattr(TracedGraph, "lower", lambda self, plan=None: lowerings.append(1) or original(self, plan))
    again = ModuleGraph(model)
    assert_close(again(x), expected)
    assert lowerings == []  # neither lowered nor compiled
    assert "loaded from the compiled cache" in again.compiled.as_text()
    assert "R.matmul" in again.lowered.as_text()  # lowered on demand
    assert lowerings == [1]


def _run_in_fresh_process(cache_dir: Path, code: str) -> str:
    env = {**os.environ, "TVMGRAPH_CACHE_DIR": str(cache_dir)}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=Path(__file__).parents[2], env=env,
                          capture_output=True, text=True, check=True).stdout


MLP_SCRIPT = """
    import torch
    from tests.conftest import ModuleGraph
    from tests.models import mlp
    torch.manual_seed(0)
    model, x = mlp((32, 48, 10)), torch.randn(2, 32)
    print(ModuleGraph(model)(x).flatten().tolist())
"""


def _flip_byte(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    offset = len(data) // 2 if offset is None else offset
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def mlp_cache(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """(a cache holding the one entry MLP_SCRIPT compiled in another process, its output);
    each test damages a copy."""
    root = tmp_path_factory.mktemp("mlp-cache")
    return root, _run_in_fresh_process(root, MLP_SCRIPT)


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncated_library", "flipped_library_byte", "flipped_json_byte",
                                    "garbage_metadata", "appended_byte", "missing_library"])
def test_corrupt_entry_is_detected_and_rebuilt(damage: str, tmp_path: Path, mlp_cache: tuple[Path, str]) -> None:
    """Entries are written by another process (a library this process has mapped is never
    damaged under it); damaged ones are reported, removed and rebuilt, with the same results."""
    pristine, expected = mlp_cache
    shutil.copytree(pristine, tmp_path, dirs_exist_ok=True)
    (entry,) = (tmp_path / "compiled").iterdir()
    (lib,) = entry.glob("lib-*.so")
    if damage == "truncated_library":
        lib.write_bytes(lib.read_bytes()[: lib.stat().st_size // 3])
    elif damage == "flipped_library_byte":
        _flip_byte(lib)
    elif damage == "flipped_json_byte":
        _flip_byte(entry / ENTRY)
    elif damage == "garbage_metadata":
        (entry / ENTRY).write_bytes(b"\x80\x04not json")
    elif damage == "appended_byte":
        with open(lib, "ab") as f:
            f.write(b"\0")
    else:
        lib.unlink()
    script = "import logging; logging.basicConfig(level=logging.WARNING)\n" + textwrap.dedent(MLP_SCRIPT)
    env = {**os.environ, "TVMGRAPH_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).parents[2], env=env,
                          capture_output=True, text=True, check=True)
    assert "is corrupt" in proc.stderr and "rebuilding" in proc.stderr
    assert proc.stdout == expected
    assert _run_in_fresh_process(tmp_path, MLP_SCRIPT) == expected  # the rebuilt entry is whole


def test_store_leaves_no_temporary_directories() -> None:
    ModuleGraph(mlp((32, 40, 10)))(torch.randn(2, 32))
    root = artifact.compiled_cache().root
    assert not [p for p in root.iterdir() if p.name.startswith(".")]


@pytest.mark.slow
def test_a_second_process_loads_the_training_graph_from_the_cache(tmp_path: Path) -> None:
    """Two fresh interpreters build the same training graph; the second one compiles nothing."""
    script = textwrap.dedent("""
        import sys, torch, tvmgraph
        from tvmgraph.stages import LoweredGraph
        from examples.train_digits import TrainGraph, make_model, make_optimizer
        compiles = []
        original = LoweredGraph.compile
        LoweredGraph.compile = lambda self, *a, **k: compiles.append(1) or original(self, *a, **k)
        torch.manual_seed(0)
        model = make_model()
        graph = TrainGraph(model, *make_optimizer(model, 10))
        loss = graph(torch.rand(64, 1, 8, 8), torch.randint(0, 10, (64,)))
        print(len(compiles), float(loss))
    """)
    env = {**os.environ, "TVMGRAPH_CACHE_DIR": str(tmp_path)}
    root = Path(__file__).parents[2]
    runs = [subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True,
                           check=True).stdout.split() for _ in range(2)]
    assert runs[0][0] == "1" and runs[1][0] == "0"
    assert float(runs[0][1]) == pytest.approx(float(runs[1][1]), rel=1e-6)


# ---- entries without pickle: the metadata codec ----

REPO = Path(__file__).parents[2]


def _assert_same_signature(actual: LoweredSignature, expected: LoweredSignature) -> None:
    assert (actual.inputs, actual.mutations, actual.num_user_outputs, actual.has_loss, actual.input_types) == (
        expected.inputs, expected.mutations, expected.num_user_outputs, expected.has_loss, expected.input_types)
    assert list(actual.constants) == list(expected.constants)
    for name, value in expected.constants.items():
        got = actual.constants[name]
        assert (got.dtype, got.shape, got.device) == (value.dtype, value.shape, value.device), name
        assert torch.equal(got, value), name


class Scaled(nn.Module):
    """A linear layer times a plain tensor attribute, which torch.export lifts as a constant."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.scale = torch.tensor([1.0, 2.0, 3.0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def test_training_graph_meta_survives_a_json_round_trip() -> None:
    """A training graph's cache metadata (signature with a lifted constant, train-step layout
    with Adam's states, target) comes back equal from its JSON text and data file."""
    model = Scaled()
    graph = TrainGraph(model, nn.MSELoss(), torch.optim.Adam(model.parameters(), lr=0.1))
    graph(torch.randn(5, 4), torch.randn(5, 3))
    meta = graph.compiled.program.meta()
    assert meta["train_layout"] is not None and "constant" in [s.kind for s in meta["signature"].inputs]
    doc, files = artifact.encode_meta(meta)
    back = artifact.decode_meta(json.loads(json.dumps(doc)), files)
    _assert_same_signature(back["signature"], meta["signature"])
    assert back["train_layout"] == meta["train_layout"]
    assert back["target"] == meta["target"]


def test_constants_of_any_dtype_and_shape_round_trip() -> None:
    """Constant tensors are stored as raw bytes with dtype and shape, so numpy-less dtypes
    (bfloat16), 0-d, empty and non-contiguous tensors come back bit for bit."""
    constants = {
        "bf16": torch.randn(3, 2).to(torch.bfloat16),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.empty(0, 4),
        "strided": torch.arange(12, dtype=torch.int64).reshape(3, 4).t(),
        "mask": torch.tensor([True, False, True]),
    }
    sig = LoweredSignature((InputSource("user", None), InputSource("constant", "bf16"), InputSource("rng", None)),
                           (InputSource("buffer", "model.bn.running_mean"),), 2, False, constants,
                           (((4, 3), "float32"), ((3, 2), "bfloat16"), ((2,), "int64")))
    doc, blob = artifact.signature_to_json(sig)
    _assert_same_signature(artifact.signature_from_json(json.loads(json.dumps(doc)), blob), sig)


@pytest.mark.parametrize("field,value", [("num_user_outputs", "1"), ("has_loss", 1), ("inputs", [["weird", None]]),
                                         ("input_types", [[[2], "not_a_dtype"]])])
def test_malformed_metadata_is_rejected(field: str, value: object) -> None:
    """The JSON readers check every type instead of trusting the document."""
    sig = LoweredSignature((InputSource("user", None),), (), 1, True, {}, (((2,), "float32"),))
    doc, blob = artifact.signature_to_json(sig)
    with pytest.raises(ValueError):
        artifact.signature_from_json({**doc, field: value}, blob)


def test_no_pickle_in_the_cache_code() -> None:
    """Nothing on the cache's read path can unpickle: no torch.load/pickle in the compiled cache, its key or
    the artifact glue, and numpy never loads with allow_pickle=True."""
    banned = re.compile(r"\b(c?pickle|cloudpickle|dill|marshal|shelve)\b|torch\.(load|save)\b|allow_pickle\s*=\s*True"
                        r"|weights_only|np\.load\b")
    for path in [REPO / "tvmgraph" / name for name in ("compiled_cache.py", "cache_key.py", "artifact.py")]:
        code = [line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")]
        prose = re.compile(r'""".*?"""', re.S)  # docstrings may explain why there is no pickle
        text = prose.sub("", "\n".join(code))
        assert not banned.search(text), f"{path.name}: {banned.search(text).group()}"


# ---- a cache with fake libraries (no compiler; load_module is stubbed where an entry must hit) ----

KEY = "FakeGraph-" + "ab" * 20


def _fake_meta() -> dict:
    sig = LoweredSignature((InputSource("user", None), InputSource("constant", "c")), (), 1, True,
                           {"c": torch.arange(6, dtype=torch.float32).reshape(2, 3)},
                           (((4, 3), "float32"), ((2, 3), "float32")))
    return {"signature": sig, "train_layout": TrainStepLayout((1,), (("w", "step", (), "float32"),), 1),
            "target": '{"kind": "llvm"}'}


def _fake_cache(root: Path, max_bytes: int | None = None) -> CompiledCache:
    return CompiledCache(root, max_bytes, artifact.encode_meta, artifact.decode_meta)


def _fake_export(executable: bytes, path: str) -> None:
    Path(path).write_bytes(executable)


@pytest.fixture
def loaded(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Stubs tvm.runtime.load_module; the list records every library it was asked to load."""
    import tvm

    calls: list[str] = []
    monkeypatch.setattr(tvm.runtime, "load_module", lambda path: calls.append(path) or ("module", path))
    return calls


def test_an_entry_lists_every_file_with_its_checksum(tmp_path: Path, loaded: list[str]) -> None:
    """entry.json is plain JSON with a format version and each file's sha256; a hit decodes the
    metadata and loads the listed library."""
    cache = _fake_cache(tmp_path)
    lib = cache.store(KEY, b"library bytes", _fake_meta(), export=_fake_export)
    doc = json.loads((tmp_path / KEY / ENTRY).read_text())
    assert doc["format"] == FORMAT and doc["key"] == KEY and doc["library"] == lib.name
    assert sorted(p.name for p in (tmp_path / KEY).iterdir()) == sorted([ENTRY, *doc["files"]])
    assert set(doc["files"]) == {lib.name, artifact.CONSTANTS}
    entry = cache.load(KEY)
    assert entry is not None and loaded == [str(lib)]
    _assert_same_signature(entry.meta["signature"], _fake_meta()["signature"])


def _tamper(entry: Path, damage: str) -> None:
    doc = json.loads((entry / ENTRY).read_text())
    if damage == "library_byte":
        _flip_byte(entry / doc["library"])
    elif damage == "constants_byte":
        _flip_byte(entry / artifact.CONSTANTS)
    elif damage == "json_byte":
        _flip_byte(entry / ENTRY)
    elif damage == "json_value":  # still valid JSON, one number changed
        doc["meta"]["signature"]["num_user_outputs"] = 2
        (entry / ENTRY).write_text(json.dumps(doc))
    elif damage == "json_checksum":
        doc["sha256"] = "0" * 64
        (entry / ENTRY).write_text(json.dumps(doc))
    elif damage == "missing_file":
        (entry / artifact.CONSTANTS).unlink()
    elif damage in ("path_outside", "other_key"):  # self-consistent documents, still refused
        if damage == "path_outside":
            doc["files"]["../outside"] = doc["files"].pop(artifact.CONSTANTS)
        else:
            doc["key"] = "OtherGraph-" + "cd" * 20
        doc["sha256"] = compiled_cache._document_digest(doc)
        (entry / ENTRY).write_text(json.dumps(doc))
    else:
        raise AssertionError(damage)


@pytest.mark.parametrize("damage", ["library_byte", "constants_byte", "json_byte", "json_value", "json_checksum",
                                    "missing_file", "path_outside", "other_key"])
def test_a_tampered_entry_is_removed_before_its_library_loads(damage: str, tmp_path: Path, loaded: list[str],
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """Any change to any file of an entry is caught by the checksums before native code is
    loaded; the entry is reported once, removed, and the next store rebuilds it."""
    cache = _fake_cache(tmp_path)
    cache.store(KEY, b"library bytes", _fake_meta(), export=_fake_export)
    _tamper(tmp_path / KEY, damage)
    with caplog.at_level(logging.WARNING, logger="tvmgraph.cache"):
        assert cache.load(KEY) is None
        assert cache.load(KEY) is None  # a plain miss now: nothing left to report
    assert loaded == []
    (record,) = caplog.records
    assert record.getMessage().startswith(f"compiled cache entry {tmp_path / KEY} is corrupt")
    assert record.getMessage().endswith("removing it and rebuilding")
    assert list(tmp_path.iterdir()) == []  # removed, trash included
    cache.store(KEY, b"library bytes", _fake_meta(), export=_fake_export)
    assert cache.load(KEY) is not None


@pytest.mark.parametrize("version", [FORMAT + 1, None, "1", True])
def test_an_unknown_format_version_is_a_miss(version: object, tmp_path: Path, loaded: list[str]) -> None:
    """An entry of another format version (a newer tvmgraph's, say) is a miss and is replaced,
    not a crash."""
    cache = _fake_cache(tmp_path)
    cache.store(KEY, b"library bytes", _fake_meta(), export=_fake_export)
    doc = json.loads((tmp_path / KEY / ENTRY).read_text())
    doc["format"] = version
    doc["sha256"] = compiled_cache._document_digest(doc)
    (tmp_path / KEY / ENTRY).write_text(json.dumps(doc))
    assert cache.load(KEY) is None and loaded == []
    cache.store(KEY, b"library bytes", _fake_meta(), export=_fake_export)
    assert cache.load(KEY) is not None


def test_leftovers_of_killed_stores_never_load_and_are_swept(tmp_path: Path, loaded: list[str]) -> None:
    """A temporary directory (a store killed before its rename) is never read as an entry and is
    removed by a store once it is an hour old; a directory under a real key without a valid
    entry.json (a non-atomic copy) is refused and removed."""
    cache = _fake_cache(tmp_path)
    old, young = tmp_path / f".{KEY}.old", tmp_path / f".{KEY}.young"
    for tmp in (old, young):
        tmp.mkdir()
        (tmp / "lib-0.so").write_bytes(b"half a lib")
    two_hours_ago = time.time() - 7200
    os.utime(old, (two_hours_ago, two_hours_ago))
    half = tmp_path / KEY
    half.mkdir()
    (half / "lib-0.so").write_bytes(b"half a lib")
    assert cache.load(KEY) is None and not half.exists() and cache.entries() == []
    cache.store("Other-" + "00" * 20, b"lib", _fake_meta(), export=_fake_export)
    assert not old.exists() and young.exists()
    assert loaded == []


def test_a_second_store_of_the_same_key_keeps_the_first(tmp_path: Path, loaded: list[str]) -> None:
    """When the key is already stored (another process won the race), store keeps that entry,
    returns its library and leaves no temporary directory."""
    first = _fake_cache(tmp_path).store(KEY, b"first", _fake_meta(), export=_fake_export)
    second = _fake_cache(tmp_path).store(KEY, b"second", _fake_meta(), export=_fake_export)
    assert second == first and first.read_bytes() == b"first"
    assert [p.name for p in tmp_path.iterdir()] == [KEY]


def test_a_store_replaces_a_corrupt_entry_under_its_key(tmp_path: Path, loaded: list[str]) -> None:
    """A store that finds a damaged entry under its key replaces it instead of returning it."""
    _fake_cache(tmp_path).store(KEY, b"first", _fake_meta(), export=_fake_export)
    _tamper(tmp_path / KEY, "library_byte")
    lib = _fake_cache(tmp_path).store(KEY, b"second", _fake_meta(), export=_fake_export)
    assert lib.read_bytes() == b"second" and _fake_cache(tmp_path).load(KEY) is not None


# ---- the size limit ----

def _key(i: int) -> str:
    return f"Graph{i}-" + f"{i:02d}" * 20


def _set_last_used(cache: CompiledCache, key: str, seconds_ago: float) -> None:
    t = time.time() - seconds_ago
    os.utime(cache.root / key / ENTRY, (t, t))


def test_least_recently_used_entries_are_evicted_first(tmp_path: Path, loaded: list[str]) -> None:
    """Past max_bytes, entries go in order of last use (a load hit counts as a use); the entry
    just stored stays even when it alone is over the limit."""
    cache = _fake_cache(tmp_path)
    for i in range(3):
        cache.store(_key(i), b"x" * 1000, _fake_meta(), export=_fake_export)
        _set_last_used(cache, _key(i), 300 - 100 * i)  # 0 oldest, then 1, then 2
    size = cache.entries()[0].size
    assert cache.load(_key(0)) is not None  # 0 is now the most recently used
    cache.max_bytes = 3 * size  # room for three
    cache.store(_key(3), b"x" * 1000, _fake_meta(), export=_fake_export)
    assert sorted(e.key for e in cache.entries()) == [_key(0), _key(2), _key(3)]  # 1 went first
    cache.store(_key(4), b"x" * 1000, _fake_meta(), export=_fake_export)
    assert sorted(e.key for e in cache.entries()) == [_key(0), _key(3), _key(4)]  # then 2
    cache.max_bytes = 0
    cache.store(_key(5), b"x" * 1000, _fake_meta(), export=_fake_export)
    assert [e.key for e in cache.entries()] == [_key(5)]


def test_the_process_cache_is_bounded_by_the_setting() -> None:
    """artifact.compiled_cache() carries TVMGRAPH_CACHE_MAX_BYTES (default 2 GiB)."""
    assert artifact.compiled_cache().max_bytes == tvmgraph.config.settings.cache_max_bytes
    assert Settings().cache_max_bytes == int(os.environ.get("TVMGRAPH_CACHE_MAX_BYTES", 2 << 30))


@pytest.mark.parametrize("value,expected", [("0", 0), ("1048576", 1 << 20), (" 123 ", 123), ("-1", None),
                                            ("2GB", None), ("1.5", None), ("", None)])
def test_cache_max_bytes_is_validated(value: str, expected: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """TVMGRAPH_CACHE_MAX_BYTES takes a non-negative integer; anything else is a ConfigError
    (also a ValueError) naming the variable and the value."""
    monkeypatch.setenv("TVMGRAPH_CACHE_MAX_BYTES", value)
    if expected is not None:
        assert Settings().cache_max_bytes == expected
        return
    with pytest.raises(errors.ConfigError, match=f"TVMGRAPH_CACHE_MAX_BYTES={value!r} is not a size in bytes") as e:
        Settings()
    assert isinstance(e.value, ValueError) and "non-negative integer" in str(e.value)


# ---- the command line ----

def test_cli_lists_and_clears_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """`tvmgraph cache list` prints one line per entry (key, size, last used, graph class), most
    recently used first, then a total; `tvmgraph cache clear` removes them all."""
    monkeypatch.setattr(tvmgraph.config, "settings", Settings(cache_dir=tmp_path, cache_max_bytes=1 << 20))
    cache = _fake_cache(tmp_path / "compiled")
    for i in range(2):
        cache.store(_key(i), b"x" * 2048, _fake_meta(), export=_fake_export)
        _set_last_used(cache, _key(i), 100 - 50 * i)
    (tmp_path / "compiled" / f".{_key(0)}.tmp").mkdir()  # a store in flight is not an entry
    assert cli.main(["cache", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    for line, i in zip(lines, (1, 0)):
        key, size, unit, day, clock, graph_class = line.split()
        assert (key, unit, graph_class) == (_key(i), "KiB", f"Graph{i}")
        assert time.strptime(f"{day} {clock}", "%Y-%m-%d %H:%M:%S")
    assert lines[2].startswith("2 entries,") and "of 1.0 MiB" in lines[2]
    assert cli.main(["cache", "clear"]) == 0
    assert capsys.readouterr().out.startswith("removed 2 entries")
    assert list((tmp_path / "compiled").iterdir()) == []
    cli.main(["cache", "list"])
    assert capsys.readouterr().out.startswith("0 entries, 0 B")


# ---- processes racing and dying ----

STORE_SCRIPT = """
    import os, sys, time
    from pathlib import Path
    from tvmgraph.compiled_cache import CompiledCache
    root, key, mode = Path(sys.argv[1]), sys.argv[2], sys.argv[3]

    def export(executable, path):
        Path(path).write_bytes(executable[:10])  # half of the library
        if mode == "kill_in_export":
            Path(root.parent / "ready").touch()
            time.sleep(600)
        if mode == "race":  # wait until both processes are in the middle of a store
            Path(root.parent / f"exporting-{os.getpid()}").touch()
            while len(list(root.parent.glob("exporting-*"))) < 2:
                time.sleep(0.01)
        Path(path).write_bytes(executable)

    if mode == "kill_before_rename":
        def rename(src, dst):
            Path(root.parent / "ready").touch()
            time.sleep(600)
        os.rename = rename
    lib = CompiledCache(root).store(key, f"library of {os.getpid()}".encode(), {"pid": os.getpid()}, export=export)
    print(lib.read_text())
"""


def _store_process(root: Path, mode: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(STORE_SCRIPT), str(root), KEY, mode], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_processes_storing_one_key_both_succeed_and_leave_one_entry(tmp_path: Path) -> None:
    """Two processes in the middle of storing the same key at once: both get a library (the
    same one, the winner's) and one entry remains, with no temporary directory."""
    root = tmp_path / "compiled"
    root.mkdir()
    procs = [_store_process(root, "race") for _ in range(2)]
    try:
        outputs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.communicate()
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert outputs[0][0] == outputs[1][0] and outputs[0][0].startswith("library of ")
    assert [p.name for p in root.iterdir()] == [KEY]
    assert CompiledCache(root)._verify(root / KEY, KEY)[0]["meta"]["pid"] == int(outputs[0][0].split()[-1])


@pytest.mark.parametrize("moment", ["kill_in_export", "kill_before_rename"])
def test_a_store_killed_with_sigkill_leaves_no_entry(moment: str, tmp_path: Path) -> None:
    """SIGKILL in the middle of a store (library half written, or everything written but not
    renamed) leaves only a temporary directory, which no load reads and the sweep removes."""
    root = tmp_path / "compiled"
    root.mkdir()
    proc = _store_process(root, moment)
    try:
        deadline = time.time() + 60
        while not (tmp_path / "ready").exists():
            assert proc.poll() is None and time.time() < deadline, "the store never reached the kill point"
            time.sleep(0.01)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    cache = CompiledCache(root)
    (left,) = root.iterdir()
    assert left.name.startswith(f".{KEY}.")
    assert cache.load(KEY) is None and cache.entries() == []
    assert cache.sweep() == 0 and left.exists()  # a young one may be a live store: kept
    assert cache.sweep(older_than=-1) == 1 and list(root.iterdir()) == []


@pytest.mark.slow
def test_two_processes_compiling_one_graph_at_once_share_one_entry(tmp_path: Path) -> None:
    """Two interpreters compile the same graph at the same time: both give the same numbers and
    the cache ends with one whole entry that a third process loads."""
    env = {**os.environ, "TVMGRAPH_CACHE_DIR": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(MLP_SCRIPT)], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert outputs[0][0] == outputs[1][0]
    assert [p.name for p in (tmp_path / "compiled").iterdir() if not p.name.startswith(".")] == [
        p.name for p in (tmp_path / "compiled").iterdir()]
    assert len(list((tmp_path / "compiled").iterdir())) == 1
    assert _run_in_fresh_process(tmp_path, MLP_SCRIPT) == outputs[0][0]


TRAIN_SCRIPT = """
    import copy, json, torch
    from torch import nn
    from tvmgraph.stages import LoweredGraph
    from tests.conftest import TrainGraph
    from tests.unit.test_compiled_cache import Scaled
    compiles = []
    original = LoweredGraph.compile
    LoweredGraph.compile = lambda self, *a, **k: compiles.append(1) or original(self, *a, **k)
    torch.manual_seed(0)
    model = Scaled()
    eager = copy.deepcopy(model)
    graph = TrainGraph(model, nn.MSELoss(), torch.optim.Adam(model.parameters(), lr=0.05))
    optimizer = torch.optim.Adam(eager.parameters(), lr=0.05)
    graph_losses, eager_losses = [], []
    for _ in range(4):
        x, y = torch.randn(5, 4), torch.randn(5, 3)
        graph_losses.append(float(graph(x, y)))
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(eager(x), y)
        loss.backward()
        optimizer.step()
        eager_losses.append(float(loss))
    diff = max(float((a - b).abs().max()) for a, b in zip(model.parameters(), eager.parameters()))
    print(json.dumps({"compiles": len(compiles), "graph": graph_losses, "eager": eager_losses, "diff": diff}))
"""


@pytest.mark.slow
def test_a_training_graph_loaded_in_a_new_process_matches_eager(tmp_path: Path) -> None:
    """A training graph (Adam, a lifted constant) stored by one process and loaded from its JSON
    entry by a fresh one, without compiling, trains like torch eager over four steps."""
    first = json.loads(_run_in_fresh_process(tmp_path, TRAIN_SCRIPT))
    second = json.loads(_run_in_fresh_process(tmp_path, TRAIN_SCRIPT))
    assert (first["compiles"], second["compiles"]) == (1, 0)
    for run in (first, second):
        assert run["graph"] == pytest.approx(run["eager"], rel=1e-4, abs=1e-5)
        assert run["diff"] < 1e-5
    assert second["graph"] == first["graph"]


def test_a_compiled_program_is_device_free_and_binds_after_a_round_trip(tmp_path: Path) -> None:
    """LoweredGraph.compile(target) gives a CompiledProgram (library, calling convention,
    layout, target; no device, module or tensor). Stored and read back from the cache, it
    binds to a device and a training graph's modules and optimizer and trains like eager."""
    from tvmgraph import codegen
    from tvmgraph.compiled_program import CompiledProgram
    from tvmgraph.entry import training_plan

    torch.manual_seed(0)
    model, reference = mlp(), mlp()
    reference.load_state_dict(model.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    graph = TrainGraph(model, nn.MSELoss(), optimizer)
    x, y = torch.randn(4, 32), torch.randn(4, 10)
    traced = graph.trace(x, y)
    plan = training_plan(graph.name, graph._state().optimizers, traced, graph.named_parameters, graph.config)
    program = traced.lower(plan).compile(target_for(x.device), graph.config)
    assert program.entry == "train_step" and program.train_layout is not None and program.key is None
    assert not any(isinstance(v, (torch.Tensor, nn.Module, torch.device)) for v in vars(program).values())
    cache = CompiledCache(tmp_path, None, artifact.encode_meta, artifact.decode_meta)
    program.store(cache, "k" * 64, codegen.export_library)
    back = CompiledProgram.from_cache(cache, "k" * 64)
    assert back.key == "k" * 64 and back.optimized is None and str(back.target) == str(program.target)
    assert back.train_layout == program.train_layout
    runner = back.bind(x.device, graph._state().modules, traced, plan)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        _, loss = runner.run([x, y])
        ref_opt.zero_grad()
        expected = nn.functional.mse_loss(reference(x), y)
        expected.backward()
        ref_opt.step()
        assert_close(loss, expected.detach())
    for p, q in zip(model.parameters(), reference.parameters()):
        assert_close(p.detach(), q.detach())
