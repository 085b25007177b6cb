import math

import pytest
import torch
import torch.nn.functional as F

from nmt.training.loss import label_smoothed_cross_entropy

PAD = 0


def test_matches_a_hand_computed_value():
    # One real token over a vocabulary of 3 with logits (0, ln 2, ln 5): p = (1/8, 2/8, 5/8).
    logits = torch.log(torch.tensor([[[1.0, 2.0, 5.0]]]))
    target = torch.tensor([[2]])
    epsilon = 0.1
    # q = 0.9 on token 2 plus 0.1/3 on every token: loss = -sum q log p.
    expected = -(0.9 * math.log(5 / 8) + (0.1 / 3) * (math.log(1 / 8) + math.log(2 / 8) + math.log(5 / 8)))
    loss, nll = label_smoothed_cross_entropy(logits, target, epsilon, ignore_index=PAD)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert nll.item() == pytest.approx(-math.log(5 / 8), rel=1e-6)


def test_padding_is_ignored_and_agrees_with_torch():
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 7)
    target = torch.tensor([[3, 4, 5, PAD], [6, PAD, PAD, PAD]])
    loss, nll = label_smoothed_cross_entropy(logits, target, 0.1, ignore_index=PAD)
    reference = F.cross_entropy(logits.view(-1, 7), target.view(-1), ignore_index=PAD, label_smoothing=0.1,
                                reduction="sum")
    assert loss.item() == pytest.approx(reference.item(), rel=1e-6)
    assert nll.item() == pytest.approx(F.cross_entropy(logits.view(-1, 7), target.view(-1), ignore_index=PAD,
                                                       reduction="sum").item(), rel=1e-6)
    # Changing the logits at padding positions changes nothing.
    changed = logits.clone()
    changed[0, 3] += 100.0
    changed[1, 1:] -= 50.0
    assert label_smoothed_cross_entropy(changed, target, 0.1, PAD)[0].item() == pytest.approx(loss.item(), rel=1e-6)


def test_no_smoothing_is_plain_cross_entropy_and_bf16_logits_are_computed_in_float32():
    torch.manual_seed(1)
    logits = torch.randn(3, 5, 11).to(torch.bfloat16)
    target = torch.randint(1, 11, (3, 5))
    loss, nll = label_smoothed_cross_entropy(logits, target, 0.0, PAD)
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(nll.item())
    assert loss.item() == pytest.approx(F.cross_entropy(logits.float().view(-1, 11), target.view(-1),
                                                        reduction="sum").item(), rel=1e-5)


@pytest.mark.parametrize("epsilon", [0.0, 0.1])
def test_hand_written_gradient_equals_autograd(epsilon):
    torch.manual_seed(2)
    logits = torch.randn(2, 5, 13, dtype=torch.float64)
    target = torch.randint(1, 13, (2, 5))
    target[1, 3:] = PAD
    ours = logits.clone().requires_grad_()
    (label_smoothed_cross_entropy(ours, target, epsilon, PAD)[0] * 3.0).backward()
    reference = logits.clone().requires_grad_()
    (F.cross_entropy(reference.view(-1, 13), target.view(-1), ignore_index=PAD, label_smoothing=epsilon,
                     reduction="sum") * 3.0).backward()
    torch.testing.assert_close(ours.grad, reference.grad)
    assert torch.count_nonzero(ours.grad[1, 3:]) == 0  # padding gets no gradient
