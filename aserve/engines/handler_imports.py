"""Handler modules, each folder's under a package of that folder's own.

One process has one ``sys.modules``. Were a handler folder's modules imported
under their own names (``handler``, ``helpers``), a handler that does
``import helpers`` would get whatever ``helpers`` another folder put there
first: the folder of the archive its model was replaced from (new content
is a new folder), or another model's project made from the same scaffold.
So the modules a folder holds are imported as submodules of a package of
its own, ``_aserve_handlers.f<id>``, whose ``__path__`` is the folder:
``handler.py`` is ``_aserve_handlers.f<id>.handler``. Their import
statements go through an ``__import__`` of that folder (in the modules'
``__builtins__``), which takes a name the folder holds from the folder's
package, and anything else (numpy, aserve, the standard library) as any
import does. This holds for imports inside functions at call time too, so
several models' handlers live in one process at once (the thread executor;
the front of the process executor) each with its own modules, and a model
still draining from an old folder keeps its own while the new one loads.

Nothing here holds a lock while user code runs, and sys.path is not touched:
a module whose import never returns holds only the import lock of its own
name (``importlib``'s, per module), so a later load from another folder (a
fixed archive) imports at once.

A folder whose modules changed on disk since they were imported (a project
folder edited between reloads) gets a new package (``f<id>_<n>``) and its
modules are imported afresh; the old modules stay where a running version
uses them. Modules are compiled from source at each import and no
``__pycache__`` is read or written: a ``.pyc`` is checked against its source's
mtime in whole seconds and its size, so an edit within the same second would
run the old code (and an archive's extracted folder stays as extracted).

What does not carry over from plain imports: a folder is not on sys.path,
so ``importlib.import_module("helpers")`` and a pickle that names a class by
its module (``handler.Net``) find nothing; ``__name__`` is the full name
(``logging.getLogger(__name__)`` is ``_aserve_handlers.f<id>.handler``). A
name of the standard library is never taken from the folder, and a module
the folder holds that this process imported already from that very file (the
folder is on sys.path, as the current directory may be) is used as it is.

Layer ``engines``; blocking (it runs user code): call off the loop.
"""

from __future__ import annotations

import builtins
import hashlib
import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType, ModuleType
from typing import Any

ROOT = "_aserve_handlers"

_lock = threading.Lock()  # the tables below; never held while user code runs
_current: dict[Path, _Folder] = {}  # folder -> the package its next import uses
_by_prefix: dict[str, _Folder] = {}  # every package made, old ones of edited folders too
_finder_installed = False


@dataclass
class _Folder:
    """One folder's package: where it is, its name, its ``__builtins__``."""

    path: Path
    prefix: str  # "_aserve_handlers.f<id>" (or "..._<n>" once the folder changed)
    builtins: dict[str, Any] = field(default_factory=dict)
    holds: dict[str, bool] = field(default_factory=dict)  # top-level name -> from the folder?
    stamps: dict[str, tuple[int, int]] = field(default_factory=dict)  # file -> mtime_ns, size

    def takes(self, top: str) -> bool:
        """Whether the top-level module ``top`` comes from this folder."""
        known = self.holds.get(top)
        if known is None:
            known = self.holds[top] = _holds(self.path, top)
        return known

    def modules(self) -> list[tuple[str, ModuleType]]:
        start = f"{self.prefix}."
        return [(k, m) for k, m in list(sys.modules.items()) if k.startswith(start)]


def import_from(folder: Path, name: str) -> ModuleType:
    """Module ``name`` (dotted) as ``folder``'s handlers see it: from the folder's
    package when the folder holds its top-level module, else the usual import.
    Raises what the import raises."""
    _install_finder()
    importlib.invalidate_caches()  # a file written since the last import is seen
    where = _folder(folder.resolve())
    if not where.takes(name.partition(".")[0]):
        return importlib.import_module(name)
    try:
        return importlib.import_module(f"{where.prefix}.{name}")
    finally:
        _stamp(where)


def _folder(path: Path) -> _Folder:
    """The package ``path``'s next import uses: the one before, unless one of its
    modules changed on disk since (then a new one); folders gone from disk (an
    archive's extraction, swept once no model used it) are forgotten."""
    with _lock:
        for gone in [f for f in _by_prefix.values() if not f.path.is_dir()]:
            _forget(gone)
        where = _current.get(path)
        if where is not None and not _changed(where):
            return where
        base = "f" + hashlib.sha256(os.fsencode(path)).hexdigest()[:16]
        prefix = f"{ROOT}.{base}"
        n = 0
        while prefix in _by_prefix:
            n += 1
            prefix = f"{ROOT}.{base}_{n}"
        where = _Folder(path, prefix)
        where.builtins = {**vars(builtins), "__import__": _importer(where)}
        _current[path] = _by_prefix[prefix] = where
        return where


