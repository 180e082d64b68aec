"""Outer momentum warm-up: μ ramps linearly from 0 to its configured value over the first inner steps.

Trained from scratch, the first windows' pseudo-gradients are the largest of the run and point
the same way. With μ = 0.9 from the first round, Nesterov applies each of them about
1/(1 − μ) = 10 times over the following windows and overshoots: at 1,000 inner steps and
H = 50, DiLoCo with the paper's outer settings ends worse than groups that never communicate
(experiments/compare_ddp.py). The paper's settings were tuned for long runs from a pretrained
model, where the first windows are not special.

The ramp reads the inner step at which a round was launched, which every group of the round
shares (a healing group joins its peers' round at their step), so all groups take the same
outer step and no new state has to travel.
"""

from __future__ import annotations

import torch

from diloco.schedule import momentum


class MomentumWarmup:
    """Sets each param group's momentum to μ(s) ramped over ``steps`` (``diloco/schedule.py``) before an outer step.

    Only optimizers with a ``momentum`` hyperparameter (``nesterov``, ``sgd``) are affected;
    ``avg`` keeps its momentum of 0 and the Adam family has none.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, steps: int) -> None:
        if steps < 1:
            raise ValueError(f"steps={steps}: a warm-up needs at least 1 inner step (0 means no warm-up object)")
        self.optimizer = optimizer
        self.steps = steps
        self._full = [group.get("momentum") for group in optimizer.param_groups]

    def apply(self, launch_step: int) -> None:
        """Set the momentum for the round launched after inner step ``launch_step`` (≥ 1)."""
        for group, full in zip(self.optimizer.param_groups, self._full):
            if full is not None:
                group["momentum"] = momentum(launch_step, full, self.steps)
