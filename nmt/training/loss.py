"""Label-smoothed cross-entropy (Szegedy et al., 2016), the paper's training loss, fused with the
output projection.

The target distribution puts ``1 - epsilon`` on the reference token and spreads ``epsilon``
uniformly over the whole vocabulary (as ``F.cross_entropy(label_smoothing=...)`` does). Padding
positions contribute nothing. Losses are summed, not averaged: the trainer divides by the number
of target tokens in the whole update (all accumulation steps and all ranks), so gradients do not
depend on how an update is split into batches.

The loss takes the decoder's last hidden states and the output projection, not logits: the
(tokens x vocabulary) logits never exist whole. Only real (non-padding) positions are projected,
a few hundred at a time, and each chunk's gradient, ``softmax - q`` with respect to its logits, is
turned into gradients for the states and the projection at once. A whole-batch logits matrix (112
MB for 3,500 tokens x 8,000 pieces in fp32) was allocated, filled and walked over by log-softmax,
its gradient and the loss several times per update; chunks stay in cache, and the projection skips
padding (docs/performance.md has the figures).
"""

from __future__ import annotations

import torch
from torch import Tensor

CHUNK_ELEMENTS = 2 ** 23  # logits per chunk (32 MiB in fp32): rows = CHUNK_ELEMENTS // vocabulary


def _compute_dtype(states: Tensor) -> torch.dtype:
    """The dtype autocast would run the projection in (the trainer and validation run under it)."""
    device = states.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else states.dtype


