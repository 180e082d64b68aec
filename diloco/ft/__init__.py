"""Fault tolerance: quorum rules, the lighthouse that applies them, and the groups' side of it."""
