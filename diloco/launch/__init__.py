"""The local job: launcher, supervisor, fault injection, process spawning, warm spares, recovery
choice, the lighthouse process, summary and progress.
"""
