"""The quick start (docs/getting-started.md), run as written: a model file served
in one command, and a handler project scaffolded, archived and served; and the
README's first commands, which are the page's.

Each step's commands are read out of the page's bash block under its heading.
What a test must change to run beside others is only where things live: files
go to a temporary folder, ``.venv/bin/`` is this interpreter's environment, and
servers take a free port (``--port 0 --no-grpc``).
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import start_server

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "getting-started.md"


def _block(heading: str) -> list[str]:
    """The commands of the bash block under ``heading``, continuation lines joined."""
    page = PAGE.read_text()
    m = re.search(re.escape(heading) + r"\n.*?```bash\n(.*?)```", page, re.S)
    assert m, f"the quick start's step {heading!r} is gone"
    joined = m.group(1).replace("\\\n", " ")
    return [re.sub(r"\s+#.*$", "", line).strip() for line in joined.splitlines() if line.strip()]


def _argv(command: str) -> list[str]:
    """A quick start command as an argv, ``.venv/bin/X`` being this environment's."""
    words = shlex.split(command)
    tool = words[0].removeprefix(".venv/bin/")
    return [sys.executable] + (["-m", "aserve"] if tool == "aserve" else []) + words[1:]


def _post(url: str, body: str) -> dict:
    request = urllib.request.Request(url, data=body.encode(), method="POST")
    with urllib.request.urlopen(request, timeout=30) as r:
        assert r.status == 200
        return json.loads(r.read())


def _curl(command: str, port: int) -> tuple[str, str]:
    """The URL (on ``port``) and body of a ``curl -s URL -d 'BODY'`` line."""
    words = shlex.split(command)
    assert words[:2] == ["curl", "-s"] and words[3] == "-d", command
    url = words[2].replace("localhost:8000", f"127.0.0.1:{port}")
    return f"http://{url}", words[4]


def test_the_quick_start_keeps_its_steps_in_order() -> None:
    """The two commands, a model file served, a streamed chat on the offline decoder,
    then a handler project scaffolded, archived and served: in this order, before the
    wheel."""
    page = PAGE.read_text()
    start = page.index("## Two commands")
    quick_start = page[start : page.index("\n## Installing the wheel", start)]
    steps = ["scripts/serve\n", "scripts/test\n", "aserve serve models/linear.pt2",
             "/v1/chat/completions", "aserve new demo", "aserve archive demo",
             "aserve serve demo.aserve"]  # fmt: skip
    where = [quick_start.find(step) for step in steps]
    assert -1 not in where, dict(zip(steps, where, strict=True))
    assert where == sorted(where), dict(zip(steps, where, strict=True))


def test_a_model_file_served_in_one_command(tmp_path: Path) -> None:
    make, serve, curl = _block("## Your own model file, in one command")
    assert make.startswith("mkdir -p models && .venv/bin/python -c"), make
    (tmp_path / "models").mkdir()
    python = _argv(make.split("&& ", 1)[1])
    subprocess.run(python, cwd=tmp_path, check=True, timeout=120)
    argv = _argv(serve)[3:]  # after: python -m aserve
    assert argv[:2] == ["serve", "models/linear.pt2"], serve
    argv[1] = str(tmp_path / argv[1])
    server = start_server(None, argv=[*argv, "--port", "0", "--no-grpc"])
    try:
        url, body = _curl(curl, server.port)
        out = _post(url, body)["outputs"][0]
        model = torch.export.load(str(tmp_path / "models" / "linear.pt2")).module()
        x = np.array(json.loads(body)["inputs"][0]["data"], np.float32).reshape(1, 4)
        want = model(torch.from_numpy(x)).detach().numpy().ravel()
        assert out["name"] == "OUTPUT0" and out["shape"] == [1, 2]
        np.testing.assert_allclose(out["data"], want, rtol=1e-5, atol=1e-6)
    finally:
        server.stop()


def test_a_handler_project_archived_and_served(tmp_path: Path) -> None:
    new, archive, serve, curl = _block("## A handler project, archived and served")
    for command in (new, archive):
        subprocess.run(_argv(command), cwd=tmp_path, check=True, timeout=180)
    assert (tmp_path / "demo.aserve").is_file()
    argv = _argv(serve)[3:]
    assert argv == ["serve", "demo.aserve"], serve
    argv[1] = str(tmp_path / argv[1])
    server = start_server(
        None,
        argv=[*argv, "--port", "0", "--no-grpc"],
        extra_env={"ASERVE_CACHE_DIR": str(tmp_path / "cache")},
    )
    try:
        url, body = _curl(curl, server.port)
        outputs = {o["name"]: o for o in _post(url, body)["outputs"]}
        assert outputs["LABEL"]["data"] == ["setosa"]  # the iris example the scaffold trains
        assert sum(outputs["PROBABILITIES"]["data"]) == pytest.approx(1.0, abs=1e-5)
    finally:
        server.stop()


def test_the_readme_shows_the_quick_starts_first_commands() -> None:
    """The README's commands and answers (the two commands, one request, a streamed
    one) are the quick start's, in its order: what the tests here and in
    test_builtin_tiny_gpt2.py run from the page is what the README shows."""
    readme = (ROOT / "README.md").read_text()
    page = PAGE.read_text()
    blocks = re.findall(r"```(?:bash|json|)\n(.*?)```", readme, re.S)
    assert len(blocks) >= 6, "the README's commands are gone"
    where = [page.find(block) for block in blocks if not block.startswith(".venv/bin/mkdocs")]
    assert -1 not in where, [b for b in blocks if b not in page]
    assert where == sorted(where), "the README shows the quick start's commands out of order"
    for link in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (ROOT / link).is_file(), f"the README links to {link}, which is not there"