def _forget(where: _Folder) -> None:
    for key, _ in where.modules():
        del sys.modules[key]
    sys.modules.pop(where.prefix, None)
    del _by_prefix[where.prefix]
    if _current.get(where.path) is where:
        del _current[where.path]


def _stamp(where: _Folder) -> None:
    """Note what the files of ``where``'s modules look like now (first seen)."""
    for _, module in where.modules():
        path = getattr(module, "__file__", None)
        if path and path not in where.stamps:
            where.stamps[path] = _stat(path)


def _changed(where: _Folder) -> bool:
    return any(_stat(path) != stamp for path, stamp in list(where.stamps.items()))


def _stat(path: str) -> tuple[int, int]:
    try:
        st = os.stat(path)
    except OSError:
        return (-1, -1)
    return (st.st_mtime_ns, st.st_size)


def _holds(folder: Path, top: str) -> bool:
    """Whether ``import top`` from ``folder``'s handlers means the folder's module.

    As when the folder is first on sys.path, a module or a regular package of
    the folder wins, and a folder that is only a namespace portion (no
    ``__init__.py``) loses to a module or a regular package found on sys.path.
    """
    if top in sys.stdlib_module_names or top == ROOT:
        return False
    spec = importlib.machinery.PathFinder.find_spec(top, [str(folder)])
    if spec is None:
        return False
    if spec.origin is None:  # a namespace portion
        return _found_elsewhere(top) is None
    here = sys.modules.get(top)
    there = getattr(here, "__file__", None)
    # That very file imported under its own name already (the folder is on sys.path).
    return not (there and os.path.realpath(there) == os.path.realpath(spec.origin))


def _found_elsewhere(top: str) -> str | None:
    module = sys.modules.get(top)
    if module is not None:
        return getattr(module, "__file__", None)
    spec = importlib.machinery.PathFinder.find_spec(top)
    return spec.origin if spec is not None else None


def _importer(where: _Folder) -> Any:
    """``__import__`` for ``where``'s modules: the folder's names from its package."""
    prefix = where.prefix

    def folder_import(
        name: str,
        globals: dict[str, Any] | None = None,
        locals: dict[str, Any] | None = None,
        fromlist: Sequence[str] | None = (),
        level: int = 0,
    ) -> ModuleType:
        if level == 0 and where.takes(name.partition(".")[0]):
            full = f"{prefix}.{name}"
            if fromlist:  # `from helpers import x`: the module itself, its fromlist loaded
                return builtins.__import__(full, globals, locals, fromlist, 0)
            # `import helpers.sub` binds the top-level module, here the folder's.
            importlib.import_module(full)
            return sys.modules[f"{prefix}.{name.partition('.')[0]}"]
        return builtins.__import__(name, globals, locals, fromlist, level)

    return folder_import


class _FolderLoader(importlib.machinery.SourceFileLoader):
    """A folder's source module: run with the folder's ``__import__``, compiled afresh."""

    def exec_module(self, module: ModuleType) -> None:
        top = module.__name__.split(".", 2)
        where = _by_prefix.get(".".join(top[:2]))
        if where is not None:
            module.__dict__["__builtins__"] = where.builtins
        super().exec_module(module)

    def get_code(self, fullname: str) -> CodeType:
        path = self.get_filename(fullname)
        return self.source_to_code(self.get_data(path), path)


class _PackageLoader(importlib.abc.Loader):
    """The empty packages ``_aserve_handlers`` and ``_aserve_handlers.f<id>``."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        pass


class _FolderFinder(importlib.abc.MetaPathFinder):
    """Finds ``_aserve_handlers`` and what is under it; nothing else."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname == ROOT:
            spec = importlib.machinery.ModuleSpec(ROOT, _PackageLoader(), is_package=True)
            spec.submodule_search_locations = []
            return spec
        if not fullname.startswith(f"{ROOT}."):
            return None
        where = _by_prefix.get(".".join(fullname.split(".", 2)[:2]))
        if where is None:
            return None
        if fullname == where.prefix:
            spec = importlib.machinery.ModuleSpec(fullname, _PackageLoader(), is_package=True)
            spec.submodule_search_locations = [str(where.path)]
            return spec
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and type(spec.loader) is importlib.machinery.SourceFileLoader:
            assert spec.origin is not None
            spec.loader = _FolderLoader(fullname, spec.origin)
        return spec


def _install_finder() -> None:
    global _finder_installed
    with _lock:
        if not _finder_installed:
            sys.meta_path.insert(0, _FolderFinder())
            _finder_installed = True
