"""Labelled sentiment datasets for the transfer stage: train, dev and test splits of raw text and 0/1 labels.

A dataset is given as ``NAME=PATH`` or ``PATH``; the layout is recognised from PATH:

- ``sst2-csv``: a folder with ``{train,dev,test}_binary_sent.csv`` (Radford et al.) or NVIDIA's
  ``{train,val,test}.csv``, header ``label,sentence``.
- ``imdb-folder``: the unpacked ``aclImdb/`` (or its parent), reviews in ``{train,test}/{pos,neg}/<id>_<rating>.txt``;
  ``train/unsup`` and the vocabulary, feature and URL files are ignored.
- ``imdb-tarball``: ``aclImdb_v1.tar.gz``, streamed, never unpacked to disk.
- ``imdb-csv``: a folder with ``train.csv[.gz]`` and ``test.csv[.gz]``, header ``id,rating,label,text``.
- ``table``: a folder with ``train.*``, optional ``dev.*`` or ``val.*``, and ``test.*``, or a single file; each a
  CSV or JSON-lines file (``.csv``, ``.jsonl``, ``.json``, optionally ``.gz``) with a text and a label column.

Texts are kept exactly as stored (the featurizer cleans them). Labels are 0 = negative, 1 = positive; a label
column may hold 0/1, pos/neg, positive/negative or true/false (any case). Star ratings are refused on purpose:
which stars count as positive is the user's decision, not this reader's.

Splits the data does not provide are derived by fixed rules, so every run sees the same rows:

- IMDB has no dev split. Dev is the train reviews whose id satisfies ``id % 10 == 9``: 1,250 pos + 1,250 neg
  of 25,000 (ids are 0-12499 per polarity), leaving 22,500 to train. Rows of every IMDB form are ordered by
  (label, id), negatives first, so the folder, the tarball and the CSV export give identical datasets.
- A table folder without a dev file: dev is the train rows whose text falls in bucket 0 of 10.
- A single table file: bucket 0 → dev, bucket 1 → test, buckets 2-9 → train (80/10/10).

A text's bucket is ``int.from_bytes(sha256(text.encode("utf-8")).digest()[:8], "big") % 10``: it depends on the
text alone, so identical texts always land in the same split.

``Dataset.checksum`` is the SHA-256 of the content only (not the name, path or layout): for each split in the
order train, dev, test and each row in order, ``f"{split}\\t{label}\\t{len(text_utf8)}\\n"`` then the UTF-8 text.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import itertools
import json
import os
import re
import tarfile
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import IO, Any

import numpy as np

SPLITS = ("train", "dev", "test")

SST_FILES = {"train": "train_binary_sent.csv", "dev": "dev_binary_sent.csv", "test": "test_binary_sent.csv"}
SST_NVIDIA_FILES = {"train": "train.csv", "dev": "val.csv", "test": "test.csv"}
SST_HEADER = ["label", "sentence"]
IMDB_HEADER = ["id", "rating", "label", "text"]
IMDB_DEV_RULE = "imdb: train reviews with id % 10 == 9 (10%, balanced: 1,250 pos + 1,250 neg)"
TABLE_DEV_RULE = "train rows whose text is in bucket 0 of 10 (sha256 of the text; 10%)"
SINGLE_FILE_RULE = (
    "one file split by the text's sha256 bucket of 10: 0 → dev, 1 → test, 2-9 → train (80/10/10)"
)

# Longest first, so "x.csv.gz" is not taken for a ".gz" file of unknown format.
TABLE_SUFFIXES = {
    ".csv.gz": "csv",
    ".jsonl.gz": "jsonl",
    ".json.gz": "jsonl",
    ".csv": "csv",
    ".jsonl": "jsonl",
    ".json": "jsonl",
}
TARBALL_SUFFIXES = (".tar.gz", ".tgz")

LAYOUTS = """\
  - SST-2 folder: train_binary_sent.csv, dev_binary_sent.csv, test_binary_sent.csv
    (or train.csv, val.csv, test.csv), header label,sentence
  - IMDB folder: aclImdb/ (or its parent) with train/{pos,neg}/<id>_<rating>.txt and test/{pos,neg}/...
  - IMDB tarball: aclImdb_v1.tar.gz (a .tar.gz or .tgz file)
  - IMDB CSV export: a folder with train.csv[.gz] and test.csv[.gz], header id,rating,label,text
  - table: a folder with train.*, optional dev.* or val.*, and test.*, or one such file
    (.csv, .jsonl or .json, optionally .gz) with a text and a label column"""

LABELS = {"0": 0, "1": 1, "neg": 0, "pos": 1, "negative": 0, "positive": 1, "false": 0, "true": 1}
LABELS_ACCEPTED = "0/1, neg/pos, negative/positive or false/true"

# A review file inside the aclImdb tree or tarball: (split, polarity, id, rating).
_IMDB_MEMBER = re.compile(r"^(?:\./)?(?:[^/]+/)?(train|test)/(pos|neg)/(\d+)_(\d+)\.txt$")
_IMDB_FILE = re.compile(r"^(\d+)_(\d+)\.txt$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class DatasetError(ValueError):
    """A dataset that cannot be read; the message names the file (and line) and says what to fix."""


@dataclass(frozen=True, eq=False)  # eq=False: comparing label arrays elementwise has no truth value
class Split:
    """One split: raw texts (not cleaned) and their labels, 0 = negative, 1 = positive."""

    texts: list[str]
    labels: np.ndarray

    def __post_init__(self) -> None:
        labels = np.asarray(self.labels, dtype=np.int64)
        if labels.shape != (len(self.texts),):
            raise ValueError(f"Split: {len(self.texts)} texts but labels of shape {labels.shape}")
        if labels.size and not np.isin(labels, (0, 1)).all():
            raise ValueError("Split: labels must be 0 (negative) or 1 (positive)")
        object.__setattr__(self, "labels", labels)

    def __len__(self) -> int:
        return len(self.texts)


@dataclass(frozen=True, eq=False)  # compare datasets by checksum
class Dataset:
    """A labelled dataset with three splits, and where and how it was read."""

    name: str
    source: str
    kind: str
    train: Split
    dev: Split
    test: Split
    dev_from_train: str | None

    @cached_property
    def checksum(self) -> str:
        """SHA-256 of the content (split, label, text of every row, in order); see the module docstring."""
        digest = hashlib.sha256()
        for split_name, split in self.splits().items():
            for text, label in zip(split.texts, split.labels.tolist(), strict=True):
                data = text.encode("utf-8")
                digest.update(f"{split_name}\t{label}\t{len(data)}\n".encode())
                digest.update(data)
        return digest.hexdigest()

    def splits(self) -> dict[str, Split]:
        return dict(zip(SPLITS, (self.train, self.dev, self.test), strict=True))


def load_dataset(spec: str, *, text_column: str | None = None, label_column: str | None = None) -> Dataset:
    """Read the dataset named by ``NAME=PATH`` or ``PATH``; the layout is recognised from PATH.

    ``text_column`` and ``label_column`` name the columns of table data (defaults ``text`` and ``label``).
    The SST and IMDB layouts have fixed columns; naming other ones there is an error, not silently ignored.
    The name defaults to ``sst2`` or ``imdb`` for those layouts, else to the file's stem or the folder's name.
    """
    name, source, kind, root = _locate(spec)
    path = Path(source).expanduser()
    if kind == "sst2-csv":
        _check_fixed_columns(path, kind, text_column, label_column, ("sentence", "label"))
        names = SST_FILES if (root / SST_FILES["train"]).exists() else SST_NVIDIA_FILES
        splits = {split: _read_split(root / file, "sentence", "label") for split, file in names.items()}
        dev_rule = None
    elif kind == "table":
        splits, dev_rule = _read_table_dataset(root, text_column or "text", label_column or "label")
    else:
        _check_fixed_columns(path, kind, text_column, label_column, ("text", "label"))
        read = {"imdb-folder": _imdb_folder, "imdb-tarball": _imdb_tarball, "imdb-csv": _imdb_csv}[kind]
        splits, dev_rule = _imdb_splits(read(root), path), IMDB_DEV_RULE
    for split_name, split in splits.items():
        _check_both_classes(source, split_name, split)
    return Dataset(name=name, source=source, kind=kind, dev_from_train=dev_rule, **splits)


def dataset_name(spec: str) -> str:
    """The name ``load_dataset(spec)`` reports, found without reading a row."""
    return _locate(spec)[0]


def declared_name(spec: str) -> str:
    """The NAME of ``NAME=PATH`` without looking at the path (it may live on another machine, a
    worker's); a bare path is named as ``dataset_name`` names it."""
    return _parse_spec(spec)[0] or dataset_name(spec)


def _locate(spec: str) -> tuple[str, str, str, Path]:
    """(name, source, kind, root) of a spec: NAME, else ``sst2``/``imdb`` or the file's stem or folder's name."""
    name, source = _parse_spec(spec)
    path = Path(source).expanduser()
    if not path.exists():
        raise DatasetError(f"{source}: no such file or folder; give the dataset as PATH or NAME=PATH")
    kind, root = _detect(path)
    if name is None and kind == "table":
        name = (_table_stem(root.name) or root.name) if root.is_file() else root.resolve().name
    return name or ("sst2" if kind == "sst2-csv" else "imdb"), source, kind, root


def read_table(
    path: Path, *, text_column: str = "text", label_column: str | None = None
) -> tuple[list[str], np.ndarray | None]:
    """Texts (and labels, when ``label_column`` is given) of one CSV or JSON-lines file, in file order.

    The format follows the suffix: ``.csv``, ``.jsonl`` or ``.json`` (one object per line), optionally ``.gz``.
    """
    path = Path(path)
    columns = [text_column] if label_column is None else [text_column, label_column]
    texts: list[str] = []
    labels: list[int] = []
    for line, values in _rows(path, columns):
        texts.append(_text(values[0], path, line, text_column))
        if label_column is not None:
            labels.append(_label(values[1], path, line, label_column))
    return texts, None if label_column is None else np.asarray(labels, dtype=np.int64)


# --- recognising the layout -----------------------------------------------------------------------------


def _parse_spec(spec: str) -> tuple[str | None, str]:
    """``NAME=PATH`` → (NAME, PATH); a spec that exists as a path is a path even if it holds ``=``."""
    name, sep, source = spec.partition("=")
    if not sep or os.path.exists(spec) or not _NAME.match(name):
        return None, spec
    if not source:
        raise DatasetError(f"{spec}: no path after {name}=; give the dataset as NAME=PATH")
    return name, source


def _detect(path: Path) -> tuple[str, Path]:
    """The layout's kind and the path its reader starts from."""
    if path.is_file():
        if path.name.endswith(TARBALL_SUFFIXES):
            return "imdb-tarball", path
        if _table_stem(path.name) is not None:
            return "table", path
        raise _unknown_layout(path)
    if all((path / file).is_file() for file in SST_FILES.values()):
        return "sst2-csv", path
    for root in (path, path / "aclImdb"):
        if (root / "train" / "pos").is_dir() and (root / "train" / "neg").is_dir():
            return "imdb-folder", root
    tables = _table_files(path)
    if {"train", "test"} <= tables.keys() and all(
        _csv_header(tables[s]) == IMDB_HEADER for s in ("train", "test")
    ):
        return "imdb-csv", path
    nvidia = [path / file for file in SST_NVIDIA_FILES.values()]
    if all(f.is_file() for f in nvidia) and all(_csv_header(f) == SST_HEADER for f in nvidia):
        return "sst2-csv", path
    if "train" in tables:
        return "table", path
    raise _unknown_layout(path)


def _unknown_layout(path: Path) -> DatasetError:
    return DatasetError(f"{path}: not a dataset layout this reads. Give one of:\n{LAYOUTS}")


def _check_fixed_columns(
    path: Path, kind: str, text_column: str | None, label_column: str | None, fixed: tuple[str, str]
) -> None:
    for given, own, option in zip(
        (text_column, label_column), fixed, ("text_column", "label_column"), strict=True
    ):
        if given is not None and given != own:
            raise DatasetError(
                f"{path}: the {kind} layout has fixed columns (text {fixed[0]!r}, label {fixed[1]!r}); "
                f"{option}={given!r} applies only to table data, so leave it out"
            )


def _check_both_classes(source: str, split_name: str, split: Split) -> None:
    num_pos = int(split.labels.sum())
    if num_pos == 0 or num_pos == len(split):
        only = "no rows" if not len(split) else f"only {'positive' if num_pos else 'negative'} labels"
        raise DatasetError(
            f"{source}: the {split_name} split has {only} ({len(split)} rows); "
            "a classifier (probe, fine-tuned or baseline) needs both classes in every split"
        )


# --- tables: CSV and JSON lines -------------------------------------------------------------------------


def _table_stem(name: str) -> str | None:
    """``train.csv.gz`` → ``train``; None when the suffix is not a table format."""
    for suffix in TABLE_SUFFIXES:
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)]
    return None


