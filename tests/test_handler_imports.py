"""Handler modules of several folders in one process: each folder's own modules.

A handler that imports a sibling module (``import helpers``) gets its own
folder's, whichever folder was imported before, at import time and inside
its functions at call time; a folder edited in place is imported afresh while
what was imported before keeps its code; a module whose import never returns
holds up no other folder's import. Real files, real imports, no mocks.
"""

from __future__ import annotations

import sys
import threading
import types
from pathlib import Path

import pytest

from aserve.engines.python_handler import HandlerImportError, import_handler

pytestmark = pytest.mark.timeout(60)

METHODS = (
    "    def load(self, c): pass\n    def preprocess(self, r): pass\n"
    "    def infer(self, b): pass\n    def postprocess(self, o, r): pass\n"
)


def _project(folder: Path, value: str, handler: str | None = None) -> Path:
    """``folder`` with ``helpers.py`` (VALUE) and a ``handler.py`` that imports it at
    import time (``AT_IMPORT``) and inside a method at call time (``later()``)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "helpers.py").write_text(f"VALUE = {value!r}\n")
    (folder / "handler.py").write_text(
        handler
        or (
            "import helpers\n"
            "class H:\n"
            "    AT_IMPORT = helpers.VALUE\n"
            "    def later(self):\n"
            "        import helpers\n"
            "        from helpers import VALUE\n"
            "        assert VALUE == helpers.VALUE\n"
            "        return helpers.VALUE\n" + METHODS
        )
    )
    return folder


def test_two_folders_with_the_same_module_names_each_import_their_own(tmp_path: Path):
    """Before: B's handler was A's module ('handler' from sys.modules), or with A's
    handler gone, B's handler with A's helpers.py (VALUE 'a')."""
    a = import_handler("handler:H", _project(tmp_path / "a", "a"))
    b = import_handler("handler:H", _project(tmp_path / "b", "b"))
    assert (a.AT_IMPORT, b.AT_IMPORT) == ("a", "b")
    # At call time too, after both were imported, in either order.
    assert (b().later(), a().later()) == ("b", "a")
    # Imported again (a config check, another load): still each folder's own.
    assert import_handler("handler:H", tmp_path / "a") is a
    assert import_handler("handler:H", tmp_path / "b") is b


def test_a_sibling_edited_in_place_is_imported_afresh(tmp_path: Path):
    """Before: only the handler module's own file was looked at; an edited
    helpers.py stayed as first imported."""
    folder = _project(tmp_path / "p", "old")
    old = import_handler("handler:H", folder)
    assert import_handler("handler:H", folder) is old  # nothing changed: the same class
    (folder / "helpers.py").write_text("VALUE = 'new, and longer'\n")
    new = import_handler("handler:H", folder)
    assert new is not old and new.AT_IMPORT == "new, and longer"
    assert new().later() == "new, and longer"
    # What was imported before (a version still draining) keeps its own modules.
    assert old.AT_IMPORT == "old" and old().later() == "old"


def test_a_module_that_never_returns_holds_up_no_other_folder(tmp_path: Path):
    """Before: one lock around every handler import, and the module's name taken
    by the import in progress: the second folder's import waited for the first."""
    gate = types.ModuleType("hang_gate_for_test")
    gate.started, gate.release = threading.Event(), threading.Event()  # type: ignore[attr-defined]
    sys.modules[gate.__name__] = gate
    stuck = _project(
        tmp_path / "stuck", "stuck",
        "import hang_gate_for_test as gate\n"
        "gate.started.set()\n"
        "gate.release.wait()\n"  # the import does not return until the test ends
        "class H:\n" + METHODS,
    )  # fmt: skip
    first = threading.Thread(target=import_handler, args=("handler:H", stuck), daemon=True)
    first.start()
    try:
        assert gate.started.wait(30), "the first import never began"
        done: list[type] = []
        second = threading.Thread(
            target=lambda: done.append(import_handler("handler:H", _project(tmp_path / "ok", "ok")))
        )
        second.start()
        second.join(30)
        assert done and done[0].AT_IMPORT == "ok", "the second folder's import waited"
    finally:
        gate.release.set()
        first.join(30)
        del sys.modules[gate.__name__]


def test_what_the_folder_does_not_hold_comes_from_sys_path(tmp_path: Path):
    folder = _project(
        tmp_path / "p", "x",
        "import json\nimport numpy as np\nfrom aserve.errors import InvalidArgument\n"
        "class H:\n    MODULES = (json, np, InvalidArgument)\n" + METHODS,
    )  # fmt: skip
    (folder / "json.py").write_text(
        "raise RuntimeError('a standard module is never the folder's')\n"
    )
    import json

    import numpy as np

    from aserve.errors import InvalidArgument

    assert import_handler("handler:H", folder).MODULES == (json, np, InvalidArgument)
    with pytest.raises(HandlerImportError, match="cannot import module 'nothere'"):
        import_handler("nothere:H", folder)


def test_packages_and_namespace_packages_of_the_folder(tmp_path: Path):
    for name, init in (("regular", True), ("spaced", False)):
        folder = tmp_path / name
        (folder / "pkg" / "sub").mkdir(parents=True)
        if init:
            (folder / "pkg" / "__init__.py").write_text("")
        (folder / "pkg" / "sub" / "util.py").write_text(f"WHO = {name!r}\n")
        (folder / "pkg" / "mod.py").write_text(
            "from .sub import util\nimport pkg.sub.util as absolute\n"
            "class Tok:\n    WHO = (util.WHO, absolute.WHO)\n" + METHODS
        )
        assert import_handler("pkg.mod:Tok", folder).WHO == (name, name)


def test_nothing_is_written_beside_the_modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """An archive's extracted folder stays as it was extracted: no __pycache__,
    even where Python writes bytecode."""
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    folder = _project(tmp_path / "p", "x")
    import_handler("handler:H", folder)
    assert sorted(p.name for p in folder.iterdir()) == ["handler.py", "helpers.py"]
