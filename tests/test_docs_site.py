"""The documentation site: what its generated reference holds, and that it builds offline.

``mkdocs build --strict`` (in scripts/test, and here) fails on a broken link or
anchor and on a page left out of the nav. What it cannot see is checked here:
that the config reference has a row, with a description, for every key of
``ServerConfig``'s tree (pydantic's own JSON schema says which keys there are),
that the CLI reference lists every flag of every command, that the errors
table maps every code as the frontends do, and that the built pages reference
no outside host (no web fonts, scripts or links: the site is read offline).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from aserve.cli import _parser
from aserve.config.schema import ServerConfig
from aserve.errors import ErrorCode
from aserve.frontends.status import STATUS

ROOT = Path(__file__).resolve().parents[1]

# Keys the schema does not describe yet: no docstring, no comment, and no sentence of
# their block's docstring names them. Drop one as aserve/config/schema.py documents it;
# a new key must come with its text.
UNDESCRIBED: set[str] = set()
# Flags without help text, as above for aserve's parsers.
HELPLESS: set[tuple[str, str]] = set()


@pytest.fixture(scope="module")
def reference() -> ModuleType:
    """scripts/docs_reference.py, the hook mkdocs runs, imported by its path."""
    spec = importlib.util.spec_from_file_location(
        "docs_reference", ROOT / "scripts" / "docs_reference.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _section(page: str, anchor: str) -> str:
    """The ``## ... {#anchor}`` section of a generated page, up to the next one."""
    for part in re.split(r"^## ", page, flags=re.MULTILINE):
        if part.split("\n", 1)[0].endswith(f"{{#{anchor}}}"):
            return part
    raise AssertionError(f"no section {{#{anchor}}} in the generated page")


def test_config_reference_has_every_key_with_its_description(reference: ModuleType) -> None:
    page = reference.config_reference()
    schema = ServerConfig.model_json_schema()
    blocks = {"ServerConfig": schema, **schema["$defs"]}
    models = {m.__name__: m for m in reference.config_models()}
    assert set(models) == set(blocks), "the generated page's blocks are not the schema's"
    missing, described_now = [], []
    for name, block in blocks.items():
        section = _section(page, name.lower())
        descriptions = reference.field_descriptions(models[name])
        for key in block["properties"]:
            row = re.search(rf"^\| `{re.escape(key)}` \|.*\|(.*)\|$", section, re.MULTILINE)
            assert row, f"the config reference has no row for {name}.{key}"
            text = row.group(1).strip()
            assert text == reference._cell(descriptions[key]), (
                f"{name}.{key}: not the schema's text"
            )
            if f"{name}.{key}" in UNDESCRIBED:
                if text:
                    described_now.append(f"{name}.{key}")
            elif not text:
                missing.append(f"{name}.{key}")
    assert not missing, (
        f"{missing}: no description; give each a docstring in aserve/config/schema.py"
    )
    assert not described_now, f"{described_now} are described now: drop them from UNDESCRIBED"


def test_config_reference_types_and_defaults(reference: ModuleType) -> None:
    """A few rows read as a config writer needs them: JSON types, bounds, JSON defaults."""
    page = reference.config_reference()
    http = _section(page, "httpconfig")
    assert "| `port` | integer (>= 0, <= 65535) | `8000` | 0 picks a free port |" in http
    top = _section(page, "serverconfig")
    assert "| `grpc` | [GrpcConfig](#grpcconfig) or null | `null` |" in top
    assert "| `models` | list of [ModelConfig](#modelconfig) | `[]` |" in top
    model = _section(page, "modelconfig")
    assert re.search(r"^\| `engine` \| one of `\"torch\"`, .* \| required \|", model, re.MULTILINE)
    queue = _section(page, "queuepolicy")
    assert "Also at `models[].batching.priority_queue_policy.*`." in queue


def _commands() -> dict[str, argparse.ArgumentParser]:
    root = _parser()
    found = {"aserve": root}
    for action in root._actions:
        if isinstance(action, argparse._SubParsersAction):
            found.update({f"aserve {n}": p for n, p in action.choices.items()})
    return found


def test_cli_reference_has_every_command_and_flag(reference: ModuleType) -> None:
    page = reference.cli_reference()
    commands = _commands()
    assert {"aserve serve", "aserve ps", "aserve new", "aserve archive"} <= set(commands)
    helpless = set()
    for title, parser in commands.items():
        section = _section(page, title.replace(" ", "-"))
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue
            name = action.option_strings[-1] if action.option_strings else action.metavar
            assert f"`{name}`" in section, f"{title}: {name} is not in the CLI reference"
            if not action.help:
                helpless.add((title, name))
    assert helpless <= HELPLESS, f"{sorted(helpless - HELPLESS)}: flags without help"
    assert HELPLESS <= helpless, f"{sorted(HELPLESS - helpless)} have help now: drop them"


def test_errors_table_maps_every_code_as_the_frontends_do(reference: ModuleType) -> None:
    table = reference.errors_reference()
    for code in ErrorCode:
        wire = STATUS[code]
        row = re.search(
            rf"^\| `{code.value}` \| `\w+` \| (\d+) \| `(\w+)` \| (.+) \|$", table, re.MULTILINE
        )
        assert row, f"no row for {code.value}"
        assert (int(row.group(1)), row.group(2)) == (wire.http, wire.grpc.name)
        assert row.group(3).strip(), f"{code.value}: no meaning (its comment in errors.py)"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built as scripts/test builds it (--strict: any warning fails)."""
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def test_site_builds_with_the_references_in_it(site: Path) -> None:
    pages = sorted(site.rglob("*.html"))
    assert len(pages) > 10
    for page in pages:
        assert "<!-- reference:" not in page.read_text(encoding="utf-8"), page
    config = (site / "reference" / "config" / "index.html").read_text(encoding="utf-8")
    for anchor in ("serverconfig", "modelconfig", "batchingconfig", "generationconfig"):
        assert f'id="{anchor}"' in config
    assert 'id="aserve-serve"' in (site / "reference" / "cli" / "index.html").read_text(
        encoding="utf-8"
    )
    assert "queue_full" in (site / "errors" / "index.html").read_text(encoding="utf-8")
    # ARCHITECTURE.md stays at the root; the site includes it (pymdownx.snippets).
    architecture = (site / "architecture" / "index.html").read_text(encoding="utf-8")
    assert 'id="the-layers"' in architecture and "--8&lt;--" not in architecture


# An address on another host: http://, https:// or protocol-relative //, in an attribute
# or a stylesheet's url().
_OUTSIDE = re.compile(r"""(?:\b(?:href|src|content)\s*=\s*["']?|url\(\s*["']?)(?:https?:)?//""")


def test_site_references_no_outside_host(site: Path) -> None:
    """Every page, stylesheet and link stays in the site: no web fonts, CDNs or links out."""
    offending = []
    for path in [*site.rglob("*.html"), *site.rglob("*.css")]:
        text = path.read_text(encoding="utf-8")
        for match in _OUTSIDE.finditer(text):
            offending.append(f"{path.relative_to(site)}: {text[match.start() : match.end() + 60]}")
    assert not offending, "\n".join(offending)
