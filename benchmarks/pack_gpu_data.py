#!/usr/bin/env python
"""Pack the text ``make gpu-learn`` reads into one small folder that travels to a lent GPU machine.

    PYTHONPATH=. .venv/bin/python benchmarks/pack_gpu_data.py            # /work/shared/data → .gpu-data/

A lent machine reaches nothing outside itself and takes at most 64 MiB of working tree, so the shared
data (``MLSTM_SHARED_DIR``, else ``/work/shared/data``; its README says what each file is) goes as an
xz-compressed bundle in the ignored folder ``.gpu-data/``, named in the device call's ``carry``:

- ``train.u8.xz`` and ``val.u8.xz``: pretraining text as one byte stream each, every review cleaned
  as the corpus cleans it (``models.text.encode``), in a seeded shuffled order: the Amazon review
  files (every ``*.json.gz`` / ``*.jsonl.gz`` under ``amazon/``, its partial slices too) and IMDB's
  50,000 unlabelled reviews, without exact duplicates and without any review whose text is also a
  labelled IMDB review. One review in ``--val-every`` goes to validation, by a hash of its text;
- ``probes.json.xz``: the labelled texts of the probes: SST (its train, dev and test files, whole)
  and a seeded, label-balanced slice of IMDB (``--imdb-train`` reviews of its train split, a tenth
  of them the dev split as the transfer stage takes it, and ``--imdb-test`` of its test split);
- ``manifest.json``: what went in, the counts and the sha256 of each file.

Uses the standard library and ``models.text`` only; ``benchmarks/gpu_learn.py`` reads it back.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import hashlib
import json
import lzma
import os
import random
import sys
from collections.abc import Iterator
from pathlib import Path

from common import REPO, new_parser, say  # the working tree on the path

from models.text import encode

DEFAULT_SHARED = Path("/work/shared/data")
BUNDLE = REPO / ".gpu-data"
CARRY_LIMIT_BYTES = 48 * 2**20  # of the device tool's 64 MiB: the tree and the wheels need the rest
XZ_PRESET = 6
csv.field_size_limit(sys.maxsize)  # IMDB reviews run to 14k characters


def amazon_texts(folder: Path) -> Iterator[str]:
    """The review text of every record of every Amazon file (2014/2018: reviewText; 2023: text)."""
    for path in sorted(folder.rglob("*.json*.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as lines:
            for line in lines:
                record = json.loads(line)
                text = record.get("reviewText") or record.get("text")
                if isinstance(text, str) and text.strip():
                    yield text


def csv_rows(path: Path) -> list[dict[str, str]]:
    with gzip.open(path, "rt", encoding="utf-8", newline="") as stream:
        return list(csv.DictReader(stream))


def plain_csv_rows(path: Path) -> list[dict[str, str]]:
    with path.open(encoding="utf-8", newline="") as stream:
        return list(csv.DictReader(stream))


def balanced(rows: list[dict[str, str]], count: int, rng: random.Random) -> list[dict[str, str]]:
    """``count`` rows, half of each label (as near as ``count`` allows), in a seeded order."""
    by_label = {label: [r for r in rows if r["label"] == label] for label in ("0", "1")}
    chosen = [r for label, group in by_label.items() for r in rng.sample(group, (count + int(label)) // 2)]
    rng.shuffle(chosen)
    return chosen


def split(rows: list[dict[str, str]], text: str = "text") -> dict[str, list[object]]:
    return {"text": [r[text] for r in rows], "label": [int(r["label"]) for r in rows]}


def write_xz(path: Path, data: bytes) -> None:
    path.write_bytes(lzma.compress(data, preset=XZ_PRESET))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def pack(shared: Path, out: Path, args: argparse.Namespace) -> dict[str, object]:
    rng = random.Random(args.seed)
    imdb_train = csv_rows(shared / "imdb" / "train.csv.gz")
    imdb_test = csv_rows(shared / "imdb" / "test.csv.gz")
    labelled = {r["text"] for r in imdb_train} | {r["text"] for r in imdb_test}

    seen: set[bytes] = set()
    reviews: list[bytes] = []
    counts = {"amazon": 0, "imdb_unlabelled": 0, "duplicates": 0, "labelled_imdb_dropped": 0}
    sources = [("amazon", amazon_texts(shared / "amazon"))]
    sources.append(("imdb_unlabelled", (r["text"] for r in csv_rows(shared / "imdb" / "unsup.csv.gz"))))
    for name, texts in sources:
        for text in texts:
            if text in labelled:
                counts["labelled_imdb_dropped"] += 1
                continue
            key = hashlib.blake2b(text.encode(), digest_size=16).digest()
            if key in seen:
                counts["duplicates"] += 1
                continue
            seen.add(key)
            reviews.append(encode(text))
            counts[name] += 1
            if args.max_reviews and len(reviews) >= args.max_reviews:
                break
    rng.shuffle(reviews)
    # A review's split is a hash of its bytes: the same review goes to the same side in any bundle.
    val = [
        r for r in reviews if int.from_bytes(hashlib.blake2b(r, digest_size=8).digest()) % args.val_every == 0
    ]
    train = [
        r for r in reviews if int.from_bytes(hashlib.blake2b(r, digest_size=8).digest()) % args.val_every
    ]

    train_imdb = balanced(imdb_train, args.imdb_train, rng)
    dev_size = max(len(train_imdb) // 10, 2)
    sst = shared / "sst2"
    probes = {
        "sst": {
            "train": split(plain_csv_rows(sst / "train_binary_sent.csv"), "sentence"),
            "dev": split(plain_csv_rows(sst / "dev_binary_sent.csv"), "sentence"),
            "test": split(plain_csv_rows(sst / "test_binary_sent.csv"), "sentence"),
        },
        "imdb": {
            "train": split(train_imdb[dev_size:]),
            "dev": split(train_imdb[:dev_size]),
            "test": split(balanced(imdb_test, args.imdb_test, rng)),
        },
    }
    out.mkdir(parents=True, exist_ok=True)
    say(f"compressing {sum(map(len, train)) / 1e6:.1f} MB of training text (xz -{XZ_PRESET}) …")
    write_xz(out / "train.u8.xz", b"".join(train))
    write_xz(out / "val.u8.xz", b"".join(val))
    write_xz(out / "probes.json.xz", json.dumps(probes).encode())
    files = ["train.u8.xz", "val.u8.xz", "probes.json.xz"]
    manifest = {
        "shared": str(shared),
        "seed": args.seed,
        "reviews": counts,
        "train_bytes": sum(map(len, train)),
        "val_bytes": sum(map(len, val)),
        "train_reviews": len(train),
        "val_reviews": len(val),
        "probes": {name: {s: len(d["label"]) for s, d in sets.items()} for name, sets in probes.items()},
        "files": {
            name: {"bytes": (out / name).stat().st_size, "sha256": sha256(out / name)} for name in files
        },
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = new_parser(__doc__ or "", raw=True)
    shared = Path(os.environ.get("MLSTM_SHARED_DIR", DEFAULT_SHARED))
    parser.add_argument("--shared", type=Path, default=shared, help="The shared data folder (its README).")
    parser.add_argument("--out", type=Path, default=BUNDLE, help="The bundle's folder (ignored by git).")
    parser.add_argument("--imdb-train", type=int, default=2000, help="IMDB train reviews (a tenth: dev).")
    parser.add_argument("--imdb-test", type=int, default=2000, help="IMDB test reviews for the probe.")
    parser.add_argument("--val-every", type=int, default=100, help="One review in this many: validation.")
    parser.add_argument("--max-reviews", type=int, default=0, help="At most this many reviews (0: all).")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("imdb/train.csv.gz", "imdb/test.csv.gz", "imdb/unsup.csv.gz", "sst2", "amazon"):
        if not (args.shared / name).exists():
            parser.error(f"--shared {args.shared}: no {name} there (MLSTM_SHARED_DIR names the shared data)")
    if args.imdb_train < 20 or args.imdb_test < 2 or args.val_every < 2:
        parser.error("--imdb-train must be at least 20, --imdb-test at least 2, --val-every at least 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    manifest = pack(args.shared, args.out, args)
    files = manifest["files"]
    assert isinstance(files, dict)
    total = sum(f["bytes"] for f in files.values())
    for name, f in files.items():
        say(f"  {args.out / name}: {f['bytes'] / 2**20:.1f} MiB")
    say(
        f"{manifest['train_reviews']:,} training reviews ({manifest['train_bytes'] / 1e6:.1f} MB), "
        f"{manifest['val_reviews']:,} validation; {total / 2**20:.1f} MiB to carry"
    )
    if total > CARRY_LIMIT_BYTES:
        print(
            f"pack_gpu_data: {total / 2**20:.1f} MiB is over the {CARRY_LIMIT_BYTES / 2**20:.0f} MiB the bundle "
            "may take of the device tool's 64 MiB: pack fewer reviews (--max-reviews)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
