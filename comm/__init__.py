"""comm: communication that knows about DBO.

Collectives on torch.distributed and MoE dispatch/combine that, inside an overlap, yield
to the other ubatch while they are in flight. (Being built; see docs/architecture.md.)
"""

__all__: list[str] = []
