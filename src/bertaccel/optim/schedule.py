"""The learning-rate schedule of every fit: linear warm-up from 0, then linear decay to 0 (BERT's; the
same factors as transformers' `get_linear_schedule_with_warmup`).

Unlike that function's `LambdaLR` (one lambda per parameter group, fixed when it is built), this schedule
takes parameter groups added during the fit - Lightning's `BaseFinetuning.unfreeze_and_add_param_group`
adds one when it unfreezes a backbone, and `LambdaLR` then raised at its next step (PyTorch zips groups
and lambdas strictly). An added group keeps the learning rate it was added with and from then on follows
the schedule's shape like the others: its base rate is that learning rate over the factor the other
groups ran at when it joined.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler


class LinearWarmupDecay(LRScheduler):
    """lr = base lr x factor(step): step / warmup_steps during the warm-up, then
    (total_steps - step) / (total_steps - warmup_steps), down to 0 at `total_steps` (0 after)."""

    # this run's configuration, not state: a resumed run follows its own schedule from the checkpoint's step
    _configuration = ("warmup_steps", "total_steps")

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, last_epoch: int = -1):
        if warmup_steps < 0 or total_steps < 1:
            raise ValueError(f"LinearWarmupDecay: warmup_steps must be >= 0 and total_steps >= 1, got "
                             f"{warmup_steps} and {total_steps}")
        self.warmup_steps = int(warmup_steps)
        self.total_steps = int(total_steps)
        super().__init__(optimizer, last_epoch)

    def factor(self, step: int) -> float:
        if step < self.warmup_steps:
            return step / max(1, self.warmup_steps)
        return max(0.0, (self.total_steps - step) / max(1, self.total_steps - self.warmup_steps))

    def get_lr(self) -> list[float]:
        self._adopt_added_groups()
        f = self.factor(self.last_epoch)
        return [base * f for base in self.base_lrs]

    def _adopt_added_groups(self) -> None:
        """Give each group added since the last step its base rate (see the module's docs)."""
        groups = self.optimizer.param_groups
        if len(groups) <= len(self.base_lrs):
            return
        # `last_epoch` has already moved to the step being set: the others ran at the previous step's factor
        joined = self.factor(max(self.last_epoch - 1, 0))
        for group in groups[len(self.base_lrs):]:
            lr = float(group["lr"])
            base = lr / joined if joined > 0 else lr
            group.setdefault("initial_lr", base)
            self.base_lrs.append(base)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        for key in self._configuration:
            state.pop(key, None)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # a checkpoint of the LambdaLR this replaced carries its (unpicklable, None) lambdas: not ours
        state = {k: v for k, v in state_dict.items() if k not in (*self._configuration, "lr_lambdas")}
        super().load_state_dict(state)
