"""A real headless browser for page tests: Debian's ``chromium`` driven over the DevTools protocol (a websocket,
``websocket-client``), recording every console message, uncaught exception, log entry and network request while
it opens a page, and evaluating JavaScript in it. Tests skip with a clear reason without chromium."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"

needs_chromium = pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="needs Debian's chromium package "
                                    "(apt-get install -y --no-install-recommends chromium; .ci/run does it as root)")

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
         "--no-first-run", "--disable-sync", "--disable-default-apps", "--disable-extensions",
         "--remote-debugging-port=0", "--remote-allow-origins=*")


@dataclass
class PageLog:
    """What a page did while it was open."""

    console: list[dict[str, Any]] = field(default_factory=list)
    """``Runtime.consoleAPICalled`` params (``type``: log, warning, error, ...)."""
    exceptions: list[dict[str, Any]] = field(default_factory=list)
    """``Runtime.exceptionThrown`` params."""
    log: list[dict[str, Any]] = field(default_factory=list)
    """``Log.entryAdded`` entries (``level``: verbose, info, warning, error)."""
    requests: list[str] = field(default_factory=list)
    """The URL of every ``Network.requestWillBeSent``."""

    def errors(self) -> list[str]:
        """Console errors, uncaught exceptions and error log entries, one line each."""
        out = [f"console.{c['type']}: {c.get('args')}" for c in self.console if c["type"] in ("error", "assert")]
        out += [f"exception: {e.get('exceptionDetails')}" for e in self.exceptions]
        out += [f"log {e.get('source')}: {e.get('text')} {e.get('url', '')}" for e in self.log
                if e.get("level") == "error"]
        return out


class Browser:
    """A headless chromium with one page, driven over the DevTools protocol; a context manager."""

    def __init__(self) -> None:
        self.profile = tempfile.mkdtemp(prefix="shmstat-chromium-")
        self.proc = subprocess.Popen([CHROMIUM, *FLAGS, f"--user-data-dir={self.profile}", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        port = self._port()
        deadline = time.monotonic() + 30
        page = None
        while page is None:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=5) as r:
                page = next((t for t in json.load(r) if t.get("type") == "page"), None)
            if page is None:
                assert time.monotonic() < deadline, "chromium opened no page"
                time.sleep(0.1)
        import websocket

        self.ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=30, suppress_origin=True)
        self._ids = itertools.count(1)
        self.log = PageLog()

    def _port(self) -> int:
        assert self.proc.stderr is not None
        deadline = time.monotonic() + 30
        seen = []
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                break
            seen.append(line)
            found = re.search(r"DevTools listening on ws://[^:]+:(\d+)/", line)
            if found:
                return int(found.group(1))
        raise AssertionError(f"chromium did not start: {''.join(seen)[-2000:]}")

    def _record(self, msg: dict[str, Any]) -> None:
        method, params = msg.get("method"), msg.get("params", {})
        if method == "Runtime.consoleAPICalled":
            self.log.console.append(params)
        elif method == "Runtime.exceptionThrown":
            self.log.exceptions.append(params)
        elif method == "Log.entryAdded":
            self.log.log.append(params["entry"])
        elif method == "Network.requestWillBeSent":
            self.log.requests.append(params["request"]["url"])

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Send one command and return its result, recording the events that arrive meanwhile."""
        ident = next(self._ids)
        self.ws.send(json.dumps({"id": ident, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == ident:
                assert "error" not in msg, msg
                return dict(msg.get("result", {}))
            self._record(msg)

    def open(self, url: str, ready: str, timeout_s: float = 60.0) -> None:
        """Navigate to ``url`` with every domain recording, and wait until the JavaScript expression ``ready`` is
        true in the page."""
        for domain in ("Runtime", "Log", "Network", "Page"):
            self.call(f"{domain}.enable")
        self.call("Page.navigate", url=url)
        deadline = time.monotonic() + timeout_s
        while not self.evaluate(f"Boolean({ready})"):
            assert time.monotonic() < deadline, f"the page never got ready ({ready}); errors: {self.log.errors()}"
            time.sleep(0.1)

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (JSON-serialisable values)."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        assert "exceptionDetails" not in result, result
        return result["result"].get("value")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.ws.close()
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(20)
        if self.proc.stderr is not None:
            self.proc.stderr.close()
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
