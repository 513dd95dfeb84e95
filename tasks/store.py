"""The object store: one small interface over a local folder and S3-compatible storage.

Writes are atomic from a reader's view. A local write goes to a temporary file beside its target
and is renamed into place; an S3 object becomes visible only when its (managed, multipart for large
files) upload completes. A manifest or ``latest.json`` is written last, so a reader that finds it
finds everything it names.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
import threading
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

if TYPE_CHECKING:
    from tasks.settings import Settings

MiB = 1024 * 1024
OnRead = Callable[[int, int], None]  # (bytes so far, of the object's size)
REPORT_SECONDS = 0.5  # how often a download with ``on_read`` tells its progress


class StoreError(RuntimeError):
    """A store URI that cannot be used, with what to change."""


class Store(ABC):
    """Keys are '/'-separated paths relative to the store's root URI."""

    uri: str

    def url(self, key: str) -> str:
        """The full URI of a key, as users and manifests see it."""
        return f"{self.uri.rstrip('/')}/{key.lstrip('/')}"

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def check_writable(self, *, create_bucket: bool = False, setting: str = "MLSTM_STORE_URI") -> None:
        """Before any work: the store can be written; else one StoreError naming ``setting``, what
        chose it (a command's flag, when the store is its output rather than the pipeline's)."""

    @abstractmethod
    def read_bytes(self, key: str) -> bytes: ...

    @abstractmethod
    def list(self, prefix: str) -> list[str]:
        """All keys under ``prefix`` (recursive), sorted."""

    @abstractmethod
    def delete_prefix(self, prefix: str) -> None: ...

    @abstractmethod
    def create(self, key: str, data: bytes) -> bool:
        """Write ``data`` at ``key`` only if nothing is there, atomically against other writers: whether
        this call wrote it (a lock's claim)."""

    def remove_partial(self, prefix: str) -> tuple[str, ...]:
        """Delete the half-written files a killed writer left under ``prefix``; their keys. An object
        store has none: an upload is published whole or not at all."""
        return ()

    @abstractmethod
    def _publish(self, local: Path, key: str) -> None:
        """Make a finished local file visible at ``key``; the local file is consumed."""

    @abstractmethod
    def download(self, key: str, local: Path, *, on_read: OnRead | None = None) -> None:
        """Copy the object to ``local``. ``on_read``: told the bytes copied so far and the object's size
        as the copy goes (a 40 GB object takes minutes), in the caller's thread."""

    @abstractmethod
    def open_read(self, key: str, *, start: int = 0) -> IO[bytes]:
        """A binary stream of the object's bytes, from byte ``start``."""

    def _scratch_dir(self, key: str) -> Path:
        return Path(tempfile.gettempdir())

    @contextlib.contextmanager
    def writer(self, key: str) -> Iterator[Path]:
        """Yield a local path to write; on success it is published at ``key``, else discarded, with the
        store's folders it leaves empty. A full disk is one StoreError naming ``key``'s URL (the
        OS's own words name no file when a write, not an open, fails)."""
        scratch = self._scratch_dir(key)
        # Not mkstemp: its files are 0600, and a published file gets the mode open() would give.
        path = scratch / f".tmp-{uuid.uuid4().hex}-{Path(key).name}"
        try:
            scratch.mkdir(parents=True, exist_ok=True)
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
            yield path
            self._publish(path, key)
        except BaseException as error:
            path.unlink(missing_ok=True)
            self._prune(scratch)
            if isinstance(error, OSError) and no_space(error):
                # An object store's file is written on this machine first: its disk is the full one.
                local = "" if self.url(key).startswith(str(scratch)) else f" (in {scratch} on this machine)"
                raise StoreError(
                    f"{self.url(key)} cannot be written: no space left on device{local}"
                ) from None
            raise
        finally:
            path.unlink(missing_ok=True)

    def _prune(self, folder: Path) -> None:  # noqa: B027 (an object store has no folders to prune)
        """Remove ``folder`` and its parents in the store while they are empty (a failed write's)."""

    @contextlib.contextmanager
    def local_copy(self, key: str) -> Iterator[Path]:
        """A local file with the object's bytes for the length of the block (no copy when local)."""
        scratch = Path(tempfile.mkdtemp(prefix="mlstm-"))
        try:
            path = scratch / Path(key).name
            self.download(key, path)
            yield path
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def write_bytes(self, key: str, data: bytes) -> None:
        with self.writer(key) as path:
            path.write_bytes(data)

    def put_file(self, local: Path, key: str) -> None:
        """Copy a local file into the store, atomically."""
        with self.writer(key) as path:
            shutil.copyfile(local, path)


