"""Schedule-free AdamW (Defazio et al. 2024, "The Road Less Scheduled") from the `schedulefree` package.

The optimizer keeps two points: z (the fast Adam iterate) and x (a weighted average of the z's); gradients are
taken at y = (1 - beta1) z + beta1 x. `train()` puts y in the parameters, `eval()` puts x there: the trainer
calls eval() before evaluating or saving a checkpoint and train() before the next step.
"""

import schedulefree


class AdamWScheduleFree(schedulefree.AdamWScheduleFree):
    """schedulefree.AdamWScheduleFree whose train()/eval() leave no empty per-parameter state behind.

    The package's mode switches read `self.state[p]`, a defaultdict, so before the first step they fill the state
    with empty dicts. torch.distributed.checkpoint then takes the optimizer for initialised, skips building the
    state it loads into, and a resumed run silently restarts z and the second moments.
    """

    STATE_GROUP_KEYS = ("k", "train_mode", "weight_sum", "lr_max", "scheduled_lr")
    """Param-group entries that are training state, not settings: a resume keeps the checkpoint's."""

    def train(self) -> None:
        super().train()
        self._drop_empty_state()

    def eval(self) -> None:
        super().eval()
        self._drop_empty_state()

    def _drop_empty_state(self) -> None:
        for param in [p for p, state in self.state.items() if not state]:
            del self.state[param]
