"""Streams and events per device: the backends (CPU placeholders, CUDA), dbo's own CUDA
streams, and the leases that keep each live runner's streams apart."""
