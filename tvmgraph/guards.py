"""Guards on the model's structure: a compiled program runs only while its modules still hold.

A compiled entry reads the live tensors of the module objects it was traced with. Replacing a
submodule (`model[2] = nn.Linear(...)`), adding or removing one, or registering a new parameter
or buffer makes that program stale. `StructureGuard.current()` returns a `ModuleStructure`
fingerprint of the graph's modules at the cost of one integer compare and one `len` per module
per call:

  * torch's global registration hooks bump a process-wide epoch whenever any module, parameter
    or buffer is assigned (that covers replacement, which keeps every count the same);
  * the number of children, parameters and buffers of every module is compared, which covers
    removal (`del model[2]`, `del layer.bias`), for which torch has no hook (`layer.bias = None`
    keeps the count: the runner finds the None and the call looks again, stages.py);
  * forward hooks and pre-hooks (the module's and torch's global ones) change what a trace
    records, and backward hooks (also a parameter's) are what a training graph refuses: an
    addition moves torch's hook-handle counter (`RemovableHandle.next_id`, one attribute
    read), a removal the size of a hook table that held any at the last walk.

Only when one of them moved is the fingerprint walked again. A fingerprint names every module
(path, class, identity, hooks) and every parameter and buffer (path, shape, dtype, whether it
has a gradient hook), so equal fingerprints mean the compiled program still addresses tensors
that fit it. A parameter replaced
by another of the same shape is read live by an inference program (no recompile); a training
graph's fingerprint also holds the parameters' identities, since its optimizers name them by
identity.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch.nn.modules import module as _module
from torch.utils.hooks import RemovableHandle

_epoch = 0
_hooks_installed = False


def _bump(*_args: object) -> None:
    global _epoch
    _epoch += 1
    # None: the hook must not replace the value being registered.


def _install_hooks() -> None:
    global _hooks_installed
    if _hooks_installed:
        return
    from torch.nn.modules import module as module_mod

    module_mod.register_module_module_registration_hook(_bump)
    module_mod.register_module_parameter_registration_hook(_bump)
    module_mod.register_module_buffer_registration_hook(_bump)
    _hooks_installed = True


class ModuleStructure:
    """A hashable fingerprint of a graph's modules; equal fingerprints address equal tensors."""

    __slots__ = ("entries", "_hash")

    def __init__(self, entries: tuple):
        self.entries = entries  # ((path, class, id, params, buffers, hooks), ...)
        self._hash = hash(entries)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, ModuleStructure) and self._hash == other._hash
                                 and self.entries == other.entries)

    def differences(self, old: ModuleStructure) -> list[str]:
        """What changed since `old`, in words: modules and tensors added, removed or replaced."""
        if self == old:
            return []
        before = {e[0]: e for e in old.entries}
        now = {e[0]: e for e in self.entries}
        diffs = [f"module '{p}' ({now[p][1]}) was added" for p in now if p not in before]
        diffs += [f"module '{p}' ({before[p][1]}) was removed" for p in before if p not in now]
        for path in now.keys() & before.keys():
            new, old_entry = now[path], before[path]
            if new[2] != old_entry[2]:
                diffs.append(f"module '{path}' was replaced ({old_entry[1]} -> {new[1]})")
                continue
            if new[5] != old_entry[5]:
                diffs.append(f"the hooks of {f'module {path!r}' if path != GLOBAL else 'every module'} "
                             f"changed")
            for kind, i in (("parameter", 3), ("buffer", 4)):
                diffs += _tensor_changes(kind, path, old_entry[i], new[i])
        return sorted(diffs) or ["the modules changed"]


def _tensor_changes(kind: str, owner: str, old: tuple, new: tuple) -> list[str]:
    before = {t[0]: t for t in old}
    now = {t[0]: t for t in new}
    where = (lambda n: f"{owner}.{n}" if owner else n)
    diffs = [f"{kind} '{where(n)}' was added" for n in now if n not in before]
    diffs += [f"{kind} '{where(n)}' was removed" for n in before if n not in now]
    for name in now.keys() & before.keys():
        if now[name] != before[name]:
            (_, _, shape0, dtype0, hooks0), (_, _, shape1, dtype1, hooks1) = before[name], now[name]
            if hooks0 != hooks1:
                diffs.append(f"{kind} '{where(name)}' {'got' if hooks1 else 'lost'} a gradient hook")
                continue
            detail = f" ({dtype0}{list(shape0)} -> {dtype1}{list(shape1)})" if (shape0, dtype0) != (shape1, dtype1) else ""
            diffs.append(f"{kind} '{where(name)}' was replaced{detail}")
    return diffs


