"""Every config dataclass of a job, one module per ``conf/`` group; imports no runtime code.

The worker, the launcher, the lighthouse and the outer sync all read configuration, so it lives
below them all: loading a job's config loads no trainer, synchronizer or fault-tolerance runtime.
"""