def no_space(error: OSError) -> bool:
    """A full disk or quota, in the OS's words or Arrow's (whose IO errors carry no errno)."""
    return error.errno in (errno.ENOSPC, errno.EDQUOT) or "No space left on device" in str(error)


class LocalStore(Store):
    def __init__(self, root: Path) -> None:
        self.root = root.expanduser().resolve()
        self.uri = str(self.root)

    def path(self, key: str) -> Path:
        return self.root / key

    def _scratch_dir(self, key: str) -> Path:
        # Same folder as the target, so publishing is a rename on one filesystem.
        return self.path(key).parent

    def _prune(self, folder: Path) -> None:
        while folder != self.root and folder.is_relative_to(self.root):
            try:
                folder.rmdir()  # fails on a folder that holds anything: another writer's stays
            except OSError:
                return
            folder = folder.parent

    def exists(self, key: str) -> bool:
        return self.path(key).exists()

    @contextlib.contextmanager
    def local_copy(self, key: str) -> Iterator[Path]:
        yield self.path(key)

    def read_bytes(self, key: str) -> bytes:
        return self.path(key).read_bytes()

    def open_read(self, key: str, *, start: int = 0) -> IO[bytes]:
        stream = self.path(key).open("rb")
        stream.seek(start)
        return stream

    def list(self, prefix: str) -> list[str]:
        base = self.path(prefix)
        if base.is_file():
            return [prefix]
        if not base.is_dir():
            return []
        return sorted(
            p.relative_to(self.root).as_posix()
            for p in base.rglob("*")
            if p.is_file() and not p.name.startswith(".tmp-")
        )

    def create(self, key: str, data: bytes) -> bool:
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
        except FileExistsError:
            return False
        with os.fdopen(descriptor, "wb") as file:
            file.write(data)
        return True

    def remove_partial(self, prefix: str) -> tuple[str, ...]:
        """``writer``'s ``.tmp-*`` files under ``prefix``, deleted: only while nothing writes there."""
        base = self.path(prefix)
        partial = sorted(base.rglob(".tmp-*")) if base.is_dir() else []
        for path in partial:
            path.unlink(missing_ok=True)
        return tuple(p.relative_to(self.root).as_posix() for p in partial)

    def delete_prefix(self, prefix: str) -> None:
        target = self.path(prefix)
        if target.is_dir():
            shutil.rmtree(target)
        else:
            target.unlink(missing_ok=True)

    def check_writable(self, *, create_bucket: bool = False, setting: str = "MLSTM_STORE_URI") -> None:
        """Before any work: the folder can be made and written."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.root, prefix=".tmp-write-check-"):
                pass
        except OSError as error:
            label = "store folder" if setting.startswith("MLSTM_") else "folder"
            raise StoreError(f"{label} {self.root} cannot be written: {error} [{setting}]") from None

    def _publish(self, local: Path, key: str) -> None:
        os.replace(local, self.path(key))

    def download(self, key: str, local: Path, *, on_read: OnRead | None = None) -> None:
        shutil.copyfile(self.path(key), local)
        if on_read is not None:
            size = local.stat().st_size
            on_read(size, size)


class S3Store(Store):
    """``s3://bucket/prefix`` through boto3; retries with backoff come from botocore's config."""

    def __init__(self, uri: str, *, endpoint_url: str | None = None, max_attempts: int | None = None) -> None:
        parsed = urlparse(uri)
        if not parsed.netloc:
            raise StoreError(f"S3 URI {uri!r} has no bucket: write s3://BUCKET/PREFIX")
        self.uri = uri.rstrip("/")
        self.bucket = parsed.netloc
        self.prefix = parsed.path.strip("/")
        self.endpoint_url = endpoint_url
        self.max_attempts = max_attempts if max_attempts is not None else _default_max_attempts()
        self._client: Any = None

    def __getstate__(self) -> dict[str, Any]:
        # boto3 clients do not pickle; each process makes its own.
        return {**self.__dict__, "_client": None}

    @property
    def client(self) -> Any:
        if self._client is None:
            import boto3
            from botocore.config import Config

            config = Config(
                # botocore's "max_attempts" counts retries only; the total includes the first try.
                retries={"total_max_attempts": self.max_attempts, "mode": "adaptive"},
                connect_timeout=10,
                read_timeout=120,
            )
            self._client = boto3.session.Session().client("s3", endpoint_url=self.endpoint_url, config=config)
        return self._client

    @property
    def transfer_config(self) -> Any:
        from boto3.s3.transfer import TransferConfig

        return TransferConfig(multipart_threshold=64 * MiB, multipart_chunksize=64 * MiB)

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(key))
        except ClientError as error:
            if error.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise
        return True

    def read_bytes(self, key: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()

    def open_read(self, key: str, *, start: int = 0) -> IO[bytes]:
        # A ranged GET: a piece of a large object is read from its own start, in parallel with others.
        ranged = {"Range": f"bytes={start}-"} if start else {}
        return self.client.get_object(Bucket=self.bucket, Key=self._key(key), **ranged)["Body"]

    def create(self, key: str, data: bytes) -> bool:
        from botocore.exceptions import ClientError

        try:  # S3's conditional write: refused when the key exists, or while another such write runs
            self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, IfNoneMatch="*")
        except ClientError as error:
            if error.response.get("Error", {}).get("Code") in (
                "PreconditionFailed",
                "ConditionalRequestConflict",
            ):
                return False
            raise
        return True

    def list(self, prefix: str) -> list[str]:
        full = self._key(prefix)
        strip = len(self.prefix) + 1 if self.prefix else 0
        keys: list[str] = []
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=full):
            # A prefix names a key or a folder, as on disk: "a" must not match "ab/x".
            keys.extend(
                item["Key"][strip:]
                for item in page.get("Contents", [])
                if not full or full.endswith("/") or item["Key"] == full or item["Key"].startswith(full + "/")
            )
        return sorted(keys)

    def delete_prefix(self, prefix: str) -> None:
        keys = self.list(prefix)
        for start in range(0, len(keys), 1000):
            batch = [{"Key": self._key(k)} for k in keys[start : start + 1000]]
            response = self.client.delete_objects(
                Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True}
            )
            # Failed deletions do not raise: S3 reports them in the body of a 200 response.
            if errors := response.get("Errors"):
                first = errors[0]
                raise StoreError(
                    f"cannot delete {len(errors)} objects under {self.url(prefix)}, "
                    f"e.g. {first.get('Key')}: {first.get('Code')} {first.get('Message')}"
                )

    def check_writable(self, *, create_bucket: bool = False, setting: str = "MLSTM_STORE_URI") -> None:
        """Before any work: the bucket exists (or is created when asked) and a tiny object can be
        written and deleted under the prefix; otherwise one StoreError naming what to change."""
        from botocore.exceptions import BotoCoreError, ClientError

        where = f"bucket {self.bucket!r} at {self.endpoint_url or 'AWS S3 (boto3 default endpoint)'}"
        fix = f"[{setting}, MLSTM_S3_ENDPOINT_URL]"
        try:
            try:
                self.client.head_bucket(Bucket=self.bucket)
            except ClientError as error:
                if error.response.get("Error", {}).get("Code") not in ("404", "NoSuchBucket", "NotFound"):
                    raise
                if not create_bucket:
                    raise StoreError(
                        f"{where} does not exist: create it (corpus build --create-bucket) or fix the store {self.uri} "
                        f"{fix}"
                    ) from None
                self.client.create_bucket(Bucket=self.bucket)
            probe = self._key(f".write-check-{uuid.uuid4().hex}")
            self.client.put_object(Bucket=self.bucket, Key=probe, Body=b"ok")
            self.client.delete_object(Bucket=self.bucket, Key=probe)
        except (ClientError, BotoCoreError) as error:
            raise StoreError(f"{where} cannot be written under {self.uri}: {error} {fix}") from None

    def _publish(self, local: Path, key: str) -> None:
        self.client.upload_file(str(local), self.bucket, self._key(key), Config=self.transfer_config)

    def download(self, key: str, local: Path, *, on_read: OnRead | None = None) -> None:
        def copy(callback: Callable[[int], None] | None = None) -> None:
            self.client.download_file(
                self.bucket, self._key(key), str(local), Config=self.transfer_config, Callback=callback
            )

        if on_read is None:
            copy()
            return
        size = self.client.head_object(Bucket=self.bucket, Key=self._key(key))["ContentLength"]
        done = [0]
        # boto3 tells its Callback from its transfer threads, where a caller's context (a Prefect run's)
        # is not: the count is kept there and told from here.
        lock = threading.Lock()

        def count(amount: int) -> None:
            with lock:
                done[0] += amount

        with ThreadPoolExecutor(1) as pool:
            copying = pool.submit(copy, count)
            while not copying.done():
                with contextlib.suppress(TimeoutError):
                    copying.result(timeout=REPORT_SECONDS)
                on_read(done[0], size)
            copying.result()


