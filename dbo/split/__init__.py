"""Splitting a call's arguments into ubatches and merging their outputs: `batch` splits
the arguments (`default_split`), `outputs` merges the outputs (`default_merge`,
`merge_parts`), `rules` holds the split rules of stateful types, the tree walk they share
and its refusals (objects holding batch rows), `tokens` the token ranges of ragged
batches (`balanced_token_split`)."""
