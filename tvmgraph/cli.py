"""The `tvmgraph` command.

    tvmgraph info          versions of the stack, the detected target, the cache directory
    tvmgraph cache list    the compiled cache's entries: key, size, last use, graph class
    tvmgraph cache clear   remove every entry of the compiled cache
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


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `tvmgraph` console script."""
    parser = argparse.ArgumentParser(prog="tvmgraph", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="print versions, the detected target and the cache directory")
    cache = commands.add_parser("cache", help="inspect or clear the compiled cache")
    cache_commands = cache.add_subparsers(dest="cache_command", required=True)
    cache_commands.add_parser("list", help="one line per entry: key, size, last used, graph class")
    cache_commands.add_parser("clear", help="remove every entry")
    args = parser.parse_args(argv)
    handlers = {"info": _info, "cache list": _cache_list, "cache clear": _cache_clear}
    command = args.command if args.command != "cache" else f"cache {args.cache_command}"
    return handlers[command](args)


if __name__ == "__main__":
    sys.exit(main())
