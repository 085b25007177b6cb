"""Label-smoothed cross-entropy (Szegedy et al., 2016), the paper's training loss.

The target distribution puts ``1 - epsilon`` on the reference token and spreads ``epsilon``
uniformly over the whole vocabulary (as ``F.cross_entropy(label_smoothing=...)`` does). Padding
positions contribute nothing. Losses are summed, not averaged: the trainer divides by the number
of target tokens in the whole update (all accumulation steps and all ranks), so gradients do not
depend on how an update is split into batches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def label_smoothed_cross_entropy(logits: Tensor, target: Tensor, epsilon: float,
                                 ignore_index: int) -> tuple[Tensor, Tensor]:
    """Summed (smoothed loss, negative log-likelihood) over non-padding target tokens, in nats.

    logits (B, T, V) in any precision (computed in float32), target (B, T).
    """
    lprobs = F.log_softmax(logits.float(), dim=-1).view(-1, logits.size(-1))
    target = target.reshape(-1)
    keep = target.ne(ignore_index)
    nll = -lprobs.gather(1, target.unsqueeze(1)).squeeze(1)
    smooth = -lprobs.mean(dim=-1)  # cross-entropy against the uniform distribution
    loss = (1.0 - epsilon) * nll + epsilon * smooth
    zero = torch.zeros((), dtype=loss.dtype, device=loss.device)
    return torch.where(keep, loss, zero).sum(), torch.where(keep, nll, zero).sum()
