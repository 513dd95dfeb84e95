"""This process's temporary folders (of s3:// copies, of exported gzip indexes), removed when it exits."""

from __future__ import annotations

import shutil
import tempfile
import threading
from pathlib import Path

COPIES, INDEXES = "mlstm-score-inputs-", "mlstm-score-gzip-index-"  # the folders' prefixes
_folders: dict[str, Path] = {}
_folders_lock = threading.Lock()


def process_folder(prefix: str) -> Path:
    """This process's temporary folder ``prefix…``, made on the first call, removed when the process
    exits (a pool worker too: ``multiprocessing``'s finalizers run there, atexit's do not)."""
    with _folders_lock:
        if prefix not in _folders:
            import multiprocessing.util

            folder = _folders[prefix] = Path(tempfile.mkdtemp(prefix=prefix))
            multiprocessing.util.Finalize(
                None, shutil.rmtree, args=(folder,), kwargs={"ignore_errors": True}, exitpriority=0
            )
        return _folders[prefix]


def remove_folder(prefix: str) -> None:
    """Remove this process's folder ``prefix…`` now, with what it holds."""
    with _folders_lock:
        if (folder := _folders.pop(prefix, None)) is not None:
            shutil.rmtree(folder, ignore_errors=True)
