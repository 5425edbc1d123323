"""The `tvmgraph` command.

    tvmgraph info          versions of the stack, the detected target, the cache directory
    tvmgraph cache list    the compiled cache's entries: key, size, last use, graph class
    tvmgraph cache clear   remove every entry of the compiled cache
    tvmgraph export SCRIPT.py:FACTORY --target {host,x86_64,aarch64,cuda} [--arch sm_90] -o DIR
                           save FACTORY()'s graph (FACTORY returns (graph, example_args)) for a
                           target machine, as tvmgraph.save does (docs/deploy.md)
    tvmgraph tune SCRIPT.py:FACTORY [--trials N] [--minutes M] [--target {host,cuda}] [--log-dir DIR]
                           [--rpc HOST:PORT --rpc-key KEY] [--plot tuning.png]
                           tune the graph's kernels into its tuning log, which every later
                           compile of that graph name applies (docs/autotune.md)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tvmgraph.compiled_cache import CompiledCache


def _info(_args: argparse.Namespace) -> int:
    import numpy
    import torch
    import tvm
    import tvm_ffi

    import tvmgraph
    from tvmgraph.config import settings
    from tvmgraph.target import target_for

    rows = [
        ("tvmgraph", tvmgraph.__version__),
        ("torch", torch.__version__),
        ("apache-tvm", tvm.__version__),
        ("apache-tvm-ffi", tvm_ffi.__version__),
        ("numpy", numpy.__version__),
        ("cpu target", str(target_for(torch.device("cpu")))),
        ("cuda", torch.cuda.is_available() and torch.cuda.get_device_name() or "not available"),
        ("cache dir", str(settings.cache_dir)),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _count(n: int) -> str:
    return f"{n} entry" if n == 1 else f"{n} entries"


def _compiled_cache() -> CompiledCache:
    from tvmgraph.compiled_cache import CompiledCache
    from tvmgraph.config import settings

    return CompiledCache(settings.cache_dir / "compiled", settings.cache_max_bytes)


def _cache_list(_args: argparse.Namespace) -> int:
    import time

    cache = _compiled_cache()
    entries = cache.entries()
    for e in entries:
        used = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.last_used))
        graph_class = e.key.rsplit("-", 1)[0]  # keys are "<graph class>-<hash>"
        print(f"{e.key}  {_size(e.size):>10}  {used}  {graph_class}")
    total = sum(e.size for e in entries)
    print(f"{_count(len(entries))}, {_size(total)} of {_size(cache.max_bytes)} (TVMGRAPH_CACHE_MAX_BYTES) "
          f"in {cache.root}")
    return 0


def _cache_clear(_args: argparse.Namespace) -> int:
    cache = _compiled_cache()
    removed = cache.clear()
    print(f"removed {_count(len(removed))} ({_size(sum(e.size for e in removed))}) from {cache.root}")
    return 0


def _from_factory(command: str, spec_text: str, error: type[Exception]) -> tuple[Any, tuple]:
    """(graph, example_args) from `SCRIPT.py:FACTORY`, the script run as `python SCRIPT.py` would."""
    import importlib.util
    from pathlib import Path

    script, sep, factory = spec_text.rpartition(":")
    if not sep or not script.endswith(".py") or not Path(script).is_file():
        raise error(f"tvmgraph {command}: {spec_text!r} is not SCRIPT.py:FACTORY naming an existing script")
    spec = importlib.util.spec_from_file_location(Path(script).stem, script)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(Path(script).resolve().parent))  # the script's own imports, as `python SCRIPT.py`
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.pop(0)
    made = getattr(module, factory, None)
    if not callable(made):
        raise error(f"tvmgraph {command}: {script} has no function {factory}()")
    result = made()
    if not (isinstance(result, tuple) and len(result) == 2):
        raise error(f"tvmgraph {command}: {factory}() must return (graph, example_args), got "
                    f"{type(result).__name__}")
    graph, example_args = result
    return graph, example_args if isinstance(example_args, tuple) else (example_args,)


def _export(args: argparse.Namespace) -> int:
    import json

    import tvmgraph
    from tvmgraph.errors import SaveError

    graph, example_args = _from_factory("export", args.factory, SaveError)
    path = tvmgraph.save(graph, args.output, example_args=example_args, target=args.target, arch=args.arch)
    manifest = json.loads((path / "manifest.json").read_text())
    size = sum(p.stat().st_size for p in path.iterdir())
    print(f"saved {manifest['graph']} for {manifest['target']['os']} {manifest['target']['machine']} "
          f"({manifest['target']['device']}) to {path} ({_size(size)})")
    for need in manifest["target"]["needs"]:
        print(f"  needs: {need}")
    return 0


def _tune(args: argparse.Namespace) -> int:
    import tvm

    from autotune import RPCTarget, tune
    from tvmgraph.errors import TuningError
    from tvmgraph.target import valid_cuda_arch

    graph, example_args = _from_factory("tune", args.factory, TuningError)
    target = None
    if args.target == "cuda":
        if args.arch is not None and not valid_cuda_arch(args.arch):
            raise TuningError(f"tvmgraph tune: --arch {args.arch} is not a CUDA architecture; give one as "
                              f"sm_<version>, such as sm_80 or sm_90")
        target = tvm.target.Target({"kind": "cuda", "arch": args.arch or "sm_90"})
    elif args.arch is not None:
        raise TuningError(f"tvmgraph tune: --arch {args.arch} is for --target cuda")
    rpc = RPCTarget.parse(args.rpc, args.rpc_key) if args.rpc else None
    if target is not None and target.kind.name == "cuda" and rpc is None:
        import torch

        if not torch.cuda.is_available():
            raise TuningError("tvmgraph tune --target cuda: this machine has no GPU to measure on; run the "
                              "command on a GPU machine, or measure there with --rpc HOST:PORT --rpc-key KEY")
    report = tune(graph, *example_args, trials=args.trials, minutes=args.minutes, target=target,
                  log_dir=args.log_dir, rpc=rpc, progress=not args.quiet, eager=rpc is None)
    print(report.table())
    if args.plot:
        print(f"plot: {report.plot(args.plot)}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `tvmgraph` console script."""
    parser = argparse.ArgumentParser(prog="tvmgraph", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="print versions, the detected target and the cache directory")
    cache = commands.add_parser("cache", help="inspect or clear the compiled cache")
    cache_commands = cache.add_subparsers(dest="cache_command", required=True)
    cache_commands.add_parser("list", help="one line per entry: key, size, last used, graph class")
    cache_commands.add_parser("clear", help="remove every entry")
    export = commands.add_parser("export", help="save a graph for a target machine (docs/deploy.md)")
    export.add_argument("factory", metavar="SCRIPT.py:FACTORY",
                        help="a function returning (graph, example_args)")
    export.add_argument("--target", choices=["host", "x86_64", "aarch64", "cuda"], default="host")
    export.add_argument("--arch", help="CUDA architecture for --target cuda (default sm_90)")
    export.add_argument("-o", "--output", required=True, help="the directory to write")
    tune = commands.add_parser("tune", help="auto-tune a graph's kernels into its tuning log (docs/autotune.md)")
    tune.add_argument("factory", metavar="SCRIPT.py:FACTORY", help="a function returning (graph, example_args)")
    tune.add_argument("--trials", type=int, help="candidates to measure in all (default: 32 per kernel tuned)")
    tune.add_argument("--minutes", type=float, help="stop after this long (the log keeps what was measured)")
    tune.add_argument("--target", choices=["host", "cuda"], default="host")
    tune.add_argument("--arch", help="CUDA architecture for --target cuda (default sm_90)")
    tune.add_argument("--log-dir", help="the tuning root (default: $TVMGRAPH_CACHE_DIR/tuning)")
    tune.add_argument("--rpc", metavar="HOST:PORT", help="measure on a device registered with this TVM RPC tracker")
    tune.add_argument("--rpc-key", default="default", help="the device key on the tracker")
    tune.add_argument("--plot", metavar="PNG", help="draw the best latency against trials into this file")
    tune.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    handlers = {"info": _info, "cache list": _cache_list, "cache clear": _cache_clear, "export": _export,
                "tune": _tune}
    command = args.command if args.command != "cache" else f"cache {args.cache_command}"
    return handlers[command](args)


def run(argv: Sequence[str] | None = None) -> int:
    """The `tvmgraph` console script: `main`, with tvmgraph's own errors (a script without its
    factory, an unsupported target, a failed tune) printed as one line and exit status 1 instead
    of a traceback through this module; any other exception is a bug and keeps its traceback."""
    from tvmgraph.errors import TvmGraphError

    try:
        return main(argv)
    except TvmGraphError as error:
        print(f"tvmgraph: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(run())
