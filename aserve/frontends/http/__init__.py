"""The aiohttp frontend (frontends layer, on the loop): app.py registers the
route modules beside it and hands them a kit (kit.py); they never import it."""
