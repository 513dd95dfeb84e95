"""Batch scoring: a table of reviews → the registered classifier's probability, label and sentiment unit
for every row, in Parquet files beside a manifest, resumable piece by piece."""
