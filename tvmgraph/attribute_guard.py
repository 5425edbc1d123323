"""Guards on the Python values build() read: a compiled program holds them as constants.

`self.scale = 3.0` on a module, or `self.use_act = False`, after a graph compiled bakes the
old value into the program; before this guard the graph kept running it (silently stale).
While build() is traced, `recording` notes every plain value (bool, int, float, str, None, a
dtype, tuples of them) that the code reads from a module's or the graph's own attributes, and
any other public attribute value but a submodule (a list, an Enum member, a function, a numpy
scalar, a config object), compared by identity, then by its own `==`. An
`AttributeGuard` holds those (object dict, name, value) triples; a compiled entry runs only
while `holds()`, otherwise the graph compiles for the new values, as it does for a new input
shape. A check costs one dict lookup and an identity compare per value read.

A public value read from the class (a method, a class default `scale = 1.0`) is guarded the
other way: nothing may be set on the instance under its name (the marker `None`).

Not covered: values that build() itself changes while it is traced (a call counter: a side
effect, run once per trace), a class attribute changed on the class, module-level globals, and
objects changed in place (a list appended to, `self.cfg.scale = 3` on the same config object).
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator

import torch

_MISSING = object()
_PLAIN = (bool, int, float, str, type(None), torch.dtype)
# Guarded separately (module modes, guards.py) or internal to torch.
_SKIPPED = frozenset({"training"})
# nn.Module's own methods (`named_modules`, `parameters`, ...), which torch and tvmgraph read
# while tracing: not the user's values, and not worth a guard each.
_MODULE_API = frozenset(vars(torch.nn.Module))


def _plain(value: object) -> bool:
    if isinstance(value, tuple):
        return all(_plain(v) for v in value)
    return isinstance(value, _PLAIN)


def _same(now: object, then: object) -> bool:
    """Equal as a program constant: 1 and True and 1.0 are different constants. Tensors are
    read by the program at each call (binding.py): another tensor of the same kind serves."""
    if now is then:
        return True
    if type(now) is not type(then):
        return False
    if isinstance(now, torch.Tensor):
        return (now.shape, now.dtype, now.device, now.layout) == (then.shape, then.dtype, then.device, then.layout)
    if isinstance(now, tuple):
        return len(now) == len(then) and all(map(_same, now, then))
    try:  # any other object: by its own equality (a list, a dataclass config, an Enum member)
        return bool(now == then)
    except Exception:  # noqa: BLE001 - an == that is elementwise (arrays, lists of tensors) or raises
        return False


def _shown(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor {str(value.dtype).removeprefix('torch.')}{list(value.shape)} on {value.device}"
    shown = repr(value)
    return shown if len(shown) <= 80 else shown[:77] + "..."


def _guarded(name: str, value: object) -> bool:
    """Whether a value read from an owner's __dict__ is guarded: plain values, tensors, and any
    other public attribute but a module (a list, an Enum member, a function, a numpy scalar, a
    config object: reassigning one recompiles). Private ones (`_name`) that are not plain are
    torch's and tvmgraph's own bookkeeping."""
    if _plain(value) or isinstance(value, torch.Tensor) or name == "forward":
        return True
    return not name.startswith("_") and not isinstance(value, torch.nn.Module)


class AttributeGuard:
    """The plain attribute values a trace read: `(owner's __dict__, where, name, value)`."""

    __slots__ = ("reads", "_dicts", "_names", "_values")

    def __init__(self, reads: tuple[tuple[dict, str, str, object], ...] = ()):
        self.reads = reads
        self._dicts = [r[0] for r in reads]
        self._names = [r[2] for r in reads]
        self._values = [r[3] for r in reads]

    def holds(self) -> bool:
        # Every call: C-level maps (about 40 ns a value) while the objects are the ones seen
        # last; equal objects put in their place (export re-creates conv tuples) take the slow
        # compare once, then become the ones seen.
        now = list(map(dict.get, self._dicts, self._names))
        if all(map(operator.is_, now, self._values)):
            return True
        if all(n is v or (n is not None and _same(n, v)) or (n is None and v is None and name in d)
               for d, name, n, v in zip(self._dicts, self._names, now, self._values)):
            self._values = now
            return True
        return False

    def changes(self) -> list[str]:
        """What changed since the trace, in words."""
        out = []
        for attrs, where, name, value in self.reads:
            now = attrs.get(name, _MISSING)
            if value is None:  # None, or the class's (the marker): holds while absent or None
                if now is not _MISSING and now is not None:
                    out.append(f"attribute {where or 'the graph'}.{name} was None or the class's, now set on "
                               f"the instance to {_shown(now)}")
            elif now is not value and not _same(now, value):
                out.append(f"attribute {where}.{name} was {_shown(value)}, now "
                           f"{'deleted' if now is _MISSING else _shown(now)}")
        return out

    def __len__(self) -> int:
        return len(self.reads)


@contextlib.contextmanager
def recording(owners: list[tuple[str, object]]) -> Iterator[list[AttributeGuard]]:
    """Record the plain attributes of `owners` (`(where, object)`: modules, the graph) read in
    the block; the guard is the single item of the yielded list once the block ends.

    Reads go through `object.__getattribute__` of `torch.nn.Module` and the graph's class,
    replaced for the block only (nn.Module defines none of its own)."""
    watched = {id(o): (where, o) for where, o in owners}
    reads: dict[tuple[int, str], tuple[dict, str, str, object]] = {}

    def getattribute(obj: object, name: str) -> object:
        value = object.__getattribute__(obj, name)
        owner = watched.get(id(obj))
        if owner is not None and owner[1] is obj and name not in _SKIPPED and (id(obj), name) not in reads:
            attrs = object.__getattribute__(obj, "__dict__")
            here = attrs.get(name, _MISSING)
            if here is value and _guarded(name, value):
                reads[(id(obj), name)] = (attrs, owner[0], name, value)
            elif here is _MISSING and not name.startswith("_") and name not in _SKIPPED and (
                    name == "forward" or name not in _MODULE_API):
                # The class's (forward, a helper method, a class default `scale = 1.0`): guard that
                # nothing set on the instance hides it (`m.scale = 3.0` ran the 1.0 program on).
                reads[(id(obj), name)] = (attrs, owner[0], name, None)
        return value

    classes = {torch.nn.Module} | {type(o) for _, o in owners if not isinstance(o, torch.nn.Module)}
    patched = [c for c in classes if "__getattribute__" not in c.__dict__]
    result: list[AttributeGuard] = []
    for cls in patched:
        cls.__getattribute__ = getattribute
    try:
        yield result
    finally:
        for cls in patched:
            del cls.__getattribute__
        # A value the traced code changed itself (`self.calls += 1`) is a side effect, not a
        # constant: guarding it would fail on every call.
        kept = tuple(r for r in reads.values() if _same(r[0].get(r[2], _MISSING), r[3])
                     or (r[3] is None and r[2] not in r[0]))
        result.append(AttributeGuard(kept))
