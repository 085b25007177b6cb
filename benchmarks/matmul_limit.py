"""What the matrix units allow: the time torch's matmuls take at the shapes a training update runs.

An update's matmuls are its linear layers (every ``nn.Linear`` the forward pass calls, recorded by
hooks) and the output projection over its real target tokens; each forward (M x K) @ (K x N)
runs again twice in backward, as (M x N) @ (N x K) for the input's gradient and (N x M) @ (M x K)
for the weight's (in the layouts autograd uses). Those three products timed for each shape give
the update's matmul time at full speed; that time over the update's real one is the share of the
limit that training reaches. Attention's own (sequence x sequence) products are left out: short
sentences make them a few percent of the work.
"""

from __future__ import annotations

import time
from collections import Counter

import torch
from torch import nn

Shape = tuple[int, int, int]  # (M, K, N): an (M x K) @ (K x N) forward product


class LinearShapes:
    """Counts the (M, K, N) of every nn.Linear call in ``model`` while recording."""

    def __init__(self, model: nn.Module):
        self.counts: Counter[Shape] = Counter()
        self.recording = False
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.register_forward_hook(self._record)

    def _record(self, module: nn.Linear, inputs: tuple[torch.Tensor, ...], _output: torch.Tensor) -> None:
        if self.recording:
            self.counts[(inputs[0].numel() // module.in_features, module.in_features, module.out_features)] += 1

    def add_projection(self, tokens: int, d_model: int, vocabulary: int) -> None:
        """The loss's output projection, outside any nn.Linear."""
        self.counts[(tokens, d_model, vocabulary)] += 1


def training_flops(counts: Counter[Shape]) -> float:
    """Forward plus backward: 3 products of 2*M*K*N FLOPs each."""
    return sum(3 * 2 * m * k * n * count for (m, k, n), count in counts.items())


def _seconds(a: torch.Tensor, b: torch.Tensor, repeats: int = 5) -> float:
    """The fastest of a few runs: the limit, not what a busy machine happened to give."""
    torch.matmul(a, b)  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        torch.matmul(a, b)
        times.append(time.perf_counter() - started)
    return min(times)


def training_matmul_seconds(counts: Counter[Shape], dtype: torch.dtype) -> float:
    """Seconds torch.matmul takes for these forward shapes and their two backward products, in ``dtype``."""
    total = 0.0
    for (m, k, n), count in counts.items():
        x, weight, dy = (torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype),
                         torch.randn(m, n, dtype=dtype))  # weight (N x K), as nn.Linear stores it
        total += count * (_seconds(x, weight.t()) + _seconds(dy, weight) + _seconds(dy.t(), x))
    return total
