"""tvmgraph: run PyTorch modules as TVM-compiled static graphs, the way OneFlow's nn.Graph does.

    class MyGraph(tvmgraph.nn.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
        def build(self, x):
            return self.model(x)

`import tvmgraph` imports neither torch nor TVM: a process that only runs saved graphs
(`tvmgraph.load`) never needs torch. The rest loads on first use.
"""

import importlib
from typing import Any

from . import threads
from .deploy_runtime import load as load
from .errors import TvmGraphError as TvmGraphError

threads.configure()  # before anything starts TVM's thread pool

__version__ = "0.1.0"

__all__ = ["nn", "GraphConfig", "TvmGraphError", "TracedGraph", "LoweredGraph", "CompiledProgram", "CompiledGraph",
           "save", "load", "tune"]

_LAZY = {"GraphConfig": "tvmgraph.config", "TracedGraph": "tvmgraph.stages", "LoweredGraph": "tvmgraph.stages",
         "CompiledProgram": "tvmgraph.compiled_program", "CompiledGraph": "tvmgraph.stages",
         "save": "tvmgraph.deploy", "tune": "autotune.tuner"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name.startswith("_"):
        raise AttributeError(f"module 'tvmgraph' has no attribute {name!r}")
    else:
        try:
            value = importlib.import_module(f".{name}", __name__)  # submodules: tvmgraph.nn, tvmgraph.config
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module 'tvmgraph' has no attribute {name!r}") from None
    globals()[name] = value
    return value
