"""The work behind each stage, as plain functions; the Prefect task wrappers live beside them."""
