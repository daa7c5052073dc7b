"""Start `graphrunner serve` as a user would (a subprocess on 127.0.0.1, an ephemeral port) and
read its /metrics; shared by the server test modules."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
READY = re.compile(r"graphrunner: serving \S+ at (http://127\.0\.0\.1:\d+)")


class ServerProcess:
    """`python -m runner.cli serve ...` in a subprocess; `url` once it is ready, `stop()` at the end."""

    def __init__(self, args: list[str], timeout: float = 300.0) -> None:
        self.log = tempfile.NamedTemporaryFile("w+", prefix="graphrunner-serve-", suffix=".log", delete=False)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "runner.cli", "serve", *args, "--host", "127.0.0.1",
                                      "--port", "0"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True)
        self.url: str | None = None
        found = threading.Event()

        def read() -> None:
            for line in self.proc.stdout:
                match = READY.search(line)
                if match and self.url is None:
                    self.url = match.group(1)
                    found.set()

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + timeout
        while not found.wait(0.5):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log = self.tail()
                self.stop()
                raise RuntimeError(f"the server did not start: {log}")
        self.wait_healthy(deadline)

    def wait_healthy(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        log = self.tail()
        self.stop()
        raise RuntimeError(f"/health did not answer 200: {log}")

    def tail(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()[-3000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        Path(self.log.name).unlink(missing_ok=True)


def metrics(url: str) -> dict[str, float]:
    """/metrics as {name{labels}: value}, and {name: value} for the unlabelled sum over labels."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            values[key] = float(value)
            name = key.split("{", 1)[0]
            values[name] = values.get(name, 0.0) + float(value) if name != key else float(value)
    return values


def wait_for(condition, timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return condition()
