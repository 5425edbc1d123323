"""Tuning logs: one directory per graph name and target, read defensively, written under a lock.

    $TVMGRAPH_CACHE_DIR/tuning/<graph name>/<target key>/
        database_workload.json        MetaSchedule's JSON database: one kernel (workload) per line
        database_tuning_record.json   one measured candidate per line: [workload index, record]
        choices.json                  per kernel: default and tuned latency, and which one compiles
        .lock                         held by the tuner that is writing the log

The two database files are MetaSchedule's own format, so a log can be read, extended or
pruned with MetaSchedule's tools. They are appended to while a tuner runs; a process killed
mid-write leaves a truncated last line, which MetaSchedule's own reader refuses (the whole
database fails to load). Here every line is parsed on its own: an unreadable line is dropped
with one warning and the others are kept. `choices.json` is written whole and renamed into
place, so it is either the old or the new version, never a mix.

A compile reads the log through `TuningLog.applied()`: the best record of every kernel whose
tuned schedule measured faster than tvmgraph's default one, and a digest of exactly those
records, which is part of the compiled-cache key.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import math
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import tvm

from tvmgraph.artifact_format import write_atomically
from tvmgraph.config import settings
from tvmgraph.errors import ConfigError

logger = logging.getLogger("tvmgraph.autotune")

WORKLOADS = "database_workload.json"
RECORDS = "database_tuning_record.json"
CHOICES = "choices.json"
CHOICES_FORMAT = 1
FAILED_RUN_S = 1e9  # MetaSchedule records a candidate that failed to build or run with 1e10 s

_SAFE_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


def tuning_root() -> Path:
    """Where all tuning logs live (under TVMGRAPH_CACHE_DIR)."""
    return settings.cache_dir / "tuning"


def check_log_name(name: str) -> str:
    """A graph name used as a directory: letters, digits, `_`, `.` and `-`."""
    if not isinstance(name, str) or not _SAFE_NAME.match(name) or name in (".", ".."):
        raise ConfigError(f"tuning log name {name!r}: use 1-128 letters, digits, '_', '.' or '-' "
                          f"(it names a directory under {tuning_root()})")
    return name


def target_key(target: tvm.target.Target) -> str:
    """A directory name for `target`: what decides the speed of a kernel (kind, CPU or GPU
    architecture, triple, features) and the TVM version. MetaSchedule's lookup ignores the
    target, so a log must never be shared between two of these."""
    spec = target.export()
    parts = [spec["kind"]]
    for name in ("mtriple", "mcpu", "arch"):
        if spec.get(name):
            parts.append(str(spec[name]))
    features = ",".join(sorted(spec.get("mattr") or []))
    digest = hashlib.sha256(features.encode()).hexdigest()[:8] if features else ""
    parts += [digest] if digest else []
    parts.append(f"tvm{tvm.__version__}")
    return re.sub(r"[^A-Za-z0-9_.-]", "_", "-".join(parts))


@dataclass
class KernelChoice:
    """What tuning measured for one kernel, and whether compiles use its tuned schedule."""

    workload: str          # MetaSchedule's structural hash of the kernel (its workload key)
    name: str
    flops: float
    calls: int             # how many times the graph's program calls it
    default_us: float | None
    tuned_us: float | None
    trials: int
    use_tuned: bool

    @staticmethod
    def from_json(doc: dict[str, Any]) -> KernelChoice:
        choice = KernelChoice(**doc)
        if not isinstance(choice.workload, str) or not isinstance(choice.use_tuned, bool):
            raise ValueError("bad kernel entry")
        return choice


@dataclass
class Choices:
    """`choices.json`: the tuner's verdict per kernel, and for the graph as a whole."""

    kernels: list[KernelChoice] = field(default_factory=list)
    graph_untuned_ms: float | None = None
    graph_tuned_ms: float | None = None
    enabled: bool = True  # False: the tuned graph measured slower, so compiles use no record

    def to_json(self) -> dict[str, Any]:
        return {"format": CHOICES_FORMAT, **asdict(self)}

    @staticmethod
    def from_json(doc: Any) -> Choices:
        if not isinstance(doc, dict) or doc.get("format") != CHOICES_FORMAT:
            raise ValueError(f"not a format-{CHOICES_FORMAT} choices file")
        kernels = [KernelChoice.from_json(k) for k in doc["kernels"]]
        return Choices(kernels, doc.get("graph_untuned_ms"), doc.get("graph_tuned_ms"), bool(doc["enabled"]))


