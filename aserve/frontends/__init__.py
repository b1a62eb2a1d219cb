"""Wire protocols on the shared loop (frontends layer): http/ (aiohttp: KServe V2
REST, OpenAI, Triton generate, ...), grpc/ (grpc.aio: KServe V2, generation,
health), and what both share: common.py (the deadline rule, admission and
counting), status.py (error code -> status), auth.py, model_config.py, and
context.py: frontends see the server through its :class:`FrontendContext`."""
