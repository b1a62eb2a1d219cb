"""Wire protocols on the shared loop: the aiohttp app (KServe V2 REST)."""
