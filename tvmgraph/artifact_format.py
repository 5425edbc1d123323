"""The compiled-artifact format shared by the compiled cache and saved graphs.

Both are a directory holding a shared library, raw data files and one JSON document that
lists every other file with its sha256 and size, and carries the sha256 of its own content:

    <dir>/<document>.json   {"format": N, "files": {name: {"sha256", "bytes"}}, "library": name,
                             ..., "sha256": digest of everything above}
    <dir>/<library>.so      the VM executable exported as a shared library
    <dir>/<data files>      raw bytes (constant tensors, parameters in safetensors)

The cache writes `entry.json` (tvmgraph/compiled_cache.py), `tvmgraph.save` writes
`manifest.json` (tvmgraph/deploy.py); both describe the compiled program with the codecs of
tvmgraph/artifact.py. This module imports neither torch nor TVM: a saved graph is checked
before anything native is loaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

FILE_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")  # no paths, no hidden files


class ArtifactFormatError(ValueError):
    """A file of an artifact is missing, unreadable or does not match its recorded checksum."""


def sha256_file(path: Path) -> str:
    """sha256 of a file, read in blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def document_digest(doc: Mapping[str, Any]) -> str:
    """sha256 of the document without its own "sha256" field, in a canonical JSON form."""
    body = {k: v for k, v in doc.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_file(path: Path, data: bytes) -> None:
    """Write and fsync, so that a rename after it never publishes a half-written file."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_atomically(path: Path, data: bytes) -> None:
    """Replace `path` with `data` in one rename: a reader sees the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        write_file(Path(tmp), data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def files_table(directory: Path, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """The "files" field of a document: each file's sha256 and size."""
    return {name: {"sha256": sha256_file(directory / name), "bytes": (directory / name).stat().st_size}
            for name in names}


def read_document(path: Path) -> dict[str, Any]:
    """The JSON object at `path`; ArtifactFormatError when it is missing or not a JSON object."""
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise ArtifactFormatError(f"{path.name} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactFormatError(f"{path.name} is unreadable ({e})") from None
    if not isinstance(doc, dict):
        raise ArtifactFormatError(f"{path.name} is not a JSON object")
    return doc


def verify_files(directory: Path, doc: Mapping[str, Any], document: str,
                 read: Iterable[str] = ()) -> dict[str, bytes]:
    """Check the document's own digest and every file it lists against its sha256; returns the
    contents of the files named in `read` (the others, the library among them, are hashed
    without being kept). Raises ArtifactFormatError naming the file and the reason."""
    if doc.get("sha256") != document_digest(doc):
        raise ArtifactFormatError(f"{document} does not match its recorded checksum")
    files, library = doc.get("files"), doc.get("library")
    if not isinstance(files, dict) or library not in files:
        raise ArtifactFormatError(f"{document} does not list the library")
    keep, data = set(read), {}
    for name, info in files.items():
        if not FILE_NAME.fullmatch(name) or name == document or not isinstance(info, dict):
            raise ArtifactFormatError(f"{document} lists a file named {name!r}")
        try:
            blob = (directory / name).read_bytes() if name in keep else None
            digest = hashlib.sha256(blob).hexdigest() if blob is not None else sha256_file(directory / name)
        except FileNotFoundError:
            raise ArtifactFormatError(f"{name} is missing") from None
        except OSError as e:
            raise ArtifactFormatError(f"{name} is unreadable ({e})") from None
        if digest != info.get("sha256"):
            raise ArtifactFormatError(f"{name} does not match its recorded checksum")
        if blob is not None:
            data[name] = blob
    return data