def _table_format(path: Path) -> str:
    for suffix, fmt in TABLE_SUFFIXES.items():
        if path.name.endswith(suffix):
            return fmt
    raise DatasetError(f"{path}: unknown table format; use .csv, .jsonl or .json, optionally .gz")


def _table_files(folder: Path) -> dict[str, Path]:
    """The folder's ``train``, ``dev`` (or ``val``) and ``test`` files, by split."""
    found: dict[str, list[Path]] = {}
    for entry in sorted(folder.iterdir()):
        stem = _table_stem(entry.name) if entry.is_file() else None
        if stem in ("train", "dev", "val", "test"):
            found.setdefault("dev" if stem == "val" else stem, []).append(entry)
    for split, files in found.items():
        if len(files) > 1:
            names = ", ".join(f.name for f in files)
            raise DatasetError(f"{folder}: more than one {split} file ({names}); keep exactly one")
    return {split: files[0] for split, files in found.items()}


def _read_table_dataset(
    path: Path, text_column: str, label_column: str
) -> tuple[dict[str, Split], str | None]:
    if path.is_file():
        rows = _read_split(path, text_column, label_column)
        buckets = np.array([_text_bucket(t) for t in rows.texts], dtype=np.int64)
        parts = {"train": buckets >= 2, "dev": buckets == 0, "test": buckets == 1}
        return {split: _subset(rows, mask) for split, mask in parts.items()}, SINGLE_FILE_RULE
    files = _table_files(path)
    if "test" not in files:
        raise DatasetError(
            f"{path}: a table folder needs a test file (test.csv, test.jsonl, ...) beside {files['train'].name}; "
            "or give the single file as PATH to split it 80/10/10"
        )
    splits = {split: _read_split(file, text_column, label_column) for split, file in files.items()}
    if "dev" in splits:
        return splits, None
    train = splits["train"]
    in_dev = np.array([_text_bucket(t) == 0 for t in train.texts], dtype=bool)
    splits["dev"], splits["train"] = _subset(train, in_dev), _subset(train, ~in_dev)
    return splits, TABLE_DEV_RULE