def _tensor_entry(name: str, t: torch.Tensor, identity: bool) -> tuple:
    return (name, id(t) if identity else 0, tuple(t.shape), str(t.dtype).removeprefix("torch."),
            bool(t._backward_hooks) or bool(getattr(t, "_post_accumulate_grad_hooks", None)))


GLOBAL = "*"  # the entry of torch's global module hooks (no module path is "*")


def _hook_tables(m: torch.nn.Module) -> tuple[dict, ...]:
    # Backward hooks too: a training graph refuses them (entry.refuse_backward_hooks).
    return m._forward_pre_hooks, m._forward_hooks, m._backward_pre_hooks, m._backward_hooks


def _global_hook_tables() -> tuple[dict, ...]:
    return (_module._global_forward_pre_hooks, _module._global_forward_hooks,
            _module._global_backward_pre_hooks, _module._global_backward_hooks)


def _hooks(tables: tuple[dict, ...]) -> tuple:
    """The hooks' handle ids: each registration makes a new one."""
    return tuple(map(tuple, tables))


def fingerprint(named_modules: list[tuple[str, torch.nn.Module]], identities: bool = False) -> ModuleStructure:
    """The structure of `named_modules` (paths in the graph, module objects), walked now;
    with `identities`, which parameter objects they hold too."""
    entries = []
    for path, m in named_modules:
        params = tuple(_tensor_entry(n, p, identities) for n, p in m._parameters.items() if p is not None)
        buffers = tuple(_tensor_entry(n, b, False) for n, b in m._buffers.items() if b is not None)
        entries.append((path, type(m).__qualname__, id(m), params, buffers, _hooks(_hook_tables(m))))
    entries.append((GLOBAL, "", 0, (), (), _hooks(_global_hook_tables())))
    return ModuleStructure(tuple(entries))


class StructureGuard:
    """Per graph: the current `ModuleStructure` and module list, re-walked only when they moved."""

    __slots__ = ("_walk", "_epoch", "_count", "_tables", "_modules", "_named", "_identities", "structure",
                 "_hook_id", "_hook_tables", "_hook_count")

    def __init__(self, walk: Callable[[], list[tuple[str, torch.nn.Module]]]):
        _install_hooks()
        self._walk = walk
        self._epoch = -1
        self._count = 0
        self._tables: list[dict] = []  # every module's _modules, _parameters and _buffers
        self._modules: list[torch.nn.Module] = []
        self._named: list[tuple[str, torch.nn.Module]] = []
        self._identities = False
        self._hook_id = -1
        self._hook_tables: list[dict] = []  # the hook tables that held hooks at the last walk
        self._hook_count = 0
        self.structure: ModuleStructure | None = None

    def invalidate(self) -> None:
        """The graph's own module attributes changed (its setattr/delattr)."""
        self._epoch = -1

    def current(self, identities: bool = False) -> ModuleStructure:
        """The structure now (with parameter identities for a training graph); cheap when
        nothing was registered or removed since the last call.

        One total of entries suffices for removals: an addition that could hide one in the
        total bumps the epoch (or, for hooks, the handle counter)."""
        if (self._epoch != _epoch or sum(map(len, self._tables)) != self._count
                or identities is not self._identities or RemovableHandle.next_id != self._hook_id
                or sum(map(len, self._hook_tables)) != self._hook_count):
            self._epoch = _epoch
            self._identities = identities
            self._hook_id = RemovableHandle.next_id
            self._named = self._walk()
            self._modules = [m for _, m in self._named]
            self._tables = [t for m in self._modules for t in (m._modules, m._parameters, m._buffers)]
            self._count = sum(map(len, self._tables))
            hooks = [t for m in self._modules for t in _hook_tables(m)] + list(_global_hook_tables())
            self._hook_tables = [t for t in hooks if t]
            self._hook_count = sum(map(len, self._hook_tables))
            new = fingerprint(self._named, identities)
            if new != self.structure:
                self.structure = new
        assert self.structure is not None
        return self.structure

    @property
    def modules(self) -> list[torch.nn.Module]:
        """Every module in the graph, in `named_modules()` order, as of the last `current()`."""
        return self._modules

    @property
    def paths(self) -> list[str]:
        return [p for p, _ in self._named]


def modules_of(modules: Mapping[str, torch.nn.Module]) -> list[tuple[str, torch.nn.Module]]:
    """`(path in the graph, module)` for every registered module and its submodules."""
    return [(f"{name}.{sub}" if sub else name, m)
            for name, top in modules.items() for sub, m in top.named_modules()]
