"""Prefect flows: each wires the tasks of one stage (or the whole pipeline) and passes URIs."""
