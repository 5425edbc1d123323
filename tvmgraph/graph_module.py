"""Per-module options of a graph, OneFlow's way: `graph.model.layer1.to(tvmgraph.nn.GraphModule)`.

In OneFlow a module assigned to an `nn.Graph` is wrapped in a ProxyModule; its
`.to(nn.graph.GraphModule)` is the module's options in that graph (`activation_checkpointing`,
`set_stage`). tvmgraph does the same with `ModuleProxy`, which `graph.<name>` returns: it
forwards everything else to the module (attributes, calls, indexing, `isinstance`), so code that
uses `graph.model` as the torch module keeps working; `.to(torch.nn.Module)` is the module itself
(for an identity check: `graph.model.to(torch.nn.Module) is model`).

The options live in the graph's `GraphConfig` (`activation_checkpointing`: the paths switched on;
`pipeline_stages`: (path, stage, rank) of each module given a stage),
so a change compiles the program again at the next call, like any other option.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch

from .errors import ConfigError

if TYPE_CHECKING:
    from .config import GraphConfig

_SETTABLE = ("activation_checkpointing",)
_OPTIONS = ("activation_checkpointing", "set_stage", "stage_id", "stage_placement")


class GraphModule:
    """The options of one module in one graph: `graph.<path>.to(tvmgraph.nn.GraphModule)`.

    `activation_checkpointing` (default False): in a training graph, the backward pass
    recomputes what each call of the module computed instead of keeping it from the forward
    pass (docs/training.md, "Activation checkpointing").
    """

    __slots__ = ("_graph", "_path", "_config")

    def __init__(self, graph_name: str, path: str, config: GraphConfig) -> None:
        object.__setattr__(self, "_graph", graph_name)
        object.__setattr__(self, "_path", path)
        object.__setattr__(self, "_config", config)

    @property
    def name(self) -> str:
        """The module's path in the graph (`model.layer1`)."""
        return self._path

    @property
    def activation_checkpointing(self) -> bool:
        """Whether the backward pass recomputes this module's activations (default False)."""
        return self._path in self._config.activation_checkpointing

    @activation_checkpointing.setter
    def activation_checkpointing(self, mode: bool) -> None:
        if not isinstance(mode, bool):
            raise ConfigError(f"{self._graph}: {self._path}.to(GraphModule).activation_checkpointing takes True "
                              f"or False, got {mode!r}")
        self._config._checkpoint_module(self._path, mode)

    def set_stage(self, stage_id: int, placement: Any = None) -> None:
        """Run this module on pipeline stage `stage_id`, on the torch.distributed rank
        `placement` (an int, a list of one rank, or an object with `.ranks` such as OneFlow's
        placement; default: the rank numbered `stage_id`). docs/distributed.md, "Pipeline stages"."""
        if type(stage_id) is not int or stage_id < 0:
            raise ConfigError(f"{self._graph}: {self._path}.to(GraphModule).set_stage(stage_id, placement) takes a "
                              f"stage number >= 0, got {stage_id!r}")
        self._config._set_stage(self._path, stage_id, _rank_of(placement, stage_id, self._graph, self._path))

    @property
    def stage_id(self) -> int | None:
        """The pipeline stage set with `set_stage`, or None."""
        return next((s for p, s, _ in self._config.pipeline_stages if p == self._path), None)

    @property
    def stage_placement(self) -> int | None:
        """The rank that runs this module's stage, or None."""
        return next((r for p, _, r in self._config.pipeline_stages if p == self._path), None)

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"{self._graph}: GraphModule of '{self._path}' has no option {name!r}; "
                             f"tvmgraph's per-module options are: {', '.join(_OPTIONS)}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _SETTABLE:
            object.__setattr__(self, name, value)
        elif name in _OPTIONS:
            raise ConfigError(f"{self._graph}: GraphModule.{name} of '{self._path}' is read-only; set the stage with "
                              f"graph.{self._path}.to(tvmgraph.nn.GraphModule).set_stage(stage_id, placement)")
        else:
            self.__getattr__(name)  # raises: an unknown option is never silently kept

    def __repr__(self) -> str:
        stage = f", stage_id={self.stage_id}, stage_placement={self.stage_placement}" if self.stage_id is not None else ""
        return f"GraphModule({self._path}, activation_checkpointing={self.activation_checkpointing}{stage})"


