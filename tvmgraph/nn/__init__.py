"""`tvmgraph.nn`: the graph-mode counterpart of `torch.nn` (as `oneflow.nn.Graph` is to OneFlow)."""

from ..graph import Graph as Graph
from ..graph_module import GraphModule as GraphModule

__all__ = ["Graph", "GraphModule"]
