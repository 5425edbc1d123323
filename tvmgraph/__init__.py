"""tvmgraph: run PyTorch modules as TVM-compiled static graphs, the way OneFlow's nn.Graph does.

    class MyGraph(tvmgraph.nn.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
        def build(self, x):
            return self.model(x)
"""

from . import nn as nn
from .config import GraphConfig as GraphConfig
from .errors import TvmGraphError as TvmGraphError
from .stages import CompiledGraph as CompiledGraph
from .stages import LoweredGraph as LoweredGraph
from .stages import TracedGraph as TracedGraph

__version__ = "0.1.0"

__all__ = ["nn", "GraphConfig", "TvmGraphError", "TracedGraph", "LoweredGraph", "CompiledGraph"]
