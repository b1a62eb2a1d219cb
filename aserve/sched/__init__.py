"""The pure scheduling core: batching and step decisions, latency estimates.

Layer: ``sched`` (above ``errors``/``types``, below ``engines``). Nothing here
touches asyncio or reads a clock it is not given, so tests drive it with
plain numbers and a fake clock. ``policy`` decides when to cut a batch,
``latency`` keeps the per-batch-size run time estimates and the admission
margin, ``step_policy`` forms a decoder model's next step. The loop-side
drivers are :mod:`aserve.loop.batcher` and :mod:`aserve.loop.continuous`.
"""
