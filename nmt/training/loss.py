"""Label-smoothed cross-entropy (Szegedy et al., 2016), the paper's training loss.

The target distribution puts ``1 - epsilon`` on the reference token and spreads ``epsilon``
uniformly over the whole vocabulary (as ``F.cross_entropy(label_smoothing=...)`` does). Padding
positions contribute nothing. Losses are summed, not averaged: the trainer divides by the number
of target tokens in the whole update (all accumulation steps and all ranks), so gradients do not
depend on how an update is split into batches.

The gradient is written by hand: with respect to the logits it is ``softmax - q`` (q the smoothed
target) at every real position, one pass over the (tokens x vocabulary) matrix where autograd's
chain through log-softmax, gather, mean and where took six (on CPU a third of the loss's time).
"""

from __future__ import annotations

import torch
from torch import Tensor


class LabelSmoothedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, epsilon: float, ignore_index: int) -> tuple[Tensor, Tensor]:
        lprobs = torch.log_softmax(logits.float(), dim=-1)
        keep = target.ne(ignore_index)
        nll = -lprobs.gather(1, target.unsqueeze(1)).squeeze(1)
        smooth = -lprobs.mean(dim=-1)  # cross-entropy against the uniform distribution
        zero = torch.zeros((), dtype=lprobs.dtype, device=lprobs.device)
        loss = torch.where(keep, (1.0 - epsilon) * nll + epsilon * smooth, zero).sum()
        nll = torch.where(keep, nll, zero).sum()
        ctx.save_for_backward(lprobs, target, keep)
        ctx.epsilon, ctx.logits_dtype = epsilon, logits.dtype
        ctx.mark_non_differentiable(nll)  # reported, never trained on
        return loss, nll

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _grad_nll: Tensor) -> tuple[Tensor, None, None, None]:
        lprobs, target, keep = ctx.saved_tensors
        epsilon = ctx.epsilon
        grad = lprobs.exp().sub_(epsilon / lprobs.size(-1))  # softmax - epsilon/V
        grad.scatter_add_(1, target.unsqueeze(1), torch.full_like(grad[:, :1], epsilon - 1.0))
        grad.mul_((keep.to(grad.dtype) * grad_loss).unsqueeze(1))
        return grad.to(ctx.logits_dtype), None, None, None


def label_smoothed_cross_entropy(logits: Tensor, target: Tensor, epsilon: float,
                                 ignore_index: int) -> tuple[Tensor, Tensor]:
    """Summed (smoothed loss, negative log-likelihood) over non-padding target tokens, in nats.

    logits (B, T, V) in any precision (computed in float32), target (B, T). Only the loss has a
    gradient; the nll is for reports.
    """
    return LabelSmoothedCrossEntropy.apply(logits.reshape(-1, logits.size(-1)), target.reshape(-1), epsilon,
                                           ignore_index)
