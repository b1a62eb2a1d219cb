"""The asyncio core: requests, batchers, model runtimes and the server lifecycle.

Everything in this package runs on the event loop. The thread-to-loop
handoff, the only code executor threads may call, is
:mod:`aserve.workers.handoff`.
"""
