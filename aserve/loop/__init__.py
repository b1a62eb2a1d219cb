"""The asyncio core: requests, batchers, token channels, model runtimes, reloads.

Layer ``loop``: above ``workers``, below ``frontends`` (the server's lifecycle
is :mod:`aserve.server`).

Everything in this package runs on the event loop, except
``runtimes/handler_threads.py``, which runs on a handler model's own threads
(its user's pre- and postprocessing). The thread-to-loop handoff, the only
code executor threads may call, is :mod:`aserve.workers.handoff`.
"""
