"""This process's local copies of s3:// inputs. Parquet and Arrow are read by random access and a gzip
window through its seek-point index, both from a local file: an s3:// file whose content is known is
copied once a process, not once for each window it reads, and the oldest copy goes when more than
``COPIES_KEPT`` are held."""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

from tasks.corpus.sources import Source
from tasks.score.readers.base import Progress
from tasks.score.readers.folders import COPIES, process_folder, remove_folder
from tasks.score.readers.gzip_index import drop_index
from tasks.store import LocalStore, Store, split_object_uri

COPIES_KEPT = 2  # s3:// inputs a process keeps a copy of: the one it reads, and the one before
_copies: OrderedDict[tuple[str, str], Path] = OrderedDict()  # (URI, sha256) → the local copy
_copies_lock = threading.Lock()  # a Dask worker may run pieces on several threads


@contextlib.contextmanager
def local(uri: str, s3_endpoint_url: str | None, sha256: str = "") -> Iterator[str]:
    """A local path of the file. An s3:// file whose content is known (``sha256``) is copied once for
    this process (``kept_copy``); otherwise for the block."""
    store, key = split_object_uri(uri, endpoint_url=s3_endpoint_url)
    if sha256 and not isinstance(store, LocalStore):
        yield str(kept_copy(store, key, uri, sha256))
        return
    with store.local_copy(key) as path:
        yield str(path)


def kept_copy(store: Store, key: str, uri: str, sha256: str) -> Path:
    """The process's local copy of an s3:// file, by its URI and content: downloaded on the first read,
    the oldest of more than ``COPIES_KEPT`` deleted, the folder removed when the process exits."""
    with _copies_lock:
        if (path := _copies.get((uri, sha256))) is not None:
            _copies.move_to_end((uri, sha256))
            return path
        path = process_folder(COPIES) / f"{sha256[:16]}-{Path(key).name}"
        store.download(key, path)
        _keep(uri, sha256, path)
        return path


def holds_copy(uri: str, sha256: str) -> bool:
    """Whether this process holds a copy of the file's content."""
    with _copies_lock:
        return (uri, sha256) in _copies


def _keep(uri: str, sha256: str, path: Path) -> None:
    """Hold ``path`` as the copy of ``(uri, sha256)``; the oldest of more than ``COPIES_KEPT`` go.
    Under ``_copies_lock``."""
    _copies[(uri, sha256)] = path
    while len(_copies) > COPIES_KEPT:
        _, oldest = _copies.popitem(last=False)
        drop_index(oldest)
        oldest.unlink(missing_ok=True)


def hashed_copy(
    store: Store, key: str, uri: str, hashed: Callable[[str, int], Source], *, on_download: Progress
) -> Source:
    """Download an s3:// file whose content is not known yet, hash the copy (``hashed``: its path and
    size to its ``Source``) and keep it as the process's copy of that content (``kept_copy``): the
    object crosses the network once for the hash, the line scan and the parse, not as a stream to hash
    and then a copy to read. ``on_download``: told the download's progress, a pass of its own."""
    folder = process_folder(COPIES)
    handle, name = tempfile.mkstemp(dir=folder, prefix="describing-", suffix=f"-{Path(key).name}")
    os.close(handle)
    partial = Path(name)
    try:
        store.download(key, partial, on_read=on_download.at)
        on_download.end_pass()
        source = hashed(str(partial), partial.stat().st_size)
        path = partial.rename(folder / f"{source.sha256[:16]}-{Path(key).name}")
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    with _copies_lock:
        _keep(uri, source.sha256, path)
    return replace(source, uri=uri, name=Path(key).name)


def drop_copy(uri: str, sha256: str) -> None:
    """Delete the process's copy of the file's content (and close its gzip index), if it holds one."""
    with _copies_lock:
        if (path := _copies.pop((uri, sha256), None)) is not None:
            drop_index(path)
            path.unlink(missing_ok=True)


def drop_copies() -> None:
    """Delete the process's copies of s3:// inputs and their folder (and close its gzip indexes)."""
    drop_index()
    with _copies_lock:
        _copies.clear()
        remove_folder(COPIES)