def _rank_of(placement: Any, stage_id: int, graph: str, path: str) -> int:
    """The one rank a stage's `placement` names."""
    if placement is None:
        return stage_id
    ranks = getattr(placement, "ranks", placement)
    if isinstance(ranks, (list, tuple)) and len(ranks) == 1:
        ranks = ranks[0]
    if type(ranks) is not int or ranks < 0:
        raise ConfigError(f"{graph}: {path}.to(GraphModule).set_stage({stage_id}, placement) takes the rank that runs "
                          f"the stage (an int, or a list of one rank), got {placement!r}. tvmgraph runs each "
                          f"stage on one rank of the torch.distributed process group.")
    return ranks


def unwrap(value: Any) -> Any:
    """The module behind a `ModuleProxy`; anything else as it is."""
    return object.__getattribute__(value, "_module") if type(value) is ModuleProxy else value


class ModuleProxy:
    """`graph.<name>` (and its submodules): the module, plus `.to(tvmgraph.nn.GraphModule)`.

    Forwards attribute reads and writes, calls, indexing, iteration, `len`, `repr`, equality and
    hashing to the module; `isinstance(graph.model, nn.Linear)` holds. Pickling or copying it
    pickles or copies the module.
    """

    __slots__ = ("_module", "_path", "_graph", "_config")

    def __init__(self, module: torch.nn.Module, path: str, graph_name: str, config: GraphConfig) -> None:
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "_path", path)
        object.__setattr__(self, "_graph", graph_name)
        object.__setattr__(self, "_config", config)

    @property
    def __class__(self) -> type:  # isinstance(proxy, nn.Module) and isinstance(proxy, type(module))
        return type(object.__getattribute__(self, "_module"))

    def to(self, *args: Any, **kwargs: Any) -> Any:
        """`to(tvmgraph.nn.GraphModule)`: the module's options in this graph; `to(torch.nn.Module)`:
        the module itself; anything else is the module's own `to` (device, dtype)."""
        if len(args) == 1 and not kwargs and args[0] is GraphModule:
            return GraphModule(self._graph, self._path, self._config)
        if len(args) == 1 and not kwargs and args[0] is torch.nn.Module:
            return self._module
        return self._module.to(*args, **kwargs)

    def _child(self, value: Any) -> Any:
        """A direct submodule comes back as a proxy too, with its path."""
        if isinstance(value, torch.nn.Module) and type(value) is not ModuleProxy:
            for name, child in self._module._modules.items():
                if child is value:
                    return ModuleProxy(value, f"{self._path}.{name}", self._graph, self._config)
        return value

    def __getattr__(self, name: str) -> Any:
        return self._child(getattr(self._module, name))

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._module, name, unwrap(value))

    def __delattr__(self, name: str) -> None:
        delattr(self._module, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._module(*args, **kwargs)

    def __getitem__(self, key: Any) -> Any:
        return self._child(self._module[key])

    def __setitem__(self, key: Any, value: Any) -> None:
        self._module[key] = unwrap(value)

    def __delitem__(self, key: Any) -> None:
        del self._module[key]

    def __iter__(self) -> Any:
        return (self._child(item) for item in self._module)

    def __len__(self) -> int:
        return len(self._module)

    def __contains__(self, item: Any) -> bool:
        return item in self._module

    def __repr__(self) -> str:
        return repr(self._module)

    def __dir__(self) -> list[str]:
        return dir(self._module)

    def __eq__(self, other: object) -> bool:
        return self._module == unwrap(other)

    def __hash__(self) -> int:
        return hash(self._module)

    def __reduce_ex__(self, protocol: int) -> Any:
        return self._module.__reduce_ex__(protocol)

    def __copy__(self) -> torch.nn.Module:
        return copy.copy(self._module)

    def __deepcopy__(self, memo: dict) -> torch.nn.Module:
        return copy.deepcopy(self._module, memo)
