"""Fault-tolerant DiLoCo: replica groups that train one model while talking to each other rarely."""
