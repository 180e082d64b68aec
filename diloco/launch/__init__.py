"""What ``run.py`` starts: the roles (``roles``), conf/ composed with hydra (``compose``, the one
module that imports it), and the local job: launcher, supervisor, fault injection, process
spawning, recovery choice, the lighthouse process, summary, outcome and progress; and the use of
a trained model (``inference``: role=eval, role=sample).
"""
