import numpy as np
import pytest

from nmt.data.dataset import DataDir, ParallelDataset, TokenArray, write_token_array
from nmt.data.vocabulary import EOS_ID, PAD_ID
from nmt.errors import NmtError
from nmt.training.iterator import EpochIterator, TrainingBatches, make_batches, prefetched


@pytest.fixture(scope="module")
def train_set(tiny_data_dir):
    return DataDir.open(tiny_data_dir).split("train")


def indices_of(updates):
    return [[batch.indices.tolist() for batch in update.batches] for update in updates]


def test_every_batch_stays_under_max_tokens_padding_included(train_set):
    for max_tokens, multiple in ((100, 1), (400, 8), (1000, 8)):
        batches = TrainingBatches(train_set, max_tokens, required_multiple=multiple)
        for epoch in (1, 2):
            updates = list(EpochIterator(train_set, batches, seed=1, epoch=epoch, prefetch=0))
            assert len(updates) == len(batches)
            seen = np.concatenate([update.batches[0].indices.numpy() for update in updates])
            assert sorted(seen.tolist()) == list(range(len(train_set)))  # each pair once per epoch
            for update in updates:
                (batch,) = update.batches
                assert batch.source.numel() <= max_tokens and batch.target.numel() <= max_tokens
                assert batch.target.ne(PAD_ID).sum() == update.num_tokens
        sizes = [len(b) for b in batches.epoch(seed=1, epoch=1)]
        assert sum(size % multiple == 0 for size in sizes) >= len(sizes) - 2  # a few odd ones at bucket ends


def test_max_sentences_and_too_long_sentences(train_set):
    assert max(len(b) for b in make_batches(train_set, 10_000, max_sentences=5)) == 5
    assert max(len(b) for b in TrainingBatches(train_set, 10_000, max_sentences=5).epoch(1, 1)) == 5
    longest = int(np.maximum(train_set.source.sizes, train_set.target.sizes).max())
    with pytest.raises(NmtError, match="--skip-invalid-size-inputs"):
        TrainingBatches(train_set, longest - 1)
    kept = np.concatenate(TrainingBatches(train_set, longest - 1, skip_too_long=True).epoch(1, 1))
    too_long = np.maximum(train_set.source.sizes, train_set.target.sizes) > longest - 1
    assert len(kept) == len(train_set) - too_long.sum() and not too_long[kept].any()


def test_pairs_over_the_models_positions_fail_before_training_or_are_skipped(train_set):
    sizes = np.maximum(train_set.source.sizes, train_set.target.sizes)
    limit = int(sizes.max()) - 1
    with pytest.raises(NmtError, match=f"over the model's max_positions {limit}; pass --skip-invalid-size-inputs"):
        TrainingBatches(train_set, 10_000, max_positions=limit)
    kept = np.concatenate(TrainingBatches(train_set, 10_000, skip_too_long=True, max_positions=limit).epoch(1, 1))
    assert len(kept) == (sizes <= limit).sum() and sizes[kept].max() <= limit
    TrainingBatches(train_set, 10_000, max_positions=limit + 1)  # the longest fits exactly


def test_batch_order_is_a_pure_function_of_seed_and_epoch(train_set):
    batches = TrainingBatches(train_set, 400)
    first = indices_of(EpochIterator(train_set, batches, seed=3, epoch=2))
    again = indices_of(EpochIterator(train_set, batches, seed=3, epoch=2, prefetch=0))
    assert first == again
    assert first != indices_of(EpochIterator(train_set, batches, seed=3, epoch=3))
    assert first != indices_of(EpochIterator(train_set, batches, seed=4, epoch=2))


def compositions(batches: list[np.ndarray]) -> set[frozenset[int]]:
    """Which sentences share a batch, whatever the order of the batches."""
    return {frozenset(batch.tolist()) for batch in batches}


def test_each_epoch_composes_its_batches_anew(train_set):
    batches = TrainingBatches(train_set, 400)
    first, second = compositions(batches.epoch(seed=1, epoch=1)), compositions(batches.epoch(seed=1, epoch=2))
    assert len(first & second) < len(first) // 2  # most batches hold other sentences than last epoch
    assert compositions(batches.epoch(seed=1, epoch=1)) == first  # and the same again for (seed, epoch)


def test_batches_mix_a_corpus_made_of_two_halves(tmp_path):
    # Two sub-corpora of 1000 pairs each, all of 10 tokens: length order with ties in corpus order
    # would fill each batch from one half.
    rng = np.random.default_rng(0)
    sentences = [list(rng.integers(4, 100, 9)) + [EOS_ID] for _ in range(2000)]
    for lang in ("en", "de"):
        write_token_array(tmp_path / f"train.{lang}", sentences, 100)
    train_set = ParallelDataset(TokenArray(tmp_path / "train.en"), TokenArray(tmp_path / "train.de"))
    batches = TrainingBatches(train_set, 200).epoch(seed=1, epoch=1)
    assert len(batches) == 100
    mixed = [batch for batch in batches if (batch < 1000).any() and (batch >= 1000).any()]
    assert len(mixed) > 0.9 * len(batches)


def test_ranks_share_the_epoch_like_update_freq(train_set):
    batches = TrainingBatches(train_set, 400)
    single = list(EpochIterator(train_set, batches, seed=1, epoch=1, update_freq=2, prefetch=0))
    ranks = [list(EpochIterator(train_set, batches, seed=1, epoch=1, world_size=2, rank=r, prefetch=0))
             for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == len(batches) // 2
    assert [len(update.batches) for update in single] == [2] * (len(batches) // 2) + [1] * (len(batches) % 2)
    for k, (a, b) in enumerate(zip(*ranks)):  # each pair of ranks' updates is one update of update_freq 2
        together = [a.batches[0].indices.tolist(), b.batches[0].indices.tolist()]
        assert together == [batch.indices.tolist() for batch in single[k].batches]
        assert a.num_tokens == b.num_tokens == single[k].num_tokens
        assert a.positions == [2 * k] and b.positions == [2 * k + 1] and single[k].positions == [2 * k, 2 * k + 1]


def test_resuming_from_a_position_gives_the_rest_of_the_epoch(train_set):
    batches = TrainingBatches(train_set, 400)
    whole = list(EpochIterator(train_set, batches, seed=1, epoch=5, update_freq=3))
    position = whole[2].position
    rest = EpochIterator(train_set, batches, seed=1, epoch=5, update_freq=3, start=position)
    assert indices_of(rest) == indices_of(whole[3:])
    assert rest.num_updates(position) == len(whole) - 3 and rest.num_updates() == len(whole)
    assert whole[-1].position == len(batches)


def test_prefetch_passes_errors_on_and_stops_early():
    def broken():
        yield 1
        raise NmtError("bad batch")

    items = prefetched(broken, 2)
    assert next(items) == 1
    with pytest.raises(NmtError, match="bad batch"):
        next(items)
    endless = prefetched(lambda: iter(range(10 ** 9)), 2)
    assert [next(endless) for _ in range(3)] == [0, 1, 2]
    endless.close()  # joins the producer thread; would hang if it did not stop
