"""The online batcher's pure rules: the queue, the triggers, batch formation. No torch."""

import random

import numpy as np
import pytest

from pipeline.online.rules import BatchRules, QueuedRequest, RequestQueue, check_timeouts, retry_after_s


def request(number: int, padded_length: int, arrived: float | None = None) -> QueuedRequest:
    return QueuedRequest(number, np.ones(padded_length, np.int32), False, padded_length,
                         arrived=float(number) if arrived is None else arrived, deadline=1e9, sequence=number)


def queue_of(*lengths: int) -> RequestQueue:
    queue = RequestQueue()
    for number, length in enumerate(lengths):
        queue.push(request(number, length))
    return queue


def ids(batch) -> list:
    return [r.request_id for r in batch]


def test_a_batch_takes_the_oldest_requests_bucket_then_the_nearest_lengths():
    queue = queue_of(40, 8, 40, 200, 48, 8, 40)
    rules = BatchRules(max_batch_size=4, max_batch_tokens=None, batch_timeout_s=0.02)
    assert ids(queue.take_batch(rules)) == [0, 2, 6, 4]  # the 40s in order, then 48 (distance 8 < 32)
    assert ids(queue.take_batch(rules)) == [1, 5, 3]  # the oldest left is an 8: both 8s, then what is left
    assert len(queue) == 0 and queue.padded_tokens == 0


def test_a_request_that_does_not_fit_keeps_the_head_of_its_bucket():
    queue = queue_of(16, 64, 64, 16)
    rules = BatchRules(max_batch_size=8, max_batch_tokens=128, batch_timeout_s=0.02)
    # 16, 16 (32 tokens); a 64 would make 3 × 64 = 192 > 128 tokens: it waits, FIFO within its bucket
    assert ids(queue.take_batch(rules)) == [0, 3]
    assert ids(queue.take_batch(rules)) == [1, 2]  # 2 × 64 = 128


def test_a_batch_formed_earlier_is_topped_up_around_its_first_requests_length():
    queue = queue_of(40, 40)
    rules = BatchRules(max_batch_size=4, max_batch_tokens=None, batch_timeout_s=0.02)
    formed = queue.take_batch(rules)  # goes to the device once it is free; meanwhile more arrive
    for number, length in ((2, 8), (3, 48), (4, 40), (5, 40)):
        queue.push(request(number, length))
    assert ids(queue.take_batch(rules, formed)) == [0, 1, 4, 5]  # its own bucket first, FIFO
    assert ids(queue.take_batch(rules)) == [2, 3]
    assert queue.take_batch(rules, []) == []


def test_batches_never_exceed_the_memory_plans_rows_for_their_padded_length():
    queue = queue_of(*([100] * 10))
    rules = BatchRules(max_batch_size=64, max_batch_tokens=None, batch_timeout_s=0.02,
                       memory_rows=lambda length: 3 if length > 64 else 50)
    assert [len(queue.take_batch(rules)) for _ in range(4)] == [3, 3, 3, 1]


def test_triggers_size_tokens_and_the_oldest_requests_window():
    rules = BatchRules(max_batch_size=3, max_batch_tokens=100, batch_timeout_s=0.05)
    assert RequestQueue().due_in(0.0, rules) is None
    queue = RequestQueue()
    queue.push(request(0, 8, arrived=10.0))
    assert queue.due_in(10.01, rules) == pytest.approx(0.04)
    assert queue.due_in(10.2, rules) == 0.0  # the window has passed
    queue.push(request(1, 8, arrived=10.01))
    queue.push(request(2, 8, arrived=10.02))
    assert queue.due_in(10.02, rules) == 0.0 and queue.full(rules) == "size"  # three requests: full
    tokens = RequestQueue()
    tokens.push(request(0, 64, arrived=10.0))
    tokens.push(request(1, 40, arrived=10.0))
    assert tokens.due_in(10.0, rules) == 0.0 and tokens.full(rules) == "tokens"  # 104 padded tokens ≥ 100


def test_removing_a_request_keeps_the_counts_and_the_others_order():
    queue = queue_of(8, 8, 8)
    middle = queue.oldest()
    assert queue.remove(middle) and not queue.remove(middle)
    assert len(queue) == 2 and queue.padded_tokens == 16
    assert ids(queue.take_batch(BatchRules(8, None, 0.02))) == [1, 2]


def test_random_queues_take_every_request_once_in_fifo_order_within_capacity():
    generator = random.Random(0)
    for _ in range(200):
        lengths = [generator.choice([8, 16, 24, 64, 128, 256]) for _ in range(generator.randint(1, 60))]
        rules = BatchRules(max_batch_size=generator.choice([1, 4, 16]),
                           max_batch_tokens=generator.choice([None, 256, 1024]), batch_timeout_s=0.02,
                           memory_rows=lambda length: max(1, 2048 // length))
        queue = queue_of(*lengths)
        taken = []
        while len(queue):
            oldest = queue.oldest().request_id
            batch = queue.take_batch(rules)
            padded = max(r.padded_length for r in batch)
            assert oldest in ids(batch)  # the oldest request always goes
            assert len(batch) <= rules.capacity(padded)
            taken.extend(ids(batch))
        assert sorted(taken) == list(range(len(lengths)))
        for length in set(lengths):  # FIFO within each bucket
            order = [number for number in taken if lengths[number] == length]
            assert order == sorted(order)


def test_a_request_larger_than_any_batch_is_refused_with_the_reason():
    rules = BatchRules(max_batch_size=8, max_batch_tokens=64, batch_timeout_s=0.02,
                       memory_rows=lambda length: 0 if length > 32 else 4)
    assert "max_batch_tokens 64" in rules.refusal(128)
    assert "memory plan allows no batch of padded length 48" in rules.refusal(48)
    assert rules.refusal(32) is None


def test_retry_after_is_the_time_to_serve_the_queue_and_at_least_one_window():
    assert retry_after_s(2000, 4000.0, 0.02) == pytest.approx(0.5)
    assert retry_after_s(10, 4000.0, 0.02) == pytest.approx(0.02)
    assert retry_after_s(10, None, 0.02) == pytest.approx(0.02)


def test_a_request_timeout_must_exceed_the_batch_timeout():
    check_timeouts(20, 21)
    with pytest.raises(ValueError, match="not more than the batch timeout of 20 ms: a lone request would expire"):
        check_timeouts(20, 20)


def test_the_batcher_settles_its_token_budget_as_run_does_without_a_sweep():
    from pipeline.core.batch_setting import resolve_batch_setting
    from pipeline.core.settings import cuda_batch_tokens, device_batch_limit
    from pipeline.online.config import BatcherConfig

    class MiniLMShape:
        hidden_size, num_hidden_layers = 384, 6

    def tokens(config, device):
        return resolve_batch_setting(config.batch, device, None, ("max_batch_tokens",), MiniLMShape())[0].max_batch_tokens

    assert tokens(BatcherConfig.of(), "cpu") == device_batch_limit("cpu", "max_batch_tokens") == 2048
    assert tokens(BatcherConfig.of(), "cuda") == cuda_batch_tokens(384, 6) == 262144  # the model's size, as run
    assert tokens(BatcherConfig.of(max_batch_tokens=512), "cuda") == 512
    assert BatcherConfig.of().max_batch_size == 32
