"""``QueueBound``: a subscriber's queue in batches, kept within a number of bytes."""

from __future__ import annotations

import random

from kvstore.events import QueueBound


def test_the_queue_fits_the_largest_recent_batch() -> None:
    rng = random.Random(3)
    bound = QueueBound(1 << 20, 100)
    sizes: list[int] = []
    for seq in range(5000):
        size = rng.choice((10, 1000, 30_000, 200_000, 3 << 20)) if rng.random() < 0.1 \
            else rng.randint(1, 5000)
        sizes.append(size)
        before = bound.limit
        changed = bound.fit(seq, size)
        assert changed == (bound.limit if bound.limit != before else 0)
        largest = max(sizes[-100:])
        due = max(1, min(100, (1 << 20) // largest))
        # never longer than the bytes allow (shortened at once), and lengthened once
        # twice as long is due, or the cap
        assert bound.limit == due or bound.limit < due < min(2 * bound.limit, 100)


def test_a_batch_larger_than_the_bytes_leaves_a_queue_of_one() -> None:
    bound = QueueBound(1000, 50)
    assert bound.fit(0, 10) == 0 and bound.limit == 50
    assert bound.fit(1, 5000) == 1
    for seq in range(2, 51):
        bound.fit(seq, 10)
        assert bound.limit == 1  # still in the window
    assert bound.fit(51, 10) == 50  # it left: the cap again
