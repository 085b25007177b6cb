"""Which batches each process trains on, in which order, and preparing them ahead of the GPU.

Each epoch's batches (lists of sentence indices) are built from length buckets, equal lengths
shuffled, and visited in a shuffled order: both a pure function of (seed, epoch). With N
processes, the epoch's list is cut to a multiple of N and process r takes every N-th batch from
r, so the k-th batch of all processes together is the global slice ``[k*N, (k+1)*N)``. A
position in the epoch is the number of global batches consumed: a resumed run starts exactly
where the checkpoint left off.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, TypeVar

import numpy as np

from nmt.data.batching import (
    Batch,
    SentenceTooLong,
    batch_by_size,
    batch_sizes,
    collate,
    length_keys,
    length_order,
    padded_sizes,
    smallest_unsigned,
)
from nmt.data.dataset import ParallelDataset
from nmt.errors import NmtError
from nmt.log import logger

T = TypeVar("T")


class TrainingBatches:
    """The training split's batches: a new composition every epoch, a pure function of (seed, epoch).

    Equal-length pairs are shuffled before the length sort, as fairseq permutes before its
    stable sort: a corpus made of sub-corpora mixes them within batches, and no two pairs share
    a batch for the whole run. The batch sizes depend on the sorted lengths alone, so they are
    computed once: every epoch has the same number of batches, each within the budget (padding
    included). Everything is a numpy array, none a Python object per pair.
    """

    def __init__(self, dataset: ParallelDataset, max_tokens: int | None, max_sentences: int | None = None,
                 required_multiple: int = 1, skip_too_long: bool = False, max_positions: int | None = None):
        source_sizes, target_sizes = dataset.source.sizes, dataset.target.sizes
        self.kept: np.ndarray | None = None  # indices of the pairs batched; None: all
        limits = {name: limit for name, limit in (("--max-tokens", max_tokens), ("the model's max_positions",
                                                                                  max_positions)) if limit is not None}
        if skip_too_long and limits:
            self.kept = np.flatnonzero(np.maximum(source_sizes, target_sizes) <= min(limits.values()))
            if len(self.kept) < len(dataset):
                logger.warning("skipping %d of %d sentence pairs longer than %s", len(dataset) - len(self.kept),
                               len(dataset), " or ".join(f"{name} {limit}" for name, limit in limits.items()))
            source_sizes, target_sizes = source_sizes[self.kept], target_sizes[self.kept]
        elif max_positions is not None:
            check_positions(dataset, "training", max_positions)
        try:
            sizes = padded_sizes(source_sizes, target_sizes, max_tokens, max_sentences)
        except SentenceTooLong as exc:
            raise NmtError(f"{exc}, or pass --skip-invalid-size-inputs") from exc
        sorted_sizes = np.sort(sizes.astype(smallest_unsigned(int(sizes.max(initial=0)))), kind="stable")  # radix
        self.ends = np.cumsum(batch_sizes(sorted_sizes, max_tokens, max_sentences, required_multiple))
        self.keys = length_keys(source_sizes, target_sizes)

    def __len__(self) -> int:
        return len(self.ends)

    def epoch(self, seed: int, epoch: int) -> list[np.ndarray]:
        """The epoch's batches in the order they are trained on."""
        rng = np.random.default_rng([seed, epoch])
        order = length_order(self.keys, rng)
        if self.kept is not None:
            order = self.kept[order]
        batches = np.split(order, self.ends[:-1]) if len(self.ends) else []
        return [batches[i] for i in rng.permutation(len(batches))]


def check_positions(dataset: ParallelDataset, split: str, max_positions: int) -> None:
    """A pair the model cannot take (a side over its positions) found before training, not when its batch comes."""
    sizes = np.maximum(dataset.source.sizes, dataset.target.sizes)
    if len(sizes) and sizes.max() > max_positions:
        longest = int(np.argmax(sizes))
        raise NmtError(f"{split} pair {longest} has {int(sizes[longest])} tokens, over the model's max_positions "
                       f"{max_positions}; pass --skip-invalid-size-inputs, filter long sentences in preprocess "
                       "(--max-len) or give --set max_positions=N")


