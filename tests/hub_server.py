"""A minimal local stand-in for the Hugging Face Hub, for offline tests.

Serves ``root/<org>/<name>/<files>`` as model repo ``<org>/<name>`` through the
``/{repo_id}/resolve/{revision}/{filename}`` route that ``hf_hub_download`` uses
(a HEAD for metadata, then a GET for the content). Point a client at it with
``HF_ENDPOINT``; see :func:`hub_env`.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from functools import lru_cache
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from urllib.parse import unquote, urlsplit

_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")
_UNSET_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_TOKEN")


@lru_cache(maxsize=256)
def _sha256(path: Path, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _commit(repo: Path) -> str:
    """A 40-hex revision that changes whenever any file in the repo changes."""
    digest = hashlib.sha1()
    for path in sorted(p for p in repo.rglob("*") if p.is_file()):
        st = path.stat()
        digest.update(f"{path.relative_to(repo).as_posix()}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def _byte_range(header: str, size: int) -> tuple[int, int] | None:
    """Inclusive ``(start, end)`` of a single ``bytes=`` range, or None for a whole-file request."""
    match = _RANGE.match(header)
    if match is None or not any(match.groups()):
        return None
    first, last = match.groups()
    if not first:
        return max(size - int(last), 0), size - 1
    return int(first), min(int(last), size - 1) if last else size - 1


class _Handler(BaseHTTPRequestHandler):
    hub: LocalHub

    def do_HEAD(self) -> None:
        self._resolve(send_body=False)

    def do_GET(self) -> None:
        self._resolve(send_body=True)

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _error(self, code: str, message: str, commit: str | None = None) -> None:
        self.send_response(404)
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        if commit is not None:
            self.send_header("X-Repo-Commit", commit)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _resolve(self, send_body: bool) -> None:
        self.hub.requests.append(f"{self.command} {self.path}")
        match = _RESOLVE.match(urlsplit(self.path).path)
        if match is None:
            return self._error("RepoNotFound", "Repository not found")
        repo = (self.hub.root / unquote(match["repo"])).resolve()
        if repo.parent.parent != self.hub.root or not repo.is_dir():
            return self._error("RepoNotFound", "Repository not found")
        commit = _commit(repo)
        if unquote(match["rev"]) not in ("main", commit):
            return self._error("RevisionNotFound", "Invalid rev id")
        path = (repo / unquote(match["file"])).resolve()
        if not path.is_file() or not path.is_relative_to(repo):
            return self._error("EntryNotFound", "Entry not found", commit)

        st = path.stat()
        size = st.st_size
        span = _byte_range(self.headers.get("Range", ""), size)
        if span is not None and span[0] >= size:
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{size}")
            self.send_header("Content-Length", "0")
            return self.end_headers()
        start, end = span or (0, size - 1)
        self.send_response(200 if span is None else 206)
        self.send_header("X-Repo-Commit", commit)
        self.send_header("ETag", f'"{_sha256(path, size, st.st_mtime_ns)}"')
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(end - start + 1))
        if span is not None:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.end_headers()
        if send_body:
            with path.open("rb") as f:
                f.seek(start)
                self.wfile.write(f.read(end - start + 1))


class LocalHub:
    """Serve ``root`` as a Hub endpoint on 127.0.0.1 while the context is open."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root).resolve()
        self.requests: list[str] = []
        handler = type("Handler", (_Handler,), {"hub": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> LocalHub:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


def hub_env(hub: LocalHub, hf_home: Path) -> dict[str, str]:
    """Environment for a subprocess whose huggingface_hub should talk only to ``hub``."""
    env = dict(os.environ)
    for key in _UNSET_VARS:
        env.pop(key, None)
    env.update(
        HF_ENDPOINT=hub.url,
        HF_HOME=str(hf_home),
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_DISABLE_XET="1",
    )
    return env
