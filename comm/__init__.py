"""comm: communication that knows about DBO.

Collectives on torch.distributed and MoE dispatch/combine that, inside an overlap, yield
to the other ubatch while they are in flight; and an emulated link for single-process
measurements.
"""

from comm.emulated import EmulatedLink, TransferHandle

__all__ = ["EmulatedLink", "TransferHandle"]