def make_batches(dataset: ParallelDataset, max_tokens: int | None,
                 max_sentences: int | None = None) -> list[np.ndarray]:
    """Length-bucketed batches of a whole split in length order (validation: no shuffling needed)."""
    return batch_by_size(dataset.source.sizes, dataset.target.sizes, max_tokens, max_sentences)


def load_batch(dataset: ParallelDataset, indices: np.ndarray, pin_memory: bool = False) -> Batch:
    batch = collate(indices, [dataset.source[i] for i in indices], [dataset.target[i] for i in indices])
    if pin_memory:
        batch = Batch(batch.indices, batch.source.pin_memory(), batch.prev_output.pin_memory(),
                      batch.target.pin_memory())
    return batch


@dataclass
class Update:
    batches: list[Batch]  # this process's batches, accumulated into one optimizer step
    positions: list[int]  # where each of those batches stands in the epoch's global order
    num_tokens: int  # target tokens of the whole update, over all processes
    position: int  # global batches of the epoch consumed once this update is done


class EpochIterator:
    """One epoch of updates for one process, from a position, prepared by a background thread."""

    def __init__(self, dataset: ParallelDataset, batches: TrainingBatches, *, seed: int, epoch: int, start: int = 0,
                 update_freq: int = 1, world_size: int = 1, rank: int = 0, prefetch: int = 4, pin_memory: bool = False):
        ordered = batches.epoch(seed, epoch)
        if len(ordered) < world_size:
            raise ValueError(f"{len(ordered)} batches cannot be shared by {world_size} processes")
        self.dataset = dataset
        self.batches = ordered[: len(ordered) - len(ordered) % world_size]
        starts = np.cumsum([0] + [len(batch) for batch in self.batches[:-1]])
        self.tokens = np.add.reduceat(dataset.target.sizes[np.concatenate(self.batches)], starts, dtype=np.int64)
        self.world_size, self.rank, self.update_freq = world_size, rank, update_freq
        self.start = min(start, len(self.batches))
        self.prefetch, self.pin_memory = prefetch, pin_memory

    @property
    def num_batches(self) -> int:
        """Global batches in the epoch (all processes together)."""
        return len(self.batches)

    def num_updates(self, start: int = 0) -> int:
        per_process = (len(self.batches) - start) // self.world_size
        return -(-per_process // self.update_freq)

    def _updates(self) -> Iterator[Update]:
        world = self.world_size
        step = self.start // world  # index into this process's shard
        shard_length = len(self.batches) // world
        while step < shard_length:
            count = min(self.update_freq, shard_length - step)
            begin, end = step * world, (step + count) * world
            positions = list(range(begin + self.rank, end, world))
            mine = [load_batch(self.dataset, self.batches[i], self.pin_memory) for i in positions]
            yield Update(mine, positions, int(self.tokens[begin:end].sum()), end)
            step += count

    def __iter__(self) -> Iterator[Update]:
        return prefetched(self._updates, self.prefetch)


def sharded_batches(dataset: ParallelDataset, batches: list[np.ndarray], *, world_size: int, rank: int,
                    prefetch: int = 4, pin_memory: bool = False) -> Iterator[Batch]:
    """This process's share of a fixed list of batches (validation): every N-th from r, untruncated."""
    mine = batches[rank::world_size]
    return prefetched(lambda: (load_batch(dataset, b, pin_memory) for b in mine), prefetch)


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


_DONE = object()


def prefetched(make: Callable[[], Iterable[T]], size: int) -> Iterator[T]:
    """Run an iterator in a background thread, up to ``size`` items ahead (0: no thread).

    Errors in the thread are raised in the consumer; a consumer that stops early stops the thread.
    """
    if size <= 0:
        yield from make()
        return
    items: queue.Queue = queue.Queue(maxsize=size)
    stop = threading.Event()

    def produce() -> None:
        def put(item: object) -> bool:
            while not stop.is_set():
                try:
                    items.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        try:
            for item in make():
                if not put(item):
                    return
            put(_DONE)
        except BaseException as exc:  # handed to the consumer, which raises it
            put(_Failure(exc))

    thread = threading.Thread(target=produce, name="nmt-batch-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item = items.get()
            if item is _DONE:
                return
            if isinstance(item, _Failure):
                raise item.error
            yield item
    finally:
        stop.set()
        thread.join()
