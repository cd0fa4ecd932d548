"""A minimal local stand-in for the Hugging Face Hub, for offline tests.

Serves ``root/<org>/<name>/<files>`` as model repo ``<org>/<name>`` through the
``/{repo_id}/resolve/{revision}/{filename}`` route that ``hf_hub_download`` uses
(a HEAD for metadata, then a GET for the content, honouring ``Range``). Point a client at it with
``HF_ENDPOINT``; see :func:`hub_env`.

Beyond that, as the Hub answers:
- ``gated``: repo id -> the tokens with access. Others get 401 without a token and 403 with one, with
  ``X-Error-Code: GatedRepo`` (what huggingface_hub turns into ``GatedRepoError``).
- ``broken``: repo ids whose files answer HTTP 500.
- ``cut``: ``repo_id/filename`` -> byte offset. Every GET of that file announces the whole length (or
  range), then stops at that offset of the file and drops the connection (a download cut short); with the
  key also in ``cut_once``, only the next GET is cut.
- Uploads for ``HfApi.create_repo`` and ``upload_folder``/``create_commit`` (every file sent inline).

Two Hubs that cannot be asked, for the no-network paths: :func:`closed_port_url` (connection refused) and
:class:`BlackHoleHub` (a server that accepts connections, counts them, and never answers).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import socket
import threading
from functools import lru_cache
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from urllib.parse import unquote, urlsplit

import pytest
import yaml
from huggingface_hub import constants

_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")
_CREATE = "/api/repos/create"
_VALIDATE_YAML = "/api/validate-yaml"
_PREUPLOAD = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/preupload/(?P<rev>[^/]+)$")
_COMMIT = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/commit/(?P<rev>[^/]+)$")
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

    def do_POST(self) -> None:
        self.hub.requests.append(f"POST {self.path}")
        path = urlsplit(self.path).path
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if path == _CREATE:
            payload = json.loads(body)
            repo_id = f"{payload.get('organization') or 'user'}/{payload['name']}"
            repo = self.hub.root / repo_id
            answer = {"url": f"{self.hub.url}/{repo_id}", "name": repo_id}
            if repo.is_dir():
                return self._json({"error": "You already created this model repo", **answer}, 409)
            repo.mkdir(parents=True)
            return self._json(answer)
        if path == _VALIDATE_YAML:  # the model card's metadata block must parse as a YAML mapping
            content = json.loads(body)["content"]
            _, _, rest = content.partition("---\n")
            try:
                valid = isinstance(yaml.safe_load(rest.partition("\n---")[0]), dict)
            except yaml.YAMLError:
                valid = False
            return self._json({} if valid else {"errors": [{"message": "invalid metadata"}]}, 200 if valid else 400)
        if match := _PREUPLOAD.match(path):
            files = json.loads(body)["files"]
            return self._json(
                {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]}
            )
        if match := _COMMIT.match(path):
            repo = self.hub.root / unquote(match["repo"])
            if not repo.is_dir():
                return self._error("RepoNotFound", "Repository not found")
            for line in body.splitlines():
                item = json.loads(line)
                if item["key"] == "file":
                    target = repo / item["value"]["path"]
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(base64.b64decode(item["value"]["content"]))
            commit = _commit(repo)
            return self._json({"commitUrl": f"{self.hub.url}/{match['repo']}/commit/{commit}", "commitOid": commit})
        return self._error("RepoNotFound", "Repository not found")

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _json(self, payload: object, status: int = 200) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, code: str, message: str, commit: str | None = None, status: int = 404) -> None:
        self.send_response(status)
        if code:
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
        repo_id = unquote(match["repo"])
        if repo_id in self.hub.broken:
            return self._error("", "Internal Error", status=500)
        if repo_id in self.hub.gated:
            token = self.headers.get("Authorization", "").removeprefix("Bearer ")
            if token not in self.hub.gated[repo_id]:
                status, why = (403, "you are not in the authorized list") if token else (401, "please log in")
                message = (
                    f"Access to model {repo_id} is restricted: {why}. Visit {self.hub.url}/{repo_id} to ask for access."
                )
                return self._error("GatedRepo", message, status=status)
        commit = _commit(repo)
        if unquote(match["rev"]) not in ("main", commit):
            return self._error("RevisionNotFound", "Invalid rev id")
        path = (repo / unquote(match["file"])).resolve()
        if not path.is_file() or not path.is_relative_to(repo):
            return self._error("EntryNotFound", "Entry not found", commit)

        if send_body and self.headers.get("Range"):
            self.hub.ranges.append(f"{self.path} {self.headers['Range']}")
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
            key = f"{repo_id}/{unquote(match['file'])}"
            cut = self.hub.cut.get(key)
            if key in self.hub.cut_once:
                self.hub.cut_once.discard(key)
                self.hub.cut.pop(key, None)
            stop = end + 1 if cut is None else min(end + 1, max(cut, start))
            with path.open("rb") as f:
                f.seek(start)
                self.wfile.write(f.read(stop - start))
            if stop <= end:  # cut short: the connection drops before Content-Length bytes came
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)


class LocalHub:
    """Serve ``root`` as a Hub endpoint on 127.0.0.1 while the context is open."""

    def __init__(self, root: Path, gated: dict[str, set[str]] | None = None) -> None:
        self.root = Path(root).resolve()
        self.requests: list[str] = []
        self.gated: dict[str, set[str]] = dict(gated or {})
        self.cut: dict[str, int] = {}
        self.cut_once: set[str] = set()  # keys of `cut` that apply to one GET only
        self.broken: set[str] = set()  # repo ids whose files answer HTTP 500
        self.ranges: list[str] = []  # "<path> <Range header>" of each ranged GET
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


class BlackHoleHub:
    """A loopback endpoint that accepts every connection and never answers, while the context is open.

    ``connections`` counts the connections accepted (each request that a retry or a second question adds).
    """

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.05)  # so the accept loop sees the context close
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self.connections = 0
        self._accepted: list[socket.socket] = []  # held open, unread and unanswered
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)

    def _accept(self) -> None:
        while not self._closing.is_set():
            try:
                connection, _ = self._listener.accept()
            except TimeoutError:
                continue
            self._accepted.append(connection)
            self.connections += 1

    def __enter__(self) -> BlackHoleHub:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._closing.set()
        self._thread.join()
        self._listener.close()
        for connection in self._accepted:
            connection.close()


def closed_port_url() -> str:
    """An endpoint on a loopback port nothing listens on: every connection is refused at once."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def hub_env(hub: LocalHub | BlackHoleHub, hf_home: Path) -> dict[str, str]:
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


def point_client_at(hub: LocalHub, hf_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """This process's huggingface_hub talking only to ``hub``, its cache and token file under ``hf_home``, as
    HF_ENDPOINT and HF_HOME set them at import; no token in the environment, online."""
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(hf_home / "token"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
