"""A corpus manifest: the one file every later stage trusts, written and read here only, so a wrong one
is refused by name and every reader sees the same typed fields.

Light on purpose (pydantic, json and the store only): the CLI and the pretrain stage's checks read a
manifest before anything heavy is imported. The JSON on disk is the model's dump in field order, the
same bytes the dict-built manifest had, so manifests written before the model read as they are.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tasks.store import Store, split_object_uri

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

    def to_json(self) -> bytes:
        """The bytes written to the store: the same layout as every manifest before this model."""
        return json.dumps(self.model_dump(mode="json", by_alias=True), indent=2).encode() + b"\n"

    def shards(self, split: str) -> list[Shard]:
        """The shards of ``split`` in manifest order (none if the corpus has no such split)."""
        return self.splits[split].shards if split in self.splits else []


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


def load_manifest(uri: str, **store_options: Any) -> tuple[Store, str, Manifest]:
    """The store, key and manifest of ``uri``: a manifest.json, or a corpus folder holding one."""
    if "://" not in uri and Path(uri).is_dir():
        if not (Path(uri) / "manifest.json").is_file():
            raise ManifestError(f"{uri} is a folder without a manifest.json: pass a corpus's manifest.json")
        uri = str(Path(uri) / "manifest.json")
    store, key = split_object_uri(uri, **store_options)
    if not store.exists(key):
        raise NoManifest(f"no corpus manifest at {uri}")
    return store, key, read_manifest(store, key)


def shard_key(manifest_key: str, shard: Shard) -> str:
    """The store key of ``shard`` of the manifest at ``manifest_key``."""
    base = manifest_key.rpartition("/")[0]
    return f"{base}/{shard.path}" if base else shard.path


def check_shards(store: Store, key: str, manifest: Manifest, splits: tuple[str, ...]) -> None:
    """Every shard of ``splits`` is in the store beside the manifest: a manifest copied elsewhere (MLflow
    keeps one as an artifact) names shards that are not there, found before any process starts."""
    base = key.rpartition("/")[0]
    present = set(store.list(base))  # one listing, not a request per shard
    for split in splits:
        for shard in manifest.shards(split):
            if shard_key(key, shard) not in present:
                raise ManifestError(
                    f"{store.url(key)} names {split} shard {shard.path}, which is not in {store.url(base)}: "
                    "pass the manifest in the store its corpus was built into"
                )


def newest_manifest(store: Store) -> str | None:
    """The URI of the corpus published last in the store."""
    newest: tuple[str, str] | None = None
    for key in store.list("corpora"):
        if key.endswith("/manifest.json") and key.count("/") == 2:
            candidate = (read_manifest(store, key).created_at, store.url(key))
            newest = max(newest, candidate) if newest else candidate
    return newest[1] if newest else None