def _read_split(path: Path, text_column: str, label_column: str) -> Split:
    texts, labels = read_table(path, text_column=text_column, label_column=label_column)
    assert labels is not None  # a label column was named
    return Split(texts, labels)


def _text_bucket(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big") % 10


def _subset(split: Split, mask: np.ndarray) -> Split:
    return Split([t for t, keep in zip(split.texts, mask.tolist(), strict=True) if keep], split.labels[mask])


def _open_text(path: Path) -> IO[str]:
    """The file as text: ``newline=""`` keeps quoted newlines for the csv module, utf-8-sig drops a BOM."""
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        return opener(path, "rt", encoding="utf-8-sig", newline="")
    except OSError as error:
        raise DatasetError(f"{path}: cannot open ({error})") from error


def _rows(path: Path, columns: list[str]) -> Iterator[tuple[int, list[Any]]]:
    """(1-based line where the row starts, the values of ``columns``) for every row, in file order."""
    reader = _csv_rows if _table_format(path) == "csv" else _jsonl_rows
    # Text is decoded in chunks ahead of the rows, so these errors carry no trustworthy line number.
    try:
        yield from reader(path, columns)
    except UnicodeDecodeError as error:
        raise DatasetError(f"{path}: not UTF-8 ({error}); re-encode the file as UTF-8") from error
    except (OSError, EOFError, zlib.error) as error:
        raise DatasetError(f"{path}: cannot read ({error}); is it truncated or corrupt?") from error


def _csv_rows(path: Path, columns: list[str]) -> Iterator[tuple[int, list[str]]]:
    with _open_text(path) as stream:
        reader = csv.reader(stream)
        try:
            header = next(reader, None)
            if header is None:
                raise DatasetError(f"{path}: empty file; a CSV table needs a header row naming its columns")
            missing = [c for c in columns if c not in header]
            if missing:
                raise DatasetError(
                    f"{path}: no column {', '.join(map(repr, missing))} (columns: {', '.join(header)}); "
                    "name the right ones with --text-column / --label-column"
                )
            indices = [header.index(c) for c in columns]
            end = reader.line_num
            for row in reader:
                # A quoted field may span lines: the row starts on the line after the previous row ended.
                start, end = end + 1, reader.line_num
                if not row:
                    continue
                if len(row) != len(header):
                    raise DatasetError(
                        f"{path}: line {start}: {len(row)} fields but the header has {len(header)}; "
                        "quote fields that hold commas, quotes or newlines"
                    )
                yield start, [row[i] for i in indices]
        except csv.Error as error:
            raise DatasetError(f"{path}: line {reader.line_num}: bad CSV ({error})") from error


def _jsonl_rows(path: Path, columns: list[str]) -> Iterator[tuple[int, list[Any]]]:
    with _open_text(path) as stream:
        for line, raw in enumerate(stream, start=1):
            if not raw.strip():
                continue
            hint = "; write one JSON object per line, not an array" if raw.lstrip().startswith("[") else ""
            try:
                record = json.loads(raw)
            except json.JSONDecodeError as error:
                raise DatasetError(f"{path}: line {line}: bad JSON ({error}){hint}") from error
            if not isinstance(record, dict):
                raise DatasetError(
                    f"{path}: line {line}: a JSON {type(record).__name__}, not an object{hint}"
                )
            missing = [c for c in columns if c not in record]
            if missing:
                raise DatasetError(
                    f"{path}: line {line}: no field {', '.join(map(repr, missing))} "
                    f"(fields: {', '.join(record)}); name the right ones with --text-column / --label-column"
                )
            yield line, [record[c] for c in columns]


def _csv_header(path: Path) -> list[str] | None:
    """The header row of a CSV table, or None for other formats and empty files."""
    if _table_format(path) != "csv":
        return None
    try:
        with _open_text(path) as stream:
            return next(csv.reader(stream), None)
    except (UnicodeDecodeError, OSError, EOFError, zlib.error, csv.Error):
        return None  # not recognisable here; reading it as a table reports what is wrong


def _text(value: Any, path: Path, line: int, column: str) -> str:
    if not isinstance(value, str):
        raise DatasetError(f"{path}: line {line}: {column!r} is {json.dumps(value)}, not a string")
    if not value.strip():
        raise DatasetError(f"{path}: line {line}: {column!r} is empty; remove the row or fill in its text")
    return value


def _label(value: Any, path: Path, line: int, column: str) -> int:
    # bool before int (bool is an int); floats are refused, since 1.0 is more likely a star rating than a label.
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int) and value in (0, 1):
        return value
    if isinstance(value, str) and value.strip().lower() in LABELS:
        return LABELS[value.strip().lower()]
    raise DatasetError(
        f"{path}: line {line}: {column!r} is {json.dumps(value)}, not a sentiment label; use {LABELS_ACCEPTED}"
    )


