import math

import pytest
import torch
import torch.nn.functional as F

import nmt.training.loss as loss_module
from nmt.training.loss import label_smoothed_cross_entropy

PAD = 0


def reference(states, weight, target, epsilon):
    """autograd through F.cross_entropy over the whole logits matrix: what the fused loss replaces."""
    logits = F.linear(states, weight).float().reshape(-1, weight.size(0))
    loss = F.cross_entropy(logits, target.reshape(-1), ignore_index=PAD, label_smoothing=epsilon, reduction="sum")
    nll = F.cross_entropy(logits, target.reshape(-1), ignore_index=PAD, reduction="sum")
    return loss, nll


def test_matches_a_hand_computed_value():
    # One real token over a vocabulary of 3 with logits (0, ln 2, ln 5): p = (1/8, 2/8, 5/8).
    states = torch.ones(1, 1, 1)
    weight = torch.log(torch.tensor([[1.0], [2.0], [5.0]]))
    target = torch.tensor([[2]])
    epsilon = 0.1
    # q = 0.9 on token 2 plus 0.1/3 on every token: loss = -sum q log p.
    expected = -(0.9 * math.log(5 / 8) + (0.1 / 3) * (math.log(1 / 8) + math.log(2 / 8) + math.log(5 / 8)))
    loss, nll = label_smoothed_cross_entropy(states, weight, target, epsilon, ignore_index=PAD)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert nll.item() == pytest.approx(-math.log(5 / 8), rel=1e-6)


