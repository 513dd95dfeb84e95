"""A corpus manifest: the one file every later stage trusts, written and read here only, so a wrong one
is refused by name and every reader sees the same typed fields.

Light on purpose (pydantic, json and the store only): the CLI and the pretrain stage's checks read a
manifest before anything heavy is imported. The JSON on disk is the model's dump in field order, the
same bytes the dict-built manifest had, so manifests written before the model read as they are.
"""

from __future__ import annotations

import json
import posixpath
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tasks.store import Store, open_store, split_object_uri

# What a manifest has that a user's other JSON files don't.
MANIFEST_KEYS = ("corpus_id", "splits", "sources", "totals")


class ManifestError(ValueError):
    """Not a corpus manifest, or one whose files are not where it says: names the URI."""


class NoManifest(ManifestError):
    """Nothing at the URI."""


class _Part(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Cleaning(_Part):
    """The text cleaning the shards hold (``models/text.py``); later stages apply the same."""

    name: str
    description: str
    front_pad: str
    end_pad: str


class BuildSettings(_Part):
    """The build settings the shards depend on (``CorpusConfig.identity``)."""

    split: tuple[int, int, int]
    shard_mb: int
    bucket_mb: int


class Shard(_Part):
    """One Arrow IPC file of a split: ``path`` is relative to the manifest's folder."""

    path: str
    rows: int
    bytes: int
    text_bytes: int
    sha256: str


class Split(_Part):
    rows: int
    bytes: int
    text_bytes: int
    shards: list[Shard]

    @classmethod
    def of(cls, shards: list[Shard]) -> Split:
        """A split's entry: its shards in order and their sums."""
        return cls(
            rows=sum(s.rows for s in shards),
            bytes=sum(s.bytes for s in shards),
            text_bytes=sum(s.text_bytes for s in shards),
            shards=shards,
        )


class SourceCounts(_Part):
    """One source and where each of its records went: records = kept + duplicates + rejected."""

    uri: str
    name: str
    category: str
    sha256: str
    bytes: int
    records: int
    kept: int
    duplicates: int
    rejected: int


class Totals(_Part):
    records: int
    kept: int
    duplicates: int
    rejected: int


class KeyFile(_Part):
    """One file of the key index (``keyindex.py``): the sorted keys of one bucket's kept rows, all
    splits. ``lo`` and ``hi`` are the lowest and highest ``key_hi`` in it (uint64 as JSON numbers)."""

    path: str
    rows: int
    lo: int
    hi: int
    sha256: str


class Parent(_Part):
    """The corpus a grown corpus grew from."""

    corpus_id: str
    manifest_uri: str


class DeltaSplit(_Part):
    """What a delta added to one split: its rows, their text bytes, and its shards (the split's last)."""

    rows: int
    text_bytes: int
    shards: int


class Delta(_Part):
    """What a grown corpus added to its parent: the new sources' names, per split, and their counts."""

    sources: list[str]
    splits: dict[str, DeltaSplit]
    totals: Totals


# Written only where set: a full build's manifest has no parent or delta.
_OPTIONAL = ("keys", "parent", "delta")


class Manifest(_Part):
    """What a corpus holds: its id, cleaning, settings, splits with their shards, and every source's counts."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    format: str
    corpus_id: str
    uri: str
    created_at: str  # UTC, to the second: 2026-01-31T12:00:00Z
    cleaning: Cleaning
    dedupe: str
    split_rule: str
    config: BuildSettings
    # "schema" on disk; the name is BaseModel's own, so the attribute is spelt otherwise.
    columns: dict[str, str] = Field(alias="schema")
    splits: dict[str, Split]
    sources: list[SourceCounts]
    totals: Totals
    rejected_uri: str
    rejected_files: list[str]
    # The key index, one file per bucket (none in a manifest written before deltas).
    keys: list[KeyFile] | None = None
    # A grown corpus (``corpus build --base``): the corpus it grew from, and what the delta added.
    parent: Parent | None = None
    delta: Delta | None = None

    def to_json(self) -> bytes:
        """The bytes written to the store: the same layout as every manifest before this model."""
        unset = {name for name in _OPTIONAL if getattr(self, name) is None}
        dumped = self.model_dump(mode="json", by_alias=True, exclude=unset)
        return json.dumps(dumped, indent=2).encode() + b"\n"

    def shards(self, split: str) -> list[Shard]:
        """The shards of ``split`` in manifest order (none if the corpus has no such split)."""
        return self.splits[split].shards if split in self.splits else []

    def delta_shards(self, split: str) -> list[Shard]:
        """The shards a delta added to ``split`` (the split's last); all of them if the corpus did not grow."""
        if self.delta is None:
            return self.shards(split)
        added = self.delta.splits[split].shards if split in self.delta.splits else 0
        return self.shards(split)[len(self.shards(split)) - added :]

    def parent_shards(self, split: str) -> list[Shard]:
        """The shards ``split`` has from the parent corpus (its first); none if the corpus did not grow."""
        if self.delta is None:
            return []
        return self.shards(split)[: len(self.shards(split)) - len(self.delta_shards(split))]


def write_manifest(store: Store, key: str, manifest: Manifest) -> str:
    """Publish ``manifest`` at ``key``; its URI."""
    store.write_bytes(key, manifest.to_json())
    return store.url(key)


def read_manifest(store: Store, key: str) -> Manifest:
    """The manifest at ``key``, checked to be one."""
    where = store.url(key)
    try:
        data = json.loads(store.read_bytes(key))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ManifestError(f"{where} is not a corpus manifest: not JSON ({error})") from None
    missing = [k for k in MANIFEST_KEYS if k not in data] if isinstance(data, dict) else MANIFEST_KEYS
    if missing:
        raise ManifestError(f"{where} is not a corpus manifest: it has no {', '.join(missing)}")
    try:
        return Manifest.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        field = ".".join(str(part) for part in first["loc"])
        raise ManifestError(f"{where} is not a corpus manifest: {field}: {first['msg']}") from None


def locate(uri: str, **store_options: Any) -> tuple[Store, str]:
    """The store and key of a manifest's URI, the store rooted where its corpus's is
    (``…/corpora/<id>/manifest.json``), so the paths a grown corpus names into its base resolve; any
    other manifest (a copy elsewhere), its folder's."""
    head, corpora, tail = uri.rpartition("/corpora/")
    if corpora and head and tail.count("/") == 1 and tail.endswith("/manifest.json"):
        return open_store(head, **store_options), f"corpora/{tail}"
    return split_object_uri(uri, **store_options)


def load_manifest(uri: str, **store_options: Any) -> tuple[Store, str, Manifest]:
    """The store, key and manifest of ``uri``: a manifest.json, or a corpus folder holding one."""
    if "://" not in uri and Path(uri).is_dir():
        if not (Path(uri) / "manifest.json").is_file():
            raise ManifestError(f"{uri} is a folder without a manifest.json: pass a corpus's manifest.json")
        uri = str(Path(uri) / "manifest.json")
    store, key = locate(uri, **store_options)
    if not store.exists(key):
        raise NoManifest(f"no corpus manifest at {uri}")
    return store, key, read_manifest(store, key)


def shard_key(manifest_key: str, path: str) -> str:
    """The store key of a file the manifest at ``manifest_key`` names by ``path``, relative to its folder
    (a grown corpus names its base's shards ``../<base id>/…``); a path that leaves the store is refused."""
    base = manifest_key.rpartition("/")[0]
    key = posixpath.normpath(f"{base}/{path}" if base else path)
    if key.startswith(("../", "/")) or key == "..":
        raise ManifestError(f"the manifest at {manifest_key} names {path}, which is outside its store")
    return key


def check_shards(store: Store, key: str, manifest: Manifest, splits: tuple[str, ...]) -> None:
    """Every shard of ``splits`` is in the store beside the manifest: a manifest copied elsewhere (MLflow
    keeps one as an artifact) names shards that are not there, found before any process starts."""
    base = key.rpartition("/")[0]
    present: set[str] = set()
    listed: set[str] = set()
    for split in splits:
        for shard in manifest.shards(split):
            wanted = shard_key(key, shard.path)
            folder = wanted.rsplit("/", 2)[0]  # the corpus folder holding it (a grown corpus's base's)
            if folder not in listed:  # one listing a corpus, not a request per shard
                present.update(store.list(folder))
                listed.add(folder)
            if wanted not in present:
                raise ManifestError(
                    f"{store.url(key)} names {split} shard {shard.path}, which is not in {store.url(base)}: "
                    "pass the manifest in the store its corpus was built into"
                )


def newest_manifest(store: Store) -> str | None:
    """The URI of the corpus published last in the store: the latest ``created_at`` (UTC, to the
    second); of corpora published in the same second, one grown from another is the newer, then the
    greatest URI."""
    found = {
        key: read_manifest(store, key)
        for key in store.list("corpora")
        if key.endswith("/manifest.json") and key.count("/") == 2
    }
    if not found:
        return None
    latest = max(manifest.created_at for manifest in found.values())
    tied = {key: manifest for key, manifest in found.items() if manifest.created_at == latest}
    parents = {manifest.parent.corpus_id for manifest in tied.values() if manifest.parent}
    newest = [key for key, manifest in tied.items() if manifest.corpus_id not in parents] or list(tied)
    return store.url(max(newest))
