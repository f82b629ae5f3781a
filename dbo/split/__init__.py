"""Splitting a call's arguments into ubatches and merging their outputs: the default
split and merge on torch's pytree, the split rules of stateful types (and the refusal
of objects holding batch rows), and token ranges of ragged batches."""
