"""The asyncio core: requests, the thread-to-loop handoff, model runtimes and the server lifecycle.

Everything in this package runs on the event loop, except ``handoff.py``,
whose functions are the only ones executor threads may call, and
``runtimes/handler_threads.py``, which runs on a handler model's own threads
(its user's pre- and postprocessing).
"""
