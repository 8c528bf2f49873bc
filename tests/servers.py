"""A `graphc serve` process on a loopback port, as the server tests drive it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx2
import openai


class Server:
    """`graphc serve ARTIFACTS --port 0` in a process of its own."""

    def __init__(self, artifacts: Path, *options: str, env: dict | None = None, api_key: str = "unused"):
        self.process = subprocess.Popen(
            [str(Path(sys.executable).parent / "graphc"), "serve", str(artifacts), "--port", "0", "--model-name", "tiny",
             *options], stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
        self.lines: list[str] = []
        ready = threading.Event()

        def drain():  # read stderr to the end so the server never blocks on a full pipe
            for line in self.process.stderr:
                self.lines.append(line)
                if "serving" in line:
                    ready.set()
            ready.set()

        threading.Thread(target=drain, daemon=True).start()
        assert ready.wait(120) and self.process.poll() is None, "".join(self.lines)
        self.url = re.search(r"on (http://\S+)", "".join(self.lines)).group(1)
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=120)

    def metrics(self) -> dict[str, float]:
        text = httpx2.get(f"{self.url}/metrics").text
        return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(graphc_\w+(?:\{[^}]*\})?) (\S+)$", text, re.M)}

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(60)
