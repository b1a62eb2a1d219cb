"""Checks of a config that need more than the config: files, engines, handler modules.

In the ``engines`` layer, not in ``config``: it asks the engines what this
machine can serve and imports python handlers, so the config package itself
never imports it; the CLI, the commands, the server and a reload do.
Blocking, and it imports user code: call it before the server starts or off
the loop (a reload runs it in a thread).
"""

from __future__ import annotations

from pathlib import Path

from aserve.config.load import ConfigError
from aserve.config.paths import PREFIX
from aserve.config.schema import ServerConfig
from aserve.engines.builtin import BUILDERS
from aserve.engines.python_handler import HandlerImportError, import_handler
from aserve.engines.requirements import engine_problem


def check_model_files(config: ServerConfig, base_dir: Path) -> None:
    """Every model's ``path`` must exist (relative paths resolve against ``base_dir``),
    and every python handler must import. Blocking (imports user code): call off the loop."""
    problems = []
    # Two folders may hold modules of the same names (two archives' handler.py):
    # each folder's are imported under a package of its own (handler_imports).
    for i, m in enumerate(config.models):
        folder = m.folder(base_dir)
        if m.path is None:
            pass
        elif m.path.startswith(PREFIX):
            name = m.path[len(PREFIX) :]
            builtin = BUILDERS.get(name)
            if builtin is None:
                known = ", ".join(sorted(BUILDERS))
                problems.append(
                    f"models[{i}].path: unknown builtin model '{name}' (known: {known})"
                )
            elif builtin.engine != m.engine:
                problems.append(
                    f"models[{i}].engine: '{m.path}' is served by the {builtin.engine} engine "
                    f"(got '{m.engine}')"
                )
        elif m.engine == "decoder":
            if not (folder / m.path / "config.json").is_file():
                problems.append(
                    f"models[{i}].path: not a model folder (no config.json): {folder / m.path}"
                )
        elif not (folder / m.path).is_file():
            problems.append(f"models[{i}].path: file not found: {folder / m.path}")
        problem = engine_problem(m.engine, m.device)
        if problem:
            problems.append(f"models[{i}].engine: {problem}")
        if m.handler is not None:
            try:
                import_handler(m.handler, folder, m.decoupled)
            except HandlerImportError as exc:
                problems.append(f"models[{i}].handler: {exc}")
    if problems:
        raise ConfigError("invalid config\n  " + "\n  ".join(problems))
