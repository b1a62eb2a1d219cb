"""Hostile ``.aserve`` archives, one table: each shape is refused with a clear error that
names the archive and what is wrong, the same way through every door.

- ``aserve serve X --print-config`` and ``aserve serve X``: exit status 2, the
  message on stderr, no traceback, and nothing extracted into the cache.
- A reload to a config naming X (SIGHUP) on a running server: rejected, with
  ``/v2/config/status`` saying why, the old model still serving, and the loop
  watched (tests/stall_watch.py) while the archive is read.

Shapes: a member that is both a file and a folder, a 300-byte folder name,
folders 40 deep, a manifest nested 100,000 deep or not an object or with a
number past any integer, duplicate members, absolute names, a NUL, a newline
or a backslash in a name, a symlink entry, 20,000 members, a name flagged
UTF-8 that is not, a bad CRC, a truncated zip, an encrypted member, an
unsupported compression method, a FIFO or a folder named ``.aserve``, a zip
bomb (100 MiB of zeros: ~1000x), and a config nested too deep. A fuzz test
then flips and cuts bytes of a real archive: every outcome is an archive
served or an ``ArchiveError``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import stat
import struct
import subprocess
import sys
import zipfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from archive_helpers import ROWS, digest, env, folders, listed, pack, rebuild, scaffold
from conftest import ServerProcess, start_server, write_config
from helpers import v2_body
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reload_helpers import config_status, rewrite_config, wait_attempts
from stall_watch import watch_loop

from aserve.config import archive
from aserve.config.archive import ArchiveError, serve_config

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hostile-archives")


@pytest.fixture(scope="module")
def packed(work: Path) -> Path:
    return pack(scaffold(work), work / "demo.aserve")


# --- the shapes ------------------------------------------------------------------
# Each builds an archive from the packed scaffold and says what the error must hold.


def _adding(name: str, data: bytes = b"x = 1\n") -> Callable[[dict, dict], None]:
    def change(members: dict[str, bytes], manifest: dict) -> None:
        members[name] = data
        listed(manifest, name, data)

    return change


def _file_and_folder(src: Path, dst: Path) -> None:
    def change(members: dict[str, bytes], manifest: dict) -> None:
        _adding("a")(members, manifest)
        _adding("a/b")(members, manifest)

    rebuild(src, dst, change)


def _patch_name(path: Path, name: str, new: bytes) -> None:
    """Rewrite member ``name``'s name (as many bytes) in its local and central headers."""
    assert len(name.encode()) == len(new)
    _patch_header(path, name, (30, 46), new)


def _patch_header(path: Path, name: str, field_at: tuple[int, int], value: bytes) -> None:
    """Overwrite a field of member ``name``'s local header and central directory entry,
    at offsets ``field_at`` (local, central)."""
    raw = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as zf:
        local = zf.getinfo(name).header_offset
    raw[local + field_at[0] : local + field_at[0] + len(value)] = value
    at = raw.find(b"PK\x01\x02")
    while at != -1:
        length = int.from_bytes(raw[at + 28 : at + 30], "little")
        if raw[at + 46 : at + 46 + length] == name.encode():
            raw[at + field_at[1] : at + field_at[1] + len(value)] = value
        at = raw.find(b"PK\x01\x02", at + 4)
    path.write_bytes(bytes(raw))


def _nul_name(src: Path, dst: Path) -> None:
    rebuild(src, dst, _adding("aXb.py"))
    _patch_name(dst, "aXb.py", b"a\x00b.py")


def _not_utf8(src: Path, dst: Path) -> None:
    rebuild(src, dst, _adding("\u00e9.py"))  # a non-ASCII name: written flagged UTF-8
    _patch_name(dst, "\u00e9.py", b"\xff\xfe.py")


def _manifest_raw(src: Path, dst: Path, raw: bytes) -> None:
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        for name in zin.namelist():
            zout.writestr(zin.getinfo(name), raw if name == archive.MANIFEST else zin.read(name))


def _big_number(src: Path, dst: Path) -> None:
    with zipfile.ZipFile(src) as zf:
        text = zf.read(archive.MANIFEST).decode()
    size = json.loads(text)["members"][0]["size"]
    text = text.replace(f'"size": {size}', '"size": 1' + "0" * 30, 1)  # past 64 bits
    _manifest_raw(src, dst, text.encode())


