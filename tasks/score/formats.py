"""The table formats `score` reads, by file suffix: a module of its own so the CLI checks its inputs
without importing pyarrow."""

# Suffix → format; longest first so ``.csv.gz`` is not taken for ``.gz``.
FORMATS = {
    ".csv.gz": "csv",
    ".csv": "csv",
    ".jsonl.gz": "jsonl",
    ".json.gz": "jsonl",
    ".ndjson.gz": "jsonl",
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".ndjson": "jsonl",
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".feather": "arrow",
    ".ipc": "arrow",
}
SUFFIXES = tuple(FORMATS)