# --- IMDB ------------------------------------------------------------------------------------------------

# (label, id, text) of each review, by split ("train", "test").
Reviews = dict[str, list[tuple[int, int, str]]]


def _imdb_folder(root: Path) -> Reviews:
    reviews: Reviews = {"train": [], "test": []}
    for split, rows in reviews.items():
        for polarity, label in (("neg", 0), ("pos", 1)):
            folder = root / split / polarity
            if not folder.is_dir():
                raise DatasetError(
                    f"{root}: no {split}/{polarity}/ folder; an aclImdb tree needs train/ and test/"
                )
            for entry in os.scandir(folder):
                match = _IMDB_FILE.match(entry.name)
                if match and entry.is_file():
                    data = Path(entry.path).read_bytes()
                    rows.append((label, int(match[1]), _review_text(data, entry.path)))
    return reviews


def _imdb_tarball(path: Path) -> Reviews:
    reviews: Reviews = {"train": [], "test": []}
    try:
        with tarfile.open(path, "r:gz") as tar:
            for member in tar:
                match = _IMDB_MEMBER.match(member.name)
                if not (match and member.isfile()):
                    continue
                stream = tar.extractfile(member)
                assert stream is not None  # a regular file always has a stream
                split, polarity, review_id, _rating = match.groups()
                text = _review_text(stream.read(), f"{path}:{member.name}")
                reviews[split].append((int(polarity == "pos"), int(review_id), text))
    except (tarfile.TarError, OSError, EOFError, zlib.error) as error:
        raise DatasetError(
            f"{path}: truncated or corrupt tarball ({error}); download aclImdb_v1.tar.gz again"
        ) from error
    for split, rows in reviews.items():
        if not rows:
            raise DatasetError(f"{path}: no {split}/pos or {split}/neg reviews; is this aclImdb_v1.tar.gz?")
    return reviews


