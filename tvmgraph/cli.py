"""The `tvmgraph` command.

    tvmgraph info          versions of the stack, the detected target, the cache directory
    tvmgraph cache list    the compiled cache's entries: key, size, last use, graph class
    tvmgraph cache clear   remove every entry of the compiled cache
    tvmgraph export SCRIPT.py:FACTORY --target {host,x86_64,aarch64,cuda} [--arch sm_90] -o DIR
                           save FACTORY()'s graph (FACTORY returns (graph, example_args)) for a
                           target machine, as tvmgraph.save does (docs/deploy.md)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autotune.compiled_cache import CompiledCache


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
    from autotune.compiled_cache import CompiledCache
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


def _export(args: argparse.Namespace) -> int:
    import importlib.util
    import json
    from pathlib import Path

    import tvmgraph
    from tvmgraph.errors import SaveError

    script, sep, factory = args.factory.rpartition(":")
    if not sep or not script.endswith(".py") or not Path(script).is_file():
        raise SaveError(f"tvmgraph export: {args.factory!r} is not SCRIPT.py:FACTORY naming an existing script")
    spec = importlib.util.spec_from_file_location(Path(script).stem, script)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(Path(script).resolve().parent))  # the script's own imports, as `python SCRIPT.py`
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.pop(0)
    made = getattr(module, factory, None)
    if not callable(made):
        raise SaveError(f"tvmgraph export: {script} has no function {factory}()")
    result = made()
    if not (isinstance(result, tuple) and len(result) == 2):
        raise SaveError(f"tvmgraph export: {factory}() must return (graph, example_args), got "
                        f"{type(result).__name__}")
    graph, example_args = result
    path = tvmgraph.save(graph, args.output, example_args=example_args, target=args.target, arch=args.arch)
    manifest = json.loads((path / "manifest.json").read_text())
    size = sum(p.stat().st_size for p in path.iterdir())
    print(f"saved {manifest['graph']} for {manifest['target']['os']} {manifest['target']['machine']} "
          f"({manifest['target']['device']}) to {path} ({_size(size)})")
    for need in manifest["target"]["needs"]:
        print(f"  needs: {need}")
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
    args = parser.parse_args(argv)
    handlers = {"info": _info, "cache list": _cache_list, "cache clear": _cache_clear, "export": _export}
    command = args.command if args.command != "cache" else f"cache {args.cache_command}"
    return handlers[command](args)


if __name__ == "__main__":
    sys.exit(main())