def _chunked_loss(states: Tensor, weight: Tensor, target: Tensor, epsilon: float, alpha: float = 0.0,
                  states_grad: bool = False, weight_grad: bool = False
                  ) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """Summed (loss, nll) over the rows of ``states`` (N, d), and the gradients asked for: d loss / d states,
    d loss / d weight (a frozen projection costs no weight gradient).

    With ``alpha`` > 0 (R-Drop), rows [0, N/2) and [N/2, N) are the same targets through two dropout
    masks: the sums are halved (per target token, as without it) and the loss adds alpha/4 times the
    symmetric KL divergence of each pair's distributions, sum((p1 - p2) * (log p1 - log p2)), as
    Liang et al. (2021) and fairseq's rdrop criterion weigh it."""
    dtype = _compute_dtype(states)
    states, weight = states.to(dtype), weight.to(dtype)
    vocabulary = weight.size(0)
    passes = 2 if alpha else 1
    if states.size(0) % passes:
        raise ValueError(f"R-Drop takes one batch twice: an even number of rows, got {states.size(0)}")
    half = states.size(0) // passes
    rows = max(1, CHUNK_ELEMENTS // vocabulary // passes)
    loss = torch.zeros((), dtype=torch.float32, device=states.device)
    nll = torch.zeros_like(loss)
    divergence = torch.zeros_like(loss)
    grad_states = torch.empty_like(states) if states_grad else None
    grad_weight = torch.zeros_like(weight, dtype=torch.float32) if weight_grad else None
    for start in range(0, half, rows):
        spans = [(start + k * half, min(start + rows, half) + k * half) for k in range(passes)]
        lprobs = []
        for low, high in spans:
            chunk_lprobs = torch.log_softmax((states[low:high] @ weight.t()).float(), dim=-1)
            chunk_nll = -chunk_lprobs.gather(1, target[low:high].unsqueeze(1))
            smooth = -chunk_lprobs.mean(dim=-1, keepdim=True)  # cross-entropy against the uniform distribution
            loss += ((1.0 - epsilon) * chunk_nll + epsilon * smooth).sum()
            nll += chunk_nll.sum()
            lprobs.append(chunk_lprobs)
        if alpha:
            log_ratio = lprobs[0] - lprobs[1]
            probs = [pass_lprobs.exp() for pass_lprobs in lprobs]
            difference = probs[0] - probs[1]
            divergence += (difference * log_ratio).sum()
        if not (states_grad or weight_grad):
            continue
        for k, (low, high) in enumerate(spans):
            if alpha:  # d/dz of the divergence for this pass's logits z, then the cross-entropy's softmax - q
                own, sign = probs[k], (1.0 if k == 0 else -1.0)
                ratio = log_ratio * sign
                grad = own * (ratio - (own * ratio).sum(dim=-1, keepdim=True)) + difference * sign
                grad.mul_(alpha / 2).add_(own).sub_(epsilon / vocabulary).mul_(0.5)
                correction = (epsilon - 1.0) * 0.5
            else:
                grad = lprobs[k].exp_().sub_(epsilon / vocabulary)  # softmax - epsilon/V, in place of lprobs
                correction = epsilon - 1.0
            grad.scatter_add_(1, target[low:high].unsqueeze(1),
                              torch.full((high - low, 1), correction, device=grad.device, dtype=grad.dtype))
            grad = grad.to(dtype)
            if states_grad:
                torch.mm(grad, weight, out=grad_states[low:high])
            if weight_grad and dtype == torch.float32:
                grad_weight.addmm_(grad.t(), states[low:high])
            elif weight_grad:
                grad_weight += (grad.t() @ states[low:high]).float()
    if alpha:
        loss, nll = loss / 2 + divergence * (alpha / 4), nll / 2
    return loss, nll, grad_states, grad_weight


class ProjectedLabelSmoothedCrossEntropy(torch.autograd.Function):
    """Gradients computed in the forward pass (chunk by chunk) and scaled by the loss's gradient in backward."""

    @staticmethod
    def forward(ctx, states: Tensor, weight: Tensor, target: Tensor, epsilon: float,
                alpha: float) -> tuple[Tensor, Tensor]:
        loss, nll, grad_states, grad_weight = _chunked_loss(states, weight, target, epsilon, alpha,
                                                            *ctx.needs_input_grad[:2])
        ctx.save_for_backward(grad_states, grad_weight)
        ctx.states_dtype, ctx.weight_dtype = states.dtype, weight.dtype
        ctx.mark_non_differentiable(nll)  # reported, never trained on
        return loss, nll

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _grad_nll: Tensor) -> tuple[Tensor | None, Tensor | None, None, None, None]:
        grad_states, grad_weight = ctx.saved_tensors
        # Widened before scaling: an fp16 loss scale times fp16 gradients could overflow.
        return (None if grad_states is None else grad_states.to(ctx.states_dtype) * grad_loss,
                None if grad_weight is None else grad_weight.to(ctx.weight_dtype) * grad_loss, None, None, None)


def label_smoothed_cross_entropy(states: Tensor, weight: Tensor, target: Tensor, epsilon: float,
                                 ignore_index: int, rdrop_alpha: float = 0.0) -> tuple[Tensor, Tensor]:
    """Summed (smoothed loss, negative log-likelihood) in nats over non-padding target tokens.

    states (B, T, d): the decoder's output before the projection; weight (V, d): the output
    projection (logits = states @ weight.T); target (B, T). Logits are computed in the autocast
    dtype when autocast is on, log-probabilities in float32. Only the loss has a gradient (with
    respect to states and weight); the nll is for reports. With ``rdrop_alpha`` > 0 the batch is
    one batch twice over (rows [0, B/2) and [B/2, B), the same targets): see _chunked_loss.
    """
    keep = target.reshape(-1).ne(ignore_index).nonzero().squeeze(1)
    rows = states.reshape(-1, states.size(-1)).index_select(0, keep)
    real_target = target.reshape(-1).index_select(0, keep)
    if torch.is_grad_enabled() and (states.requires_grad or weight.requires_grad):
        loss, nll = ProjectedLabelSmoothedCrossEntropy.apply(rows, weight, real_target, epsilon, rdrop_alpha)
    else:
        loss, nll, _, _ = _chunked_loss(rows, weight, real_target, epsilon, rdrop_alpha)
    return loss, nll