def _imdb_csv(folder: Path) -> Reviews:
    files = _table_files(folder)
    reviews: Reviews = {"train": [], "test": []}
    for split, rows in reviews.items():
        path = files[split]
        for line, (review_id, _rating, label, text) in _rows(path, IMDB_HEADER):
            if not review_id.isdigit():
                raise DatasetError(f"{path}: line {line}: id {review_id!r} is not a number")
            rows.append((_label(label, path, line, "label"), int(review_id), _text(text, path, line, "text")))
    return reviews


def _review_text(data: bytes, where: str) -> str:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise DatasetError(f"{where}: review is not UTF-8 ({error})") from error
    if not text.strip():
        raise DatasetError(f"{where}: empty review; restore the file from the original dataset")
    return text


def _imdb_splits(reviews: Reviews, source: Path) -> dict[str, Split]:
    """Canonical order (label, id), and dev carved out of train by ``id % 10 == 9``."""
    ordered: Reviews = {}
    for split, rows in reviews.items():
        rows = sorted(rows, key=lambda row: row[:2])
        for previous, row in itertools.pairwise(rows):
            if previous[:2] == row[:2]:
                polarity = "pos" if row[0] else "neg"
                raise DatasetError(
                    f"{source}: {split}/{polarity} review id {row[1]} occurs twice; keep one copy"
                )
        ordered[split] = rows
    parts = {
        "train": [row for row in ordered["train"] if row[1] % 10 != 9],
        "dev": [row for row in ordered["train"] if row[1] % 10 == 9],
        "test": ordered["test"],
    }
    return {
        split: Split([row[2] for row in rows], np.array([row[0] for row in rows]))
        for split, rows in parts.items()
    }


def other_columns(path: Path, *, skip: Sequence[str]) -> dict[str, np.ndarray]:
    """Every column of a CSV or JSON-lines file but ``skip``, in file order: what ``features`` keeps
    beside the features (labels, ids), so a probe on the output needs no other file."""
    import pandas as pd

    path = Path(path)
    frame = (
        pd.read_csv(path)
        if _table_stem(path.name) and ".csv" in path.name
        else pd.read_json(path, lines=True)
    )
    return {str(name): frame[name].to_numpy() for name in frame.columns if name not in skip}
