"""Synthetic long-tail sequence data for ranking models, and its one validating reader.

Readers use `read_split` (validated pyarrow Tables); the generator is `python -m data_gen`.
See data_gen/schema.py for the on-disk format and data_gen/planted.py for the label model."""

from .schema import DataValidationError, load_meta, read_split, validate_dataset

__all__ = ["DataValidationError", "load_meta", "read_split", "validate_dataset"]
