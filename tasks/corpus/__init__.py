"""The corpus stage: takes raw reviews (files, folders, globs, s3://, http(s)://) and hands on a manifest
URI of deduplicated, split Arrow IPC shards in the store."""
