"""A resume applies this run's optimizer settings and schedule over the ones the checkpoint brings back.

An optimizer's state dict carries its param groups' settings (lr, betas, weight decay, ...), so loading it puts the
old run's values back, and the scheduler's state brings back its base lrs. A changed `optimizer.lr` or
`train.steps` would silently not apply. These helpers keep the settings this run's config built and put them back
after the load, then let the schedule set the lr of the resumed step.
"""

import warnings

from torch.optim import Optimizer


def _state_keys(optimizer: Optimizer) -> set[str]:
    """Param-group entries that are not settings: the parameters, the lr the schedule sets, and whatever the
    optimizer declares as training state (schedule-free's step count and weight sum)."""
    return {"params", "lr", *getattr(optimizer, "STATE_GROUP_KEYS", ())}


def group_settings(optimizer: Optimizer) -> list[dict]:
    """Each param group's settings as this run's config built them (call before loading a checkpoint)."""
    skip = _state_keys(optimizer)
    return [{k: v for k, v in group.items() if k not in skip} for group in optimizer.param_groups]


def apply_group_settings(optimizer: Optimizer, scheduler, settings: list[dict], lr_scale: float = 1.0) -> None:
    """Put `settings` back into the loaded optimizer and make the scheduler's base lrs the configured ones; the lr
    of the next step is then the new schedule's at the resumed step (times a data phase's lr_scale)."""
    if len(settings) != len(optimizer.param_groups):
        raise ValueError(f"the checkpoint has {len(optimizer.param_groups)} param groups, this run {len(settings)}")
    for group, own in zip(optimizer.param_groups, settings):
        group.update(own)
    scheduler.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
    with warnings.catch_warnings():  # get_lr outside step() warns; here it is the closed form on purpose
        warnings.simplefilter("ignore")
        lrs = scheduler.get_lr()
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr * lr_scale
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
