"""The machinery behind one overlapped call: the baton and its wake-ups, each thread's
ubatch, one run's streams and hooks, the persistent worker threads, the runner that
drives them (its watchdog), what an aborted run leaves at interpreter exit, the pool of
runners, and the caller's thread settings and CPU affinity replayed in the workers.
Public only through `dbo`'s own names."""
