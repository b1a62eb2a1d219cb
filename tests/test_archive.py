"""``aserve archive`` and serving ``.aserve`` files: the scaffold packed, served through a
config entry, and hostile archives (tampered, zip slip, symlink, bomb) refused by name."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import aiohttp
import pytest
from archive_helpers import ROWS, aserve, listed, rebuild
from archive_helpers import env as _env
from conftest import start_server, write_config
from helpers import v2_body
from reload_helpers import config_status, rewrite_config, wait_attempts
from stall_watch import watch_loop

from aserve.config import archive
from aserve.config.archive import ArchiveError, serve_config


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("archive")


@pytest.fixture(scope="module")
def project(work: Path) -> Path:
    made = aserve("new", "demo", cwd=work)
    assert made.returncode == 0, made.stderr
    return work / "demo"


@pytest.fixture(scope="module")
def packed(work: Path, project: Path) -> Path:
    """The scaffold, tested and packed by the real command."""
    done = aserve("archive", "demo", "-o", "demo.aserve", cwd=work)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "4 passed" in done.stdout and "wrote demo.aserve" in done.stdout
    return work / "demo.aserve"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("ASERVE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


# --- packing ------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_the_archive_holds_the_project_and_a_manifest_of_it(packed: Path, project: Path) -> None:
    with zipfile.ZipFile(packed) as zf:
        names = zf.namelist()
        manifest = json.loads(zf.read(archive.MANIFEST))
    assert manifest["config"] == "config.json" and manifest["format"] == archive.FORMAT
    from aserve import __version__

    assert manifest["aserve_version"] == __version__
    members = {m["path"]: m for m in manifest["members"]}
    assert set(members) == {"handler.py", "config.json", "client.py", "requirements.txt",
                            "tests/test_handler.py"}  # fmt: skip
    assert sorted(names) == sorted([*members, archive.MANIFEST])  # no caches the tests left
    for name, m in members.items():
        data = (project / name).read_bytes()
        assert m == {"path": name, "sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}


@pytest.mark.timeout(300)
def test_failing_tests_write_no_archive(work: Path, project: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(project, broken, ignore=shutil.ignore_patterns("__pycache__"))
    handler = broken / "handler.py"
    handler.write_text(
        handler.read_text().replace('"setosa", "versicolor"', '"versicolor", "setosa"')
    )
    done = aserve("archive", str(broken), "-o", str(tmp_path / "broken.aserve"), cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "failed" in done.stdout  # pytest's own report
    assert (
        "tests of" in done.stderr and "failed" in done.stderr and "nothing written" in done.stderr
    )
    assert not (tmp_path / "broken.aserve").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@pytest.mark.timeout(120)
def test_without_pytest_it_asks_for_skip_tests(project: Path, tmp_path: Path) -> None:
    # pytest made unimportable in the command's process (sys.modules[name] = None).
    code = "import sys; sys.modules['pytest'] = None; from aserve.cli import main; sys.exit(main(sys.argv[1:]))"
    out = tmp_path / "p.aserve"
    run = subprocess.run(
        [sys.executable, "-c", code, "archive", str(project), "-o", str(out)],
        capture_output=True, text=True, timeout=100, env=_env(), cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 2
    assert "pytest is not installed" in run.stderr and "--skip-tests" in run.stderr
    assert "aserve[archive]" in run.stderr
    assert not out.exists()
    run = subprocess.run(
        [sys.executable, "-c", code, "archive", str(project), "-o", str(out), "--skip-tests"],
        capture_output=True, text=True, timeout=100, env=_env(), cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert zipfile.ZipFile(out).testzip() is None


@pytest.mark.timeout(120)
def test_a_project_with_a_symlink_or_a_bad_output_name_is_refused(
    project: Path, tmp_path: Path
) -> None:
    linked = tmp_path / "linked"
    shutil.copytree(project, linked)
    (linked / "secret").symlink_to("/etc/passwd")
    done = aserve("archive", str(linked), "-o", "x.aserve", "--skip-tests", cwd=tmp_path)
    assert done.returncode == 2 and "secret is not a plain file" in done.stderr
    done = aserve("archive", str(project), "-o", "x.zip", "--skip-tests", cwd=tmp_path)
    assert done.returncode == 2 and "ends in .aserve" in done.stderr
    assert not (tmp_path / "x.aserve").exists() and not (tmp_path / "x.zip").exists()


@pytest.mark.timeout(120)
def test_packing_warns_of_what_a_server_refuses_and_refuses_bad_names(
    project: Path, tmp_path: Path
) -> None:
    sparse = tmp_path / "sparse"
    shutil.copytree(project, sparse, ignore=shutil.ignore_patterns("__pycache__"))
    (sparse / "zeros.bin").write_bytes(bytes(8 << 20))  # deflates ~1000x
    done = aserve("archive", str(sparse), "-o", "s.aserve", "--skip-tests", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "warning: a server with the default limits refuses it" in done.stderr
    assert "member 'zeros.bin' expands" in done.stderr and (tmp_path / "s.aserve").is_file()
    (sparse / "zeros.bin").unlink()
    (sparse / "bad\nname.py").write_text("x = 1\n")
    done = aserve("archive", str(sparse), "-o", "t.aserve", "--skip-tests", cwd=tmp_path)
    assert done.returncode == 2 and "unprintable character" in done.stderr, done.stderr
    assert not (tmp_path / "t.aserve").exists()


# --- serve_config ---------------------------------------------------------------


@pytest.mark.timeout(120)
def test_serve_config_extracts_once_and_reuses(packed: Path, cache: Path) -> None:
    config = serve_config(packed)
    digest = hashlib.sha256(packed.read_bytes()).hexdigest()
    root = cache / "archives" / digest
    (model,) = config["models"]
    assert model["root"] == str(root.absolute())
    assert model["handler"] == "handler:Classifier"
    assert (root / "handler.py").read_bytes() == zipfile.ZipFile(packed).read("handler.py")
    first = (root / "handler.py").stat().st_ino
    assert serve_config(packed) == config
    assert (root / "handler.py").stat().st_ino == first  # reused, not extracted again
    # A damaged extraction is not reused: it is replaced by a fresh one.
    (root / "handler.py").write_text("raise SystemExit('tampered cache')\n")
    assert serve_config(packed) == config
    assert (root / "handler.py").read_bytes() == zipfile.ZipFile(packed).read("handler.py")
    assert _folders(cache) == [digest]  # nothing left beside


def _folders(cache: Path) -> list[str]:
    """What the archive cache holds but the lock files beside its folders."""
    return sorted(p.name for p in (cache / "archives").iterdir() if p.suffix != ".lock")


def _serve_in_process(
    path: str, cache: str, barrier: multiprocessing.synchronize.Barrier, out: str
) -> None:
    os.environ["ASERVE_CACHE_DIR"] = cache
    barrier.wait(timeout=60)
    config = serve_config(Path(path))
    Path(out).write_text(config["models"][0]["root"])


@pytest.mark.timeout(180)
def test_processes_extracting_at_once_agree(packed: Path, tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(6)
    cache = tmp_path / "cache"
    procs = [
        ctx.Process(
            target=_serve_in_process,
            args=(str(packed), str(cache), barrier, str(tmp_path / f"out{i}")),
        )
        for i in range(6)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    roots = {(tmp_path / f"out{i}").read_text() for i in range(6)}
    assert len(roots) == 1
    (root,) = roots
    assert _folders(cache) == [Path(root).name]
    with zipfile.ZipFile(packed) as zf:
        for name in zf.namelist():
            if name != archive.MANIFEST:
                assert (Path(root) / name).read_bytes() == zf.read(name), name


# --- hostile archives ------------------------------------------------------------


def _tamper(members: dict[str, bytes], manifest: dict) -> None:
    # The same size, other bytes: only the hash can tell.
    members["handler.py"] = members["handler.py"].replace(b'"setosa"', b'"SETOSA"')


def _slip(members: dict[str, bytes], manifest: dict) -> None:
    members["../evil.py"] = b"print('escaped')\n"
    listed(manifest, "../evil.py", members["../evil.py"])


def _absolute(members: dict[str, bytes], manifest: dict) -> None:
    members["/tmp/evil.py"] = b"print('escaped')\n"
    listed(manifest, "/tmp/evil.py", members["/tmp/evil.py"])


def _symlink(members: dict[str, bytes], manifest: dict) -> None:
    members["link"] = b"/etc/passwd"
    listed(manifest, "link", members["link"])


def _missing(members: dict[str, bytes], manifest: dict) -> None:
    del members["client.py"]


def _extra(members: dict[str, bytes], manifest: dict) -> None:
    members["extra.py"] = b"x = 1\n"


def _bomb(members: dict[str, bytes], manifest: dict) -> None:
    # 64 MiB of zeros deflate to ~64 KiB; the limit in these tests is 16 MiB.
    members["zeros.bin"] = bytes(64 << 20)
    listed(manifest, "zeros.bin", members["zeros.bin"])


def _lying_size(members: dict[str, bytes], manifest: dict) -> None:
    next(m for m in manifest["members"] if m["path"] == "client.py")["size"] = 10


HOSTILE = {
    "tampered": (_tamper, "member 'handler.py' does not match its SHA-256"),
    "zip slip": (_slip, "member '../evil.py' climbs out of the archive's root"),
    "absolute": (_absolute, "member '/tmp/evil.py' is an absolute path"),
    "symlink": (_symlink, "member 'link' is not a regular file"),
    "missing": (_missing, "member 'client.py' is in MANIFEST.json but not in the archive"),
    "extra": (_extra, "member 'extra.py' is not in MANIFEST.json"),
    "bomb": (_bomb, "member 'zeros.bin' (67108864 bytes) takes the extracted total over the limit"),
    "lying size": (_lying_size, "member 'client.py' is"),
}
LIMIT = str(16 << 20)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_archive_is_refused_naming_the_member(
    case: str, packed: Path, tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    change, message = HOSTILE[case]
    modes = {"link": stat.S_IFLNK | 0o777} if case == "symlink" else None
    bad = rebuild(packed, tmp_path / "bad.aserve", change, modes)
    monkeypatch.setenv("ASERVE_ARCHIVE_MAX_BYTES", LIMIT)
    with pytest.raises(ArchiveError, match=r"bad\.aserve") as caught:
        serve_config(bad)
    assert message in str(caught.value)
    # Nothing was extracted: not in place, not beside, not outside.
    assert not (cache / "archives").exists() or _folders(cache) == []
    assert not (tmp_path / "evil.py").exists() and not Path("/tmp/evil.py").exists()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["tampered", "zip slip", "bomb"])
def test_the_server_refuses_a_hostile_archive_entry(
    case: str, packed: Path, tmp_path: Path
) -> None:
    change, message = HOSTILE[case]
    rebuild(packed, tmp_path / "bad.aserve", change)
    config = write_config(tmp_path, {"models": [{"name": "iris", "path": "bad.aserve"}]})
    run = aserve("--config", str(config), "--port", "0", cwd=tmp_path, timeout=100,
                 ASERVE_CACHE_DIR=str(tmp_path / "cache"), ASERVE_ARCHIVE_MAX_BYTES=LIMIT)  # fmt: skip
    assert run.returncode == 2, run.stderr
    assert "models[0].path:" in run.stderr and message in run.stderr


# --- serving through a config entry --------------------------------------------------


@pytest.mark.timeout(180)
async def test_a_config_entry_serves_the_archive(packed: Path, tmp_path: Path) -> None:
    shutil.copy(packed, tmp_path / "iris.aserve")
    config = write_config(tmp_path, {"models": [
        {"name": "iris", "path": "iris.aserve", "instances": 2, "batching": {"max_batch_size": 4}},
    ]})  # fmt: skip
    server = start_server(config, extra_env={"ASERVE_CACHE_DIR": str(tmp_path / "cache")})
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{server.base}/v2/models/iris") as r:
                meta = await r.json()
            assert r.status == 200, meta
            assert [t["name"] for t in meta["inputs"]] == ["FEATURES"]
            body = v2_body("FEATURES", ROWS, [3, 4])
            async with session.post(f"{server.base}/v2/models/iris/infer", json=body) as r:
                answer = await r.json()
            assert r.status == 200, answer
            labels = next(o for o in answer["outputs"] if o["name"] == "LABEL")["data"]
            assert labels == ["setosa", "versicolor", "virginica"]
    finally:
        server.stop()


@pytest.mark.timeout(120)
def test_an_archive_entry_may_not_redefine_the_model(packed: Path, tmp_path: Path) -> None:
    shutil.copy(packed, tmp_path / "iris.aserve")
    config = write_config(tmp_path, {"models": [
        {"name": "iris", "path": "iris.aserve", "engine": "torch", "handler": "x:Y"},
    ]})  # fmt: skip
    run = aserve(
        "--config", str(config), cwd=tmp_path, timeout=100, ASERVE_CACHE_DIR=str(tmp_path / "c")
    )
    assert run.returncode == 2
    assert "models[0].path: the archive 'iris.aserve' gives engine, handler" in run.stderr


@pytest.mark.timeout(180)
async def test_a_reload_to_a_bomb_archive_is_rejected_without_stalling(
    packed: Path, tmp_path: Path
) -> None:
    shutil.copy(packed, tmp_path / "iris.aserve")
    good = {"models": [{"name": "iris", "path": "iris.aserve"}]}
    config = write_config(tmp_path, good)
    env = {"ASERVE_CACHE_DIR": str(tmp_path / "cache"), "ASERVE_ARCHIVE_MAX_BYTES": LIMIT}
    server = start_server(config, extra_env=env, extra_args=("--watch-interval", "0"))
    try:
        rebuild(packed, tmp_path / "bomb.aserve", _bomb)
        before = config_status(server.base)["reloads"]
        async with watch_loop(server.base):
            rewrite_config(config, {"models": [{"name": "iris", "path": "bomb.aserve"}]})
            server.proc.send_signal(1)  # SIGHUP
            status = wait_attempts(server.base, before)
        assert "zeros.bin" in json.dumps(status), status
        async with aiohttp.ClientSession() as session:
            body = v2_body("FEATURES", ROWS[:4], [1, 4])
            async with session.post(f"{server.base}/v2/models/iris/infer", json=body) as r:
                assert r.status == 200
    finally:
        server.stop()


@pytest.mark.timeout(180)
@pytest.mark.timeout(300)
async def test_two_archives_whose_modules_share_names_each_serve_their_own(
    project: Path, tmp_path: Path
) -> None:
    """Two projects from one scaffold: the same module names (handler, and a sibling
    module the handler imports), other code. One process imports a name once, so the
    second model used to run the first one's class (it was refused for that); each
    folder's modules are now imported under a package of its own."""
    other = tmp_path / "other"
    shutil.copytree(project, other, ignore=shutil.ignore_patterns("__pycache__"))
    (other / "labels.py").write_text('ORDER = ("versicolor", "setosa")\n')
    handler = other / "handler.py"
    text = handler.read_text().replace('"setosa", "versicolor"', "*labels.ORDER")
    handler.write_text(text.replace("\nimport ", "\nimport labels\nimport ", 1))
    (project / "labels.py").write_text('ORDER = ("setosa", "versicolor")\n')
    try:
        done = aserve(
            "archive", str(other), "-o", str(tmp_path / "other.aserve"), "--skip-tests",
            cwd=tmp_path,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        # The first project ships a labels.py of its own, which its handler never imports.
        mine = aserve(
            "archive", str(project), "-o", str(tmp_path / "iris.aserve"), "--skip-tests",
            cwd=tmp_path,
        )  # fmt: skip
        assert mine.returncode == 0, mine.stderr
    finally:
        (project / "labels.py").unlink()
    config = write_config(tmp_path, {"models": [
        {"name": "iris", "path": "iris.aserve"}, {"name": "other", "path": "other.aserve"},
    ]})  # fmt: skip
    server = start_server(config, extra_env={"ASERVE_CACHE_DIR": str(tmp_path / "c")})
    try:
        async with aiohttp.ClientSession() as session:

            async def labels(model: str) -> list[str]:
                body = v2_body("FEATURES", ROWS[:4], [1, 4])
                async with session.post(f"{server.base}/v2/models/{model}/infer", json=body) as r:
                    answer = await r.json()
                assert r.status == 200, answer
                return next(o for o in answer["outputs"] if o["name"] == "LABEL")["data"]

            assert await labels("iris") == ["setosa"]
            assert await labels("other") == ["versicolor"]
    finally:
        server.stop()


def _shrink_declared_size(path: Path, name: str, size: int) -> None:
    """Make the zip's headers claim ``size`` bytes for member ``name`` (a bomb that lies)."""
    raw = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as zf:
        local = zf.getinfo(name).header_offset
    raw[local + 22 : local + 26] = size.to_bytes(4, "little")
    at = raw.find(b"PK\x01\x02")
    while at != -1:
        length = int.from_bytes(raw[at + 28 : at + 30], "little")
        if raw[at + 46 : at + 46 + length] == name.encode():
            raw[at + 24 : at + 28] = size.to_bytes(4, "little")
        at = raw.find(b"PK\x01\x02", at + 4)
    path.write_bytes(bytes(raw))


@pytest.mark.timeout(120)
def test_a_bomb_whose_headers_lie_is_cut_at_its_declared_size(
    packed: Path, tmp_path: Path, cache: Path
) -> None:
    def lying(members: dict[str, bytes], manifest: dict) -> None:
        members["zeros.bin"] = bytes(64 << 20)
        listed(manifest, "zeros.bin", bytes(10))  # the manifest agrees with the lying headers

    bad = rebuild(packed, tmp_path / "bad.aserve", lying)
    _shrink_declared_size(bad, "zeros.bin", 10)
    with pytest.raises(ArchiveError, match=r"member 'zeros\.bin' (is corrupt|does not match)"):
        serve_config(bad)
    assert not (cache / "archives").exists() or _folders(cache) == []
