"""Plain data of the wire and the engines, below every other layer but ``errors``.

Nothing here imports torch, asyncio or any other aserve layer, so the codecs,
the streaming channel and the frontends can use these types on a Python
without torch. Pure values and functions: they run wherever they are called.

- ``tensors``: KServe V2 datatypes and numpy dtypes, the one dtype/shape check
- ``generation``: what a generation request asks for (and the bounds of its
  sampling settings) and what its steps produce
- ``text``: strings from outside the server's code made safe to encode as
  UTF-8 (lone surrogates as U+FFFD)
"""
