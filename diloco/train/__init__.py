"""One replica group's training: model, data, inner optimizer, trainer, checkpoints, metrics.

Knows no outer synchronization: the trainer calls the ``SyncHooks`` it is handed.
"""
