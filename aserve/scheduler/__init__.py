"""Deadline-driven dynamic batching.

``policy`` is the pure core (queue state and clock in, decision out; tested
with a fake clock), ``latency`` keeps the per-batch-size run time estimates,
and ``batcher`` is the loop-side driver that owns the queue, the timers and
the hand-off to the model's executor threads.
"""
