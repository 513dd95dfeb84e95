"""The work behind each stage, as plain functions: one package per stage on the ground floor of
``store``, ``tracking`` and ``settings``; ``pipeline`` on top. Prefect wrappers live in ``flows``."""
