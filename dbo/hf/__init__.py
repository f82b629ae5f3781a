"""Hugging Face `transformers` generation under DBO: `overlap_generation(model)`.

    handle = dbo.hf.overlap_generation(model, decision_group=torch.distributed.group.WORLD)
    tokens = model.generate(ids, attention_mask=mask, max_new_tokens=32)  # overlapped
    handle.remove()                                                         # as before

Every forward `generate` makes (the prefill, then one decode step per token) splits its
batch rows into ubatches; each ubatch works on its own rows of the KV cache (the split
rule of `dbo`'s transformers caches: views, written in place, nothing merged back), and
the tokens are those of `generate` without DBO. `transformers` is imported only when a
model is passed in, never by `import dbo`.

dbo reaches into `transformers`' cache classes, which change between releases: outside
the releases it is tested on (`dbo.hf.versions.TESTED_TRANSFORMERS`), `overlap_generation`
and the cache split rule raise `UntestedVersionError`, naming the way on
(`DBO_ALLOW_UNTESTED_VERSIONS=1`, after `python -m dbo.hf.check --family <model_type>`).

A decode loop of one's own gets the same cache handling from `dbo.overlap`: pass the
cache as an argument (it is split by rows; the caller's cache is up to date after each
call, whether or not the function returns it):

    cache = transformers.DynamicCache(config=model.config)   # or StaticCache(...)
    step = dbo.overlap(model.forward, decision_group=group)
    logits = step(ids, attention_mask=mask, cache=cache, use_cache=True).logits
    for _ in range(new_tokens - 1):
        token = logits[:, -1:].argmax(-1)
        mask = torch.cat([mask, torch.ones_like(token)], dim=1)
        logits = step(token, attention_mask=mask, cache=cache, use_cache=True).logits
"""

from dbo.hf.generation import (
    DEFAULT_MIN_DECODE_TOKENS,
    DEFAULT_MIN_PREFILL_TOKENS,
    GenerationOverlap,
    cache_bytes_written,
    overlap_generation,
)
from dbo.hf.versions import TESTED_TRANSFORMERS, UntestedVersionError

__all__ = [
    "DEFAULT_MIN_DECODE_TOKENS", "DEFAULT_MIN_PREFILL_TOKENS", "TESTED_TRANSFORMERS",
    "GenerationOverlap", "UntestedVersionError", "cache_bytes_written", "overlap_generation",
]