def test_padding_is_ignored_and_agrees_with_torch():
    torch.manual_seed(0)
    states, weight = torch.randn(2, 4, 5), torch.randn(7, 5)
    target = torch.tensor([[3, 4, 5, PAD], [6, PAD, PAD, PAD]])
    loss, nll = label_smoothed_cross_entropy(states, weight, target, 0.1, ignore_index=PAD)
    expected_loss, expected_nll = reference(states, weight, target, 0.1)
    assert loss.item() == pytest.approx(expected_loss.item(), rel=1e-6)
    assert nll.item() == pytest.approx(expected_nll.item(), rel=1e-6)
    # Changing the states at padding positions changes nothing.
    changed = states.clone()
    changed[0, 3] += 100.0
    changed[1, 1:] -= 50.0
    assert label_smoothed_cross_entropy(changed, weight, target, 0.1, PAD)[0].item() == pytest.approx(loss.item(),
                                                                                                        rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunk_rows", [1, 3, 1000])
@pytest.mark.parametrize("epsilon", [0.0, 0.1])
def test_hand_written_gradients_equal_autograd_whatever_the_chunking(monkeypatch, epsilon, chunk_rows, dtype):
    vocabulary = 13
    monkeypatch.setattr(loss_module, "CHUNK_ELEMENTS", chunk_rows * vocabulary)
    torch.manual_seed(2)
    states, weight = torch.randn(2, 5, 4, dtype=dtype), torch.randn(vocabulary, 4, dtype=dtype)
    target = torch.randint(1, vocabulary, (2, 5))
    target[1, 3:] = PAD
    ours = states.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, nll = label_smoothed_cross_entropy(*ours, target, epsilon, PAD)
    (loss * 3.0).backward()
    theirs = states.clone().requires_grad_(), weight.clone().requires_grad_()
    expected_loss, expected_nll = reference(*theirs, target, epsilon)
    (expected_loss * 3.0).backward()
    close = dict(rtol=1e-5, atol=1e-6)  # log-probabilities are computed in float32
    torch.testing.assert_close(loss, expected_loss, **close)
    torch.testing.assert_close(nll, expected_nll, **close)
    torch.testing.assert_close(ours[0].grad, theirs[0].grad, **close)
    torch.testing.assert_close(ours[1].grad, theirs[1].grad, **close)
    assert torch.count_nonzero(ours[0].grad[1, 3:]) == 0  # padding gets no gradient


def test_a_weight_used_twice_gets_both_gradients():
    """Tied embeddings: the output projection is also the embedding, and both uses reach its gradient."""
    torch.manual_seed(3)
    embedding = torch.randn(9, 4, requires_grad=True)
    tokens = torch.tensor([[1, 2, 3]])
    target = torch.tensor([[2, 3, 4]])
    states = torch.tanh(F.embedding(tokens, embedding))
    label_smoothed_cross_entropy(states, embedding, target, 0.1, PAD)[0].backward()
    ours = embedding.grad.clone()
    embedding.grad = None
    states = torch.tanh(F.embedding(tokens, embedding))
    reference(states, embedding, target, 0.1)[0].backward()
    torch.testing.assert_close(ours, embedding.grad)


def test_bf16_autocast_projects_in_bf16_and_sums_in_float32():
    torch.manual_seed(1)
    states, weight = torch.randn(3, 5, 8), torch.randn(11, 8)
    target = torch.randint(1, 11, (3, 5))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, nll = label_smoothed_cross_entropy(states, weight, target, 0.0, PAD)
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(nll.item())
    expected = F.cross_entropy(F.linear(states.bfloat16(), weight.bfloat16()).float().view(-1, 11), target.view(-1),
                               reduction="sum")
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    # Gradients come back in the inputs' dtypes.
    states.requires_grad_()
    weight.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        label_smoothed_cross_entropy(states, weight, target, 0.1, PAD)[0].backward()
    assert states.grad.dtype == weight.grad.dtype == torch.float32


def test_only_the_gradients_asked_for_are_computed(monkeypatch):
    computed = []
    original = loss_module._chunked_loss
    monkeypatch.setattr(loss_module, "_chunked_loss", lambda *args: computed.append(args[5:]) or original(*args))
    states, weight = torch.randn(2, 3, 4, requires_grad=True), torch.randn(6, 4, requires_grad=True)
    target = torch.randint(1, 6, (2, 3))
    with torch.no_grad():
        label_smoothed_cross_entropy(states, weight, target, 0.1, PAD)
    label_smoothed_cross_entropy(states, weight, target, 0.1, PAD)
    frozen = weight.detach()  # a frozen output projection: no weight gradient is made for it
    loss, _ = label_smoothed_cross_entropy(states, frozen, target, 0.1, PAD)
    loss.backward()
    fixed_states = states.detach()  # and frozen inputs: no states gradient
    label_smoothed_cross_entropy(fixed_states, weight, target, 0.1, PAD)[0].backward()
    assert computed == [(), (True, True), (True, False), (False, True)]
    torch.testing.assert_close(states.grad, torch.autograd.grad(reference(states, frozen, target, 0.1)[0], states)[0])
    torch.testing.assert_close(weight.grad, torch.autograd.grad(reference(fixed_states, weight, target, 0.1)[0],
                                                                weight)[0])


def rdrop_reference(states, weight, target, epsilon, alpha):
    """R-Drop by autograd over whole logits: the two passes' cross-entropy averaged, plus alpha/4 times
    KL(p1 || p2) + KL(p2 || p1) over the real tokens (F.kl_div(log q, log p) is p * (log p - log q))."""
    half = states.size(0) // 2
    loss, nll = reference(states, weight, target, epsilon)
    lprobs = F.log_softmax(F.linear(states, weight).float(), dim=-1)
    real = target[:half].ne(PAD).unsqueeze(-1)
    both_ways = (F.kl_div(lprobs[half:], lprobs[:half], log_target=True, reduction="none") +
                 F.kl_div(lprobs[:half], lprobs[half:], log_target=True, reduction="none"))
    return loss / 2 + alpha / 4 * (both_ways * real).sum(), nll / 2


@pytest.mark.parametrize("chunk", [2 ** 23, 20, 28])  # one chunk; one row of each pass a chunk; two (the last: one)
def test_rdrop_adds_the_symmetric_divergence_of_the_two_passes_with_its_gradients(monkeypatch, chunk):
    monkeypatch.setattr(loss_module, "CHUNK_ELEMENTS", chunk)
    torch.manual_seed(0)
    target = torch.tensor([[3, 4, 5, PAD], [6, 2, PAD, PAD], [1, 1, 1, 1]]).repeat(2, 1)  # one batch, twice
    states = torch.randn(6, 4, 5, requires_grad=True)  # different rows: two dropout masks
    weight = torch.randn(7, 5, requires_grad=True)
    loss, nll = label_smoothed_cross_entropy(states, weight, target, 0.1, PAD, rdrop_alpha=5.0)
    expected_loss, expected_nll = rdrop_reference(states, weight, target, 0.1, 5.0)
    torch.testing.assert_close(nll, expected_nll.detach())
    torch.testing.assert_close(loss, expected_loss.detach())
    plain = label_smoothed_cross_entropy(states, weight, target, 0.1, PAD)[0] / 2
    assert loss.item() > plain.item() + 0.1  # the divergence counts
    loss.backward()
    expected_grads = torch.autograd.grad(expected_loss, (states, weight))
    torch.testing.assert_close(states.grad, expected_grads[0])
    torch.testing.assert_close(weight.grad, expected_grads[1])
    same = states.detach()[:3].repeat(2, 1, 1)  # the same rows twice: no divergence, the plain loss per pass
    torch.testing.assert_close(label_smoothed_cross_entropy(same, weight, target, 0.1, PAD, rdrop_alpha=5.0)[0],
                               label_smoothed_cross_entropy(same[:3], weight, target[:3], 0.1, PAD)[0])
    with pytest.raises(ValueError, match="R-Drop takes one batch twice"):  # 3 real tokens cannot be two passes
        label_smoothed_cross_entropy(states[:1], weight, target[:1], 0.1, PAD, rdrop_alpha=5.0)


def test_all_padding_gives_zero_loss_and_zero_gradients():
    states, weight = torch.randn(2, 3, 4, requires_grad=True), torch.randn(6, 4, requires_grad=True)
    loss, nll = label_smoothed_cross_entropy(states, weight, torch.full((2, 3), PAD), 0.1, PAD)
    loss.backward()
    assert loss.item() == nll.item() == 0.0
    assert torch.count_nonzero(states.grad) == 0 and torch.count_nonzero(weight.grad) == 0
