"""The server's memory around a decoder model with a large tokenizer: before it
loads, once it serves, after it is removed; and the loop's worst stall meanwhile.

A server starts with the tiny GPT-2 alone. A second model, the same GPT-2
with its ``tokenizer.json`` grown to ``--tokenizer-mb`` by vocabulary entries
no merge reaches (``generation.checkpoint_limits.max_tokenizer_bytes`` raised
to admit it), is added by a hot reload (SIGHUP), answers a completion, and is
removed by another. The server process's RSS is read after each step (its
step processes are their own); after the removal it is read once the model's
unload has been logged and then again until it stops moving. While each
reload runs, ``/v2/health/live`` is polled one request after another on a
connection of its own: the slowest answer is the event loop's worst stall.

    python -m bench.decoder_memory [--tokenizer-mb 150] [--step-thread]
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

from bench.servers import ServerProcess

ROOT = Path(__file__).resolve().parent.parent
GENERATION = {"max_num_seqs": 4, "max_model_len": 128}


def grow_tokenizer(path: Path, target_bytes: int) -> None:
    """Vocabulary entries no merge reaches, until ``path`` holds ``target_bytes``."""
    text = path.read_text()
    start = re.search(r'"vocab"\s*:\s*\{', text)
    assert start, "a BPE tokenizer.json has a vocab object"
    pad = "x" * 200
    first = len(json.loads(text)["model"]["vocab"])
    count = target_bytes // (len(pad) + 16) + 1
    with path.open("w") as f:
        f.write(text[: start.end()])
        f.write("".join(f'"{pad}{i}":{i},' for i in range(first, first + count)))
        f.write(text[start.end() :])


def _get(url: str, timeout_s: float = 30.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return json.loads(r.read() or b"null")


def _post(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


class LiveProbe:
    """``/v2/health/live`` one request after another on a thread; the slowest answer."""

    def __init__(self, base: str) -> None:
        self.url = base + "/v2/health/live"
        self.worst_s = 0.0
        self.count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            with urllib.request.urlopen(self.url, timeout=60) as r:
                r.read()
            self.worst_s = max(self.worst_s, time.perf_counter() - t0)
            self.count += 1

    def __enter__(self) -> LiveProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def reload(server: ServerProcess, config: Path, models: list[dict[str, Any]]) -> tuple[str, float]:
    config.write_text(json.dumps({"drain_grace_s": 0, "models": models}))
    base = server.base_url
    before = sum(_get(base + "/v2/config/status")["reloads"].values())
    with LiveProbe(base) as probe:
        server.proc.send_signal(signal.SIGHUP)
        while True:
            status = _get(base + "/v2/config/status")
            if sum(status["reloads"].values()) > before:
                break
            time.sleep(0.05)
    return status["last_reload"]["result"], probe.worst_s


def settled_rss(pid: int, quiet_s: float = 2.0, timeout_s: float = 30.0) -> int:
    """RSS once it has not moved by more than 1 MiB for ``quiet_s``."""
    proc = psutil.Process(pid)
    last, since, deadline = proc.memory_info().rss, time.monotonic(), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = proc.memory_info().rss
        if abs(now - last) > 2**20:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            break
    return last


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.decoder_memory")
    parser.add_argument("--tokenizer-mb", type=float, default=150.0)
    parser.add_argument(
        "--step-thread", action="store_true", help='"step_process": false (weights in the server)'
    )
    args = parser.parse_args(argv)
    from aserve.engines.decoder.tiny import build_tiny_gpt2

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        small, big = root / "small", root / "big"
        small.mkdir()
        build_tiny_gpt2(small)
        big.mkdir()
        build_tiny_gpt2(big)
        size = int(args.tokenizer_mb * 2**20)
        grow_tokenizer(big / "tokenizer.json", size)
        generation = {**GENERATION, "step_process": not args.step_thread}
        good = {"name": "small", "engine": "decoder", "path": str(small), "generation": generation}
        heavy = {
            **good, "name": "big", "path": str(big),
            "generation": {**generation, "checkpoint_limits": {"max_tokenizer_bytes": 2 * size}},
        }  # fmt: skip
        config = root / "config.json"
        config.write_text(json.dumps({"drain_grace_s": 0, "models": [good]}))
        argv_ = [sys.executable, "-m", "aserve", "--config", str(config), "--port", "0"]
        rows: list[tuple[str, float, str]] = []
        with ServerProcess("aserve", argv_, ROOT) as server:
            proc = psutil.Process(server.pid)
            rows.append(("before load", settled_rss(server.pid) / 2**20, ""))
            result, stall = reload(server, config, [good, heavy])
            assert result == "ok", result
            body = {"model": "big", "prompt": "Hello world", "max_tokens": 4, "temperature": 0}
            _post(server.base_url + "/v1/completions", body)
            rows.append(("after load", settled_rss(server.pid) / 2**20, f"{stall * 1e3:.0f} ms"))
            result, stall = reload(server, config, [good])
            assert result == "ok", result
            deadline = time.monotonic() + 60
            while (
                "model big/1 drained and unloaded" not in "".join(server.log)
                and time.monotonic() < deadline
            ):
                time.sleep(0.1)
            rows.append(("after removal", settled_rss(server.pid) / 2**20, f"{stall * 1e3:.0f} ms"))
            del proc
    print(f"tokenizer.json {size / 2**20:.0f} MiB, step_process {not args.step_thread}")
    print("| stage | server RSS | worst /v2/health/live during the reload |")
    print("|---|---:|---:|")
    for stage, rss, stall_text in rows:
        print(f"| {stage} | {rss:.0f} MiB | {stall_text} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