@dataclass(frozen=True)
class AppliedLog:
    """The records a compile applies, in a database that MetaScheduleApplyDatabase reads."""

    directory: Path
    kernels: int       # kernels with a record in it
    digest: str        # sha256 of those records: part of the compiled-cache key
    database: Any = field(repr=False)  # ms.database.MemoryDatabase


class TuningLog:
    """The tuning log of one graph name on one target."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    @staticmethod
    def for_graph(name: str, target: tvm.target.Target, root: Path | None = None) -> TuningLog:
        return TuningLog((root or tuning_root()) / check_log_name(name) / target_key(target))

    def __repr__(self) -> str:
        return f"TuningLog({str(self.directory)!r})"

    @property
    def workloads_path(self) -> Path:
        return self.directory / WORKLOADS

    @property
    def records_path(self) -> Path:
        return self.directory / RECORDS

    def exists(self) -> bool:
        return self.records_path.exists()

    # ---- reading ----

    def read(self, warn: bool = True) -> tuple[list[Any], list[tuple[int, Any]], int]:
        """(workloads, [(workload index, record)], number of lines dropped). Each line is parsed
        on its own; one that does not parse, or names a workload that is not there, is dropped."""
        from tvm.s_tir import meta_schedule as ms

        workload_docs, dropped_workloads = _json_lines(self.workloads_path)
        record_docs, dropped = _json_lines(self.records_path)
        dropped += dropped_workloads
        workloads = []
        for doc in workload_docs:
            try:
                workloads.append(ms.database.Workload.from_json(doc))
            except Exception:  # noqa: BLE001  (TVM raises several error types for bad JSON)
                workloads.append(None)
                dropped += 1
        records = []
        for doc in record_docs:
            try:
                index, body = doc
                workload = workloads[index] if isinstance(index, int) and 0 <= index < len(workloads) else None
                if workload is None:
                    raise ValueError("record of an unknown workload")
                if not sound_trace(body):
                    raise ValueError("a trace TVM would read out of bounds")
                records.append((index, ms.database.TuningRecord.from_json(body, workload)))
            except Exception:  # noqa: BLE001
                dropped += 1
        if dropped and warn:
            logger.warning("tuning log %s: dropped %d unreadable line(s) (truncated or corrupt), kept %d "
                           "record(s); `tvmgraph tune` rewrites the log without them", self.directory,
                           dropped, len(records))
        return workloads, records, dropped

    def read_choices(self) -> Choices | None:
        path = self.directory / CHOICES
        if not path.exists():
            return None
        try:
            return Choices.from_json(json.loads(path.read_text()))
        except Exception as e:  # noqa: BLE001  (any damage: the choices are not trusted)
            logger.warning("tuning log %s: %s is unreadable (%s: %s); compiling with the default schedules "
                           "until `tvmgraph tune` measures again", self.directory, CHOICES, type(e).__name__, e)
            return None

    def applied(self) -> AppliedLog | None:
        """The records a compile uses, or None when the log selects none.

        Every compile of the graph's name reads this, so only the JSON is parsed for all lines;
        TVM parses just the best record of each chosen kernel (a CNN's log holds thousands)."""
        from tvm.s_tir import meta_schedule as ms

        choices = self.read_choices() if self.exists() else None
        if choices is None or not choices.enabled:
            return None
        chosen = {k.workload for k in choices.kernels if k.use_tuned}
        workload_docs, bad_workloads = _json_lines(self.workloads_path)
        record_docs, bad = _json_lines(self.records_path)
        bad += bad_workloads
        candidates: dict[str, list[tuple[float, Any, Any]]] = {}
        for doc in record_docs:
            try:
                index, body = doc
                workload = workload_docs[index]
                shash, seconds = workload[0], mean_seconds(body[1])
            except Exception:  # noqa: BLE001  (any damage: the line is dropped)
                bad += 1
                continue
            if not sound_trace(body):
                bad += 1
                continue
            if shash in chosen and math.isfinite(seconds):
                candidates.setdefault(shash, []).append((seconds, workload, body))
        database, digest, kernels = ms.database.MemoryDatabase(), hashlib.sha256(), 0
        for shash in sorted(candidates):
            for _, workload_doc, body in sorted(candidates[shash], key=lambda c: c[0]):
                try:
                    record = ms.database.TuningRecord.from_json(body, ms.database.Workload.from_json(workload_doc))
                except Exception:  # noqa: BLE001  (JSON that TVM cannot read: try the next best)
                    bad += 1
                    continue
                database.commit_workload(record.workload.mod)
                database.commit_tuning_record(record)
                digest.update(json.dumps([shash, body], sort_keys=True).encode())
                kernels += 1
                break
        if bad:
            logger.warning("tuning log %s: dropped %d unreadable line(s) (truncated or corrupt); the other "
                           "records are used; `tvmgraph tune` rewrites the log without them", self.directory, bad)
        return AppliedLog(self.directory, kernels, digest.hexdigest(), database) if kernels else None

    # ---- writing (the tuner, under `lock()`) ----

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Hold the log's lock: one tuner writes a log at a time. A second one waits here."""
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.directory / ".lock", "a+") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                logger.warning("tuning log %s is being written by another tuner; waiting for it", self.directory)
                fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def repair(self) -> int:
        """Rewrite the database files without their unreadable lines (before MetaSchedule opens
        them: one bad line would make it refuse the whole log). Returns the lines dropped."""
        workloads, records, dropped = self.read()
        if not dropped:
            return 0
        keep = [i for i, w in enumerate(workloads) if w is not None]
        new_index = {old: new for new, old in enumerate(keep)}
        _write_atomic(self.workloads_path, "".join(json.dumps(workloads[i].as_json()) + "\n" for i in keep))
        _write_atomic(self.records_path, "".join(json.dumps([new_index[i], r.as_json()]) + "\n"
                                                 for i, r in records))
        return dropped

    def write_choices(self, choices: Choices) -> None:
        _write_atomic(self.directory / CHOICES, json.dumps(choices.to_json(), indent=1) + "\n")


