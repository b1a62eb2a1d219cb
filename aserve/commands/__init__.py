"""The ``aserve`` subcommands, one module each (``aserve/cli.py`` dispatches)."""
