"""The thread/process boundary: where a model's work leaves the event loop and comes back.

Layer: ``workers`` (above ``engines``, below ``loop``). The executors here
take a job from the loop, run it on an engine elsewhere, and answer it on
the loop. What runs where:

- loop: every executor's ``start``/``submit``/``stop`` and its supervision
  (:mod:`.thread_pool`, :mod:`.batch_process`, :mod:`.step_process`,
  :mod:`.step_executor`, :mod:`.supervisor`, :mod:`.pipe`), and the tiny CPU
  batches :mod:`.thread_pool` runs inline, on the loop's own thread;
- executor threads: the instance threads of :mod:`.thread_pool` and the step
  thread of :mod:`.step_executor`, which call back only through
  :mod:`.handoff`, the one place that reaches ``call_soon_threadsafe``;
- child processes: :mod:`.child`, which never imports asyncio;
- either side of a pipe: :mod:`.wire` (plain data, no pickle).

:mod:`.job` holds the one :class:`~.job.Executor` protocol the batchers
depend on, and the job types.
"""
