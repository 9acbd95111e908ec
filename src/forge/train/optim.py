"""Parameter groups: weight decay on matrices only."""

from torch import nn


def param_groups(model: nn.Module) -> list[dict]:
    """Two groups: >=2-D weights other than embeddings decay; embeddings, norms and biases do not.

    The decaying group inherits the optimizer's weight_decay; the other sets it to 0.
    """
    embedding_params = {
        id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)
    }
    decay, no_decay = [], []
    for param in model.parameters():
        if not param.requires_grad:
            continue
        if param.ndim >= 2 and id(param) not in embedding_params:
            decay.append(param)
        else:
            no_decay.append(param)
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