def _seconds(record: Any) -> float:
    """A record's mean run time; failed builds and runs count as never faster."""
    return mean_seconds(record.run_secs)


def mean_seconds(run_secs: Any) -> float:
    """A candidate's mean run time; inf where it failed (MetaSchedule records 1e10 s)."""
    secs = [float(s) for s in (run_secs or [])]
    mean = sum(secs) / len(secs) if secs else math.inf
    return math.inf if mean >= FAILED_RUN_S else mean


def best_seconds(records: list[Any]) -> float:
    return min((_seconds(r) for r in records), default=float("inf"))


def best_record(records: list[Any]) -> Any | None:
    """The record with the shortest mean time (the one compiles apply); None if all failed."""
    best = min(records, key=_seconds, default=None)
    return best if best is not None and math.isfinite(_seconds(best)) else None


_VARIABLE = re.compile(r"[a-z]\d+")  # a trace's random variables: b0 (block), l4 (loop), v7 (value)


def sound_trace(body: Any) -> bool:
    """Whether a record's trace is shaped as TVM reads it: instructions `[kind, inputs, attrs,
    outputs]` whose inputs name variables earlier outputs made, and decisions `[index,
    decision]` at instructions that sample, a tile as long as its outputs, a category among its
    candidates. TVM checks none of it: a trace cut short, or a decision at index 999, made
    TuningRecord.from_json read out of bounds and kill the process (SIGSEGV, or glibc's abort)
    on every compile of the graph, and the tuner's repair with it."""
    try:
        insts, decisions = body[0]
        defined: set[str] = set()
        for inst in insts:
            kind, inputs, attrs, outputs = inst
            if not (isinstance(kind, str) and isinstance(inputs, list) and isinstance(attrs, list)
                    and isinstance(outputs, list) and all(isinstance(o, str) for o in outputs)):
                return False
            if any(isinstance(i, str) and _VARIABLE.fullmatch(i) and i not in defined for i in inputs):
                return False
            defined.update(outputs)
        seen = set()
        for index, decision in decisions:
            if type(index) is not int or not 0 <= index < len(insts) or index in seen:
                return False
            seen.add(index)
            kind, _, attrs, outputs = insts[index]
            if not kind.startswith("Sample"):
                return False
            if kind == "SamplePerfectTile" and not (
                    isinstance(decision, list) and len(decision) == len(outputs)
                    and all(type(d) is int and d >= 1 for d in decision)):
                return False
            if kind == "SampleCategorical" and not (type(decision) is int and 0 <= decision < len(attrs[0])):
                return False
    except (TypeError, ValueError, IndexError):
        return False
    return True


def _json_lines(path: Path) -> tuple[list[Any], int]:
    """The JSON documents of a file, one per line, and how many lines were not JSON."""
    if not path.exists():
        return [], 0
    docs, bad = [], 0
    try:
        text = path.read_bytes()
    except OSError:  # a directory in its place, unreadable: nothing in it is trusted
        return [], 1
    for line in text.splitlines():
        if line.strip():
            try:
                docs.append(json.loads(line))
            except ValueError:
                bad += 1
    return docs, bad


def _write_atomic(path: Path, text: str) -> None:
    write_atomically(path, text.encode())
