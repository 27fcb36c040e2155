"""Headless Chromium for the site's browser check, over the DevTools protocol on a pipe, with the
network cut off: :class:`Browser` (start, call, events, close), :func:`find_chromium`, and the
local dead-end proxy that records any request meant for another host and answers it 403.

Standard library only; used by ``browser_check.py`` (the checks themselves live there).
"""

from __future__ import annotations

import fcntl
import http.server
import json
import os
import select
import shutil
import socketserver
import subprocess
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

CHROMIUM = ("chromium", "chromium-browser")
#: Debian's browser itself: ``/usr/bin/chromium`` is a shell script that adds Google's API keys and
#: remote extensions to the command line, which make the browser call its services at start.
DEBIAN_CHROMIUM = Path("/usr/lib/chromium/chromium")
#: Hosts the browser calls by itself (sign-in, search) whatever the page: the dead-end proxy
#: answers them 403 and does not report them. A page asking them is still reported (DevTools).
BROWSER_SERVICES = (".google.com",)


class BrowserError(RuntimeError):
    """The browser could not be started or stopped answering."""


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


class DeadEndProxy(socketserver.ThreadingTCPServer):
    """Where the browser sends every non-loopback request: records its first line, answers 403."""

    daemon_threads = True

    def __init__(self):
        self.seen: list[str] = []
        super().__init__(("127.0.0.1", 0), DeadEndHandler)


class DeadEndHandler(socketserver.StreamRequestHandler):
    def handle(self):
        self.connection.settimeout(5)
        try:
            line = self.rfile.readline(4096).decode("latin-1").strip()
        except OSError:
            return
        if line:
            self.server.seen.append(line)
        try:
            self.wfile.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        except OSError:
            pass


def serve(server: socketserver.BaseServer) -> threading.Thread:
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return thread


def _high(fd: int) -> int:
    """``fd`` moved to a number above 9 (close-on-exec, as ``os.pipe`` makes them)."""
    high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return high


def find_chromium() -> str | None:
    """The browser to drive: Debian's binary behind its ``chromium`` launcher when it is there,
    else ``chromium`` (or ``chromium-browser``) on the PATH; None without either."""
    for name in CHROMIUM:
        if path := shutil.which(name):
            return str(DEBIAN_CHROMIUM) if DEBIAN_CHROMIUM.is_file() else path
    return None


class Browser:
    """Headless Chromium driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``:
    the browser reads commands on its fd 3 and writes answers on its fd 4, NUL-terminated JSON)."""

    def __init__(self, binary: str, proxy_port: int, profile: Path):
        # the pipes' fds above 9, so that putting them on 3 and 4 in the child clobbers neither
        to_chrome_r, self._w, self._r, from_chrome_w = (_high(fd) for pair in (os.pipe(), os.pipe())
                                                        for fd in pair)
        flags = [
            "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe",
            f"--user-data-dir={profile}", "--no-first-run", "--no-default-browser-check",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--disable-extensions", "--disable-default-apps", "--disable-breakpad",
            "--disable-features=Translate,OptimizationHints,MediaRouter,NetworkTimeServiceQuerying,"
            "AutofillServerCommunication,PreconnectToSearch,CertificateTransparencyComponentUpdater",
            "--disable-client-side-phishing-detection", "--disable-domain-reliability",
            "--no-pings", "--disable-dev-shm-usage",
            "--metrics-recording-only", "--mute-audio", "--hide-scrollbars",
            "--window-size=1280,900", "--lang=en-US",
            # nothing but 127.0.0.1: no host name resolves, and whatever is not loopback (an IP
            # address too) goes to the dead-end proxy (loopback bypasses a proxy by default)
            '--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1',
            f"--proxy-server=http://127.0.0.1:{proxy_port}",
            "about:blank",
        ]
        # bash (dash takes one-digit fds only) puts the pipe's ends on fds 3 and 4, then becomes
        # the browser
        script = f'exec "$0" "$@" 3<&{to_chrome_r} 4>&{from_chrome_w} {to_chrome_r}<&- {from_chrome_w}>&-'
        self._log = open(profile / "chromium.log", "w+b")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(["bash", "-c", script, binary, *flags],
                                     pass_fds=(to_chrome_r, from_chrome_w),
                                     stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._buffer = b""
        self._next_id = 0
        self._answers: dict[int, dict] = {}
        self.events: list[dict] = []

    def _log_tail(self) -> str:
        self._log.seek(0)
        lines = [line for line in self._log.read().decode(errors="replace").splitlines()
                 if line.strip()]
        return " | ".join(lines[-3:])

    def _pump(self, timeout: float) -> None:
        """Read what the browser wrote within ``timeout`` seconds; sort answers from events."""
        ready, _, _ = select.select([self._r], [], [], max(timeout, 0))
        if not ready:
            return
        chunk = os.read(self._r, 1 << 20)
        if not chunk:
            raise BrowserError(f"chromium exited ({self.proc.poll()}): {self._log_tail()}")
        self._buffer += chunk
        *messages, self._buffer = self._buffer.split(b"\0")
        for raw in messages:
            message = json.loads(raw)
            if "id" in message:
                self._answers[message["id"]] = message
                continue
            self.events.append(message)
            if message.get("method") == "Target.attachedToTarget":
                # a worker or a frame of the page: record its requests too, then let it run
                child = message["params"]["sessionId"]
                self._send("Network.enable", {}, child)
                self._send("Runtime.runIfWaitingForDebugger", {}, child)

    def _send(self, method: str, params: dict, session: str | None) -> int:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        data = json.dumps(message).encode() + b"\0"
        while data:
            data = data[os.write(self._w, data):]
        return self._next_id

    def call(self, method: str, params: dict | None = None, session: str | None = None,
             timeout: float = 30.0) -> dict:
        """Send one command and wait for its answer (its ``result``)."""
        number = self._send(method, params or {}, session)
        deadline = time.monotonic() + timeout
        while number not in self._answers:
            if time.monotonic() > deadline:
                raise BrowserError(f"{method}: no answer in {timeout:.0f} s")
            self._pump(deadline - time.monotonic())
        answer = self._answers.pop(number)
        if "error" in answer:
            raise BrowserError(f"{method}: {answer['error'].get('message')}")
        return answer.get("result", {})

    def wait_event(self, method: str, session: str, timeout: float) -> dict | None:
        """The first buffered or coming event ``method`` of ``session``, or None after timeout."""
        deadline = time.monotonic() + timeout
        while True:
            for event in self.events:
                if event.get("method") == method and event.get("sessionId") == session:
                    return event
            if time.monotonic() > deadline:
                return None
            self._pump(min(0.5, deadline - time.monotonic()))

    def settle(self, quiet: float = 0.5, limit: float = 5.0) -> None:
        """Read events until none came for ``quiet`` seconds (at most ``limit`` seconds)."""
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            before = len(self.events)
            end = min(time.monotonic() + quiet, deadline)
            while time.monotonic() < end:
                self._pump(end - time.monotonic())
            if len(self.events) == before:
                return

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=5)
        except (BrowserError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)  # the browser's own process group (start_new_session)
            self.proc.wait()
        for fd in (self._r, self._w):
            os.close(fd)
        self._log.close()


def proxy_host(line: str) -> str:
    """The host of a proxied request line (``CONNECT host:443 ...`` or ``GET http://host/...``)."""
    parts = line.split()
    target = parts[1] if len(parts) > 1 else line
    if "://" in target:
        return urlsplit(target).hostname or target
    return target.rsplit(":", 1)[0]
