"""Reading a corpus manifest: the one file every later stage trusts, so a wrong one is refused by name.

Light on purpose (json and the store only): the CLI and the pretrain stage's checks read a manifest before
anything heavy is imported.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tasks.store import Store, split_object_uri

# What a manifest has that a user's other JSON files don't.
MANIFEST_KEYS = ("corpus_id", "splits", "sources", "totals")


class ManifestError(ValueError):
    """Not a corpus manifest, or one whose files are not where it says: names the URI."""


class NoManifest(ManifestError):
    """Nothing at the URI."""


def read_manifest(store: Store, key: str) -> dict[str, Any]:
    """The manifest at ``key``, checked to be one."""
    where = store.url(key)
    try:
        manifest = json.loads(store.read_bytes(key))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ManifestError(f"{where} is not a corpus manifest: not JSON ({error})") from None
    missing = [k for k in MANIFEST_KEYS if k not in manifest] if isinstance(manifest, dict) else MANIFEST_KEYS
    if missing:
        raise ManifestError(f"{where} is not a corpus manifest: it has no {', '.join(missing)}")
    return manifest


def load_manifest(uri: str, **store_options: Any) -> tuple[Store, str, dict[str, Any]]:
    """The store, key and manifest of ``uri``: a manifest.json, or a corpus folder holding one."""
    if "://" not in uri and Path(uri).is_dir():
        if not (Path(uri) / "manifest.json").is_file():
            raise ManifestError(f"{uri} is a folder without a manifest.json: pass a corpus's manifest.json")
        uri = str(Path(uri) / "manifest.json")
    store, key = split_object_uri(uri, **store_options)
    if not store.exists(key):
        raise NoManifest(f"no corpus manifest at {uri}")
    return store, key, read_manifest(store, key)


def check_shards(store: Store, key: str, manifest: dict[str, Any], splits: tuple[str, ...]) -> None:
    """Every shard of ``splits`` is in the store beside the manifest: a manifest copied elsewhere (MLflow
    keeps one as an artifact) names shards that are not there, found before any process starts."""
    base = key.rpartition("/")[0]
    present = set(store.list(base))  # one listing, not a request per shard
    for split in splits:
        for shard in manifest["splits"].get(split, {}).get("shards", []):
            if (f"{base}/{shard['path']}" if base else shard["path"]) not in present:
                raise ManifestError(
                    f"{store.url(key)} names {split} shard {shard['path']}, which is not in {store.url(base)}: "
                    "pass the manifest in the store its corpus was built into"
                )


def newest_manifest(store: Store) -> str | None:
    """The URI of the corpus published last in the store."""
    newest: tuple[str, str] | None = None
    for key in store.list("corpora"):
        if key.endswith("/manifest.json") and key.count("/") == 2:
            candidate = (read_manifest(store, key)["created_at"], store.url(key))
            newest = max(newest, candidate) if newest else candidate
    return newest[1] if newest else None
