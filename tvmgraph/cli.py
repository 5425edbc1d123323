"""The `tvmgraph` command.

    tvmgraph info      versions of the stack, the detected target, the cache directory
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


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


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `tvmgraph` console script."""
    parser = argparse.ArgumentParser(prog="tvmgraph", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="print versions, the detected target and the cache directory")
    args = parser.parse_args(argv)
    handlers = {"info": _info}
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
