"""The names users' code relies on, kept where the docs and the handler
template say they are, whatever the layout inside the package becomes."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from importlib.metadata import entry_points


def test_handler_errors_import_from_aserve_errors() -> None:
    from aserve.errors import (
        AserveError,
        DeadlineExceeded,
        InvalidArgument,
        NotFound,
        QueueFull,
        TooLarge,
        Unavailable,
    )

    for error in (InvalidArgument, NotFound, TooLarge, QueueFull, Unavailable, DeadlineExceeded):
        assert issubclass(error, AserveError)
    assert InvalidArgument("bad X").message == "bad X"


def test_the_batching_library_imports_from_aserve() -> None:
    import aserve
    from aserve.library import Batched, BatchFailed, NotSendable, Timeout

    assert aserve.Batched is Batched
    assert issubclass(Timeout, TimeoutError) and issubclass(NotSendable, TypeError)
    assert issubclass(BatchFailed, Exception)


def test_a_handlers_load_context_keeps_its_fields() -> None:
    from aserve.engines.python_handler import HandlerContext, Part

    fields = {f.name for f in dataclasses.fields(HandlerContext)}
    assert {
        "model_name", "model_version", "device", "instances", "base_dir", "path",
        "parameters", "inputs", "outputs", "role", "metrics",
    } <= fields  # fmt: skip
    assert {"name", "filename"} <= {f.name for f in dataclasses.fields(Part)}


def test_the_command_line_entry_points() -> None:
    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "aserve"]
    assert callable(script.load())
    result = subprocess.run(
        [sys.executable, "-m", "aserve", "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "serve" in result.stdout


def test_the_package_root_is_light() -> None:
    # `import aserve` (a client, the CLI) must not pull in torch or the server.
    code = "import sys, aserve; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