def _default_max_attempts() -> int:
    """MLSTM_S3_MAX_ATTEMPTS, so every S3 call honours it, those made where no settings are at hand
    (listing and reading sources, a manifest named by URI) included."""
    from tasks.settings import get_settings

    return get_settings().s3_max_attempts


def store_of(settings: Settings) -> Store:
    """The store the settings name (MLSTM_STORE_URI, else the home's), with their S3 endpoint and retries."""
    return open_store(
        settings.resolved_store_uri,
        endpoint_url=settings.s3_endpoint_url,
        max_attempts=settings.s3_max_attempts,
    )


def check_target(uri: str, setting: str, *, endpoint_url: str | None = None) -> None:
    """A store a command will write, named by its flag ``setting``, checked before any work and without
    making anything: a folder must be one, or makeable in a writable folder; a bucket, writable."""
    store = open_store(uri, endpoint_url=endpoint_url)
    if not isinstance(store, LocalStore):
        store.check_writable(setting=setting)
        return
    existing = store.root
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise StoreError(f"{setting} {store.root}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise StoreError(f"{setting} {store.root}: the folder {existing} cannot be written")


def open_store(uri: str, *, endpoint_url: str | None = None, max_attempts: int | None = None) -> Store:
    """A store for a folder, ``file://`` URI or ``s3://`` URI."""
    scheme = urlparse(uri).scheme
    if scheme == "s3":
        return S3Store(uri, endpoint_url=endpoint_url, max_attempts=max_attempts)
    if scheme == "file":
        parsed = urlparse(uri)
        if parsed.netloc not in ("", "localhost"):
            raise StoreError(f"file URI {uri!r} names a host: write file:///ABSOLUTE/PATH")
        return LocalStore(Path(unquote(parsed.path)))
    if scheme in ("", "local") or (len(scheme) == 1 and os.name == "nt"):
        return LocalStore(Path(uri))
    raise StoreError(f"unsupported store URI {uri!r}: use a folder, file://PATH or s3://BUCKET/PREFIX")


def split_object_uri(uri: str, **kwargs: Any) -> tuple[Store, str]:
    """Split the URI of one object (a manifest, say) into its folder's store and the object's key."""
    head, slash, name = uri.rstrip("/").rpartition("/")
    if not slash and "://" not in uri:
        head = "."  # a file in the working folder
    if not name or not head or head.endswith(":/"):
        raise StoreError(f"{uri!r} does not name an object inside a store")
    return open_store(head, **kwargs), name