def _duplicate(src: Path, dst: Path) -> None:
    rebuild(src, dst, lambda members, manifest: None)
    with zipfile.ZipFile(dst, "a") as zf, pytest.warns(UserWarning, match="Duplicate name"):
        zf.writestr("handler.py", b"print('second copy')\n")


def _many_members(src: Path, dst: Path) -> None:
    rebuild(src, dst, lambda members, manifest: None)
    with zipfile.ZipFile(dst, "a", zipfile.ZIP_STORED) as zf:
        for i in range(20_000):
            zf.writestr(f"m/{i}", b"")


def _bad_crc(src: Path, dst: Path) -> None:
    data = b"0123456789" * 100

    def change(members: dict[str, bytes], manifest: dict) -> None:
        _adding("data.bin", data)(members, manifest)

    rebuild(src, dst, change)
    with zipfile.ZipFile(dst) as zf:
        info = zf.getinfo("data.bin")
    # The CRC field of both headers, so that only the data's own checksum disagrees.
    _patch_header(dst, "data.bin", (14, 16), struct.pack("<I", (info.CRC + 1) & 0xFFFFFFFF))


def _truncated(src: Path, dst: Path) -> None:
    raw = src.read_bytes()
    dst.write_bytes(raw[: len(raw) // 2])


def _encrypted(src: Path, dst: Path) -> None:
    rebuild(src, dst, lambda members, manifest: None)
    with zipfile.ZipFile(dst) as zf:
        flags = zf.getinfo("handler.py").flag_bits
    _patch_header(dst, "handler.py", (6, 8), struct.pack("<H", flags | 0x1))


def _deflate64(src: Path, dst: Path) -> None:
    rebuild(src, dst, lambda members, manifest: None)
    _patch_header(dst, "handler.py", (8, 10), struct.pack("<H", 9))  # deflate64


def _fifo(src: Path, dst: Path) -> None:
    os.mkfifo(dst)


def _folder(src: Path, dst: Path) -> None:
    dst.mkdir()


def _bomb(src: Path, dst: Path) -> None:
    # 100 MiB of zeros deflate to ~100 KiB: a 1000x member, under the total limit.
    rebuild(src, dst, _adding("zeros.bin", bytes(100 << 20)))


def _deep_config(src: Path, dst: Path) -> None:
    def change(members: dict[str, bytes], manifest: dict) -> None:
        # 2,000 deep in 4,000 bytes: small enough to compress past the ratio.
        members["config.json"] = b"[" * 2_000 + b"]" * 2_000
        entry = next(m for m in manifest["members"] if m["path"] == "config.json")
        entry.update(size=4_000, sha256=hashlib.sha256(members["config.json"]).hexdigest())

    rebuild(src, dst, change)


def _rebuilt(change: Callable[[dict, dict], None], modes: dict[str, int] | None = None) -> Any:
    return lambda src, dst: rebuild(src, dst, change, modes)


def _raw_manifest(raw: bytes) -> Any:
    return lambda src, dst: _manifest_raw(src, dst, raw)


CASES: dict[str, tuple[Callable[[Path, Path], None], str]] = {
    "file and folder": (_file_and_folder, "member 'a' is a file, and member 'a/b' needs a folder"),
    "300-byte folder name": (
        _rebuilt(_adding("d" * 300 + "/x.py")),
        "has a file or folder name over 255 bytes",
    ),
    "40 folders deep": (_rebuilt(_adding("a/" * 40 + "x.py")), "or 32 folders deep"),
    "nested manifest": (
        _raw_manifest(b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
        "MANIFEST.json is unreadable",
    ),
    "manifest not an object": (_raw_manifest(b"[1, 2, 3]"), "not an aserve manifest of format 1"),
    "manifest number past any integer": (_big_number, "needs 'path', 'sha256' and 'size'"),
    "duplicate member": (_duplicate, "member 'handler.py' appears twice"),
    "absolute name": (_rebuilt(_adding("/tmp/evil.py")), "is an absolute path"),
    # zipfile cuts a name at its NUL ('a'): the manifest's member is then missing.
    "NUL in a name": (_nul_name, "member 'aXb.py' is in MANIFEST.json but not in the archive"),
    "newline in a name": (_rebuilt(_adding("a\nb.py")), "unprintable character"),
    "backslash": (_rebuilt(_adding("..\\evil.py")), "a backslash"),
    "symlink entry": (
        _rebuilt(_adding("link", b"/etc/passwd"), {"link": stat.S_IFLNK | 0o777}),
        "member 'link' is not a regular file",
    ),
    "20,000 members": (_many_members, "members (the limit is 10000)"),
    "name flagged UTF-8 that is not": (_not_utf8, "not a zip archive"),
    "bad CRC": (_bad_crc, "member 'data.bin' is corrupt: Bad CRC-32"),  # seen when extracted
    "truncated": (_truncated, "not a zip archive"),
    "encrypted member": (_encrypted, "member 'handler.py' is encrypted"),
    "deflate64": (_deflate64, "member 'handler.py' is compressed with zip method 9"),
    "FIFO": (_fifo, "not a regular file"),
    "folder": (_folder, "not a regular file"),
    "zip bomb": (_bomb, "member 'zeros.bin' expands"),
    "nested config": (_deep_config, "its config 'config.json' is not JSON"),
}


# Found only by reading a member's data, which --print-config does not (it exits 0).
DATA_ONLY = {"bad CRC"}


def _build(case: str, packed: Path, folder: Path) -> Path:
    bad = folder / "bad.aserve"
    CASES[case][0](packed, bad)
    return bad


# --- through the command line ------------------------------------------------------


def _cli(args: list[str], cwd: Path, cache: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aserve", *args], cwd=cwd, capture_output=True, text=True,
        timeout=90, env=env(ASERVE_CACHE_DIR=str(cache)),
    )  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_the_command_line_refuses_it_with_status_2(case: str, packed: Path, tmp_path: Path) -> None:
    bad = _build(case, packed, tmp_path)
    cache = tmp_path / "cache"
    argvs = [
        ["serve", str(bad), "--print-config"],
        ["serve", str(bad), "--port", "0", "--no-grpc"],
    ]
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda argv: _cli(argv, tmp_path, cache), argvs))
    if case in DATA_ONLY:
        assert runs[0].returncode == 0, runs[0].stderr
        argvs, runs = argvs[1:], runs[1:]
    for argv, run in zip(argvs, runs, strict=True):
        assert run.returncode == 2, (argv, run.stderr)
        assert "Traceback" not in run.stderr, run.stderr
        assert run.stderr.startswith(f"aserve serve: error: {bad}"), run.stderr
        assert CASES[case][1] in run.stderr, run.stderr
    assert folders(cache) == []  # nothing extracted, nothing left beside


# --- through a reload -------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(packed: Path, work: Path) -> Any:
    folder = work / "served"
    folder.mkdir()
    (folder / "iris.aserve").write_bytes(packed.read_bytes())
    config = write_config(folder, {"models": [{"name": "iris", "path": "iris.aserve"}]})
    proc = start_server(
        config, extra_env={"ASERVE_CACHE_DIR": str(work / "cache")},
        extra_args=("--watch-interval", "0"),
    )  # fmt: skip
    try:
        yield proc, config
    finally:
        proc.stop()


async def _answers(server: ServerProcess) -> None:
    body = v2_body("FEATURES", ROWS[:4], [1, 4])
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{server.base}/v2/models/iris/infer", json=body) as r:
            assert r.status == 200, await r.text()


@pytest.mark.parametrize("case", list(CASES))
async def test_a_reload_to_it_is_rejected_saying_why(
    case: str, packed: Path, server: tuple[ServerProcess, Path], work: Path
) -> None:
    proc, config = server
    # A file of its own per case: each reload is to other config bytes.
    bad = config.parent / f"bad-{list(CASES).index(case)}.aserve"
    CASES[case][0](packed, bad)
    before = config_status(proc.base)["reloads"]
    async with watch_loop(proc.base):
        rewrite_config(config, {"models": [{"name": "iris", "path": bad.name}]})
        proc.proc.send_signal(signal.SIGHUP)
        status = await asyncio.to_thread(wait_attempts, proc.base, before)
    assert status["last_reload"]["result"] == "rejected", status["last_reload"]
    error = status["last_error"]["error"]
    assert f"models[0].path: {bad}" in error and CASES[case][1] in error, error
    await _answers(proc)  # the old model serves on
    assert "Traceback" not in proc.log_text(), proc.log_text()[-3000:]
    assert folders(work / "cache") == [digest(config.parent / "iris.aserve")]


# --- the limits --------------------------------------------------------------------------


def test_a_bomb_is_refused_by_default_and_served_past_a_raised_ratio(
    packed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ASERVE_CACHE_DIR", str(tmp_path / "cache"))
    bad = _build("zip bomb", packed, tmp_path)
    with pytest.raises(ArchiveError) as caught:
        serve_config(bad)
    message = str(caught.value)
    assert "over the limit of 100x" in message and "archives.max_compression_ratio" in message
    assert "--max-archive-ratio" in message
    assert folders(tmp_path / "cache") == []
    # The operator who trusts it raises the ratio (or the total) in the config.
    config = write_config(tmp_path, {
        "archives": {"max_compression_ratio": 2000},
        "models": [{"name": "iris", "path": "bad.aserve"}],
    })  # fmt: skip
    from aserve.config import load_config

    loaded, _ = load_config(config)
    assert loaded.archives.max_compression_ratio == 2000
    assert (Path(loaded.models[0].root) / "zeros.bin").stat().st_size == 100 << 20
    config = write_config(tmp_path, {
        "archives": {"max_extracted_bytes": 1 << 20},
        "models": [{"name": "iris", "path": "bad.aserve"}],
    })  # fmt: skip
    from aserve.config import ConfigError

    with pytest.raises(ConfigError, match="over the limit of 1048576 bytes"):
        load_config(config)
    config = write_config(tmp_path, {
        "archives": {"max_compression_ratio": 0.5},
        "models": [{"name": "iris", "path": "bad.aserve"}],
    })  # fmt: skip
    with pytest.raises(ConfigError, match=r"archives.max_compression_ratio: must be >= 1"):
        load_config(config)


def test_the_serve_flags_raise_the_limits(packed: Path, tmp_path: Path) -> None:
    bad = _build("zip bomb", packed, tmp_path)
    cache = tmp_path / "cache"
    run = _cli(
        ["serve", str(bad), "--print-config", "--max-archive-ratio", "2000"], tmp_path, cache
    )
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["models"][0]["root"] == str(cache / "archives" / digest(bad))
    run = _cli(["serve", str(bad), "--print-config", "--max-archive-ratio", "2000",
                "--max-archive-bytes", "1000"], tmp_path, cache)  # fmt: skip
    assert run.returncode == 2 and "over the limit of 1000 bytes" in run.stderr, run.stderr
    run = _cli(["serve", str(bad), "--max-archive-bytes", "0"], tmp_path, cache)
    assert run.returncode == 2 and "--max-archive-bytes: must be >= 1" in run.stderr, run.stderr
    assert folders(cache) == []  # --print-config extracts nothing


def test_print_config_reads_the_archive_without_extracting_it(packed: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    run = _cli(["serve", str(packed), "--print-config"], tmp_path, cache)
    assert run.returncode == 0, run.stderr
    printed = json.loads(run.stdout)
    (model,) = printed["models"]
    assert model["handler"] == "handler:Classifier" and model["name"] == "demo"
    assert model["root"] == str(cache / "archives" / digest(packed))
    assert not (cache / "archives").exists() or folders(cache) == []


# --- fuzzing -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fuzz_base(packed: Path, work: Path) -> bytes:
    # Stored members, so that a flipped byte lands in data as often as in headers.
    out = work / "stored.aserve"
    with zipfile.ZipFile(packed) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zout:
        for name in zin.namelist():
            zout.writestr(zipfile.ZipInfo(name), zin.read(name))
    return out.read_bytes()


@settings(
    max_examples=300, derandomize=True, database=None, deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)  # fmt: skip
@given(
    edits=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)), max_size=4),
    cut=st.one_of(st.none(), st.floats(0, 1)),
)
def test_flipped_or_cut_bytes_give_an_archive_error_or_an_archive(
    edits: list[tuple[float, int]], cut: float | None, fuzz_base: bytes, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    raw = bytearray(fuzz_base)
    # Half the edits land in the last 1,500 bytes: the directory and the end record.
    for where, value in edits:
        at = int(where * len(raw)) if value % 2 else len(raw) - 1 - int(where * 1500)
        raw[max(0, at)] = value
    if cut is not None:
        raw = raw[: int(cut * len(raw))]
    path = tmp_path / "fuzzed.aserve"
    path.write_bytes(bytes(raw))
    monkeypatch.setenv("ASERVE_CACHE_DIR", str(tmp_path / "cache"))
    try:
        config = serve_config(path)
    except ArchiveError as exc:
        assert str(exc).startswith(str(path)), exc
        return
    assert isinstance(config, dict)
