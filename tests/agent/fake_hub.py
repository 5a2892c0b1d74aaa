"""A stand-in for Hugging Face over HTTP on loopback, for real agent processes: they reach
it through HF_ENDPOINT, with huggingface_hub's own client, so what is tested is what a
cluster asks of the real hub. It serves one model directory as a repository at one commit:
the repository's info and file tree (what snapshot_download lists), HEAD and GET of each
file (range requests too: get_safetensors_metadata reads the safetensors headers that way),
at a limited rate so a download lasts long enough to be seen in status.

It counts, per file, the whole-file GETs and the bytes they served (a range request reads a
header, not the file) - the record a test checks "each file downloaded once" against.
"""
from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"
CHUNK = 64 * 1024


class FakeHub:
    def __init__(self, repo_id: str, directory: Path, host: str = "127.0.0.1", bytes_per_s: float = 0) -> None:
        self.repo_id, self.directory, self.bytes_per_s = repo_id, directory, bytes_per_s
        self.files = {f.name: f for f in sorted(directory.iterdir()) if f.is_file()}
        self.etags = {name: hashlib.sha256(f.read_bytes()).hexdigest() for name, f in self.files.items()}
        self.whole_gets: Counter[str] = Counter()
        """file -> GETs of the whole file."""
        self.whole_bytes: Counter[str] = Counter()
        """file -> bytes served by those GETs."""
        self.range_gets: Counter[str] = Counter()
        self.lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                hub._serve(self, body=False)

            def do_GET(self) -> None:
                hub._serve(self, body=True)

        self.server = ThreadingHTTPServer((host, 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://{host}:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=5)

    # ------------------------------------------------------------------------------

    def _json(self, h: BaseHTTPRequestHandler, value: object, body: bool) -> None:
        data = json.dumps(value).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if body:
            h.wfile.write(data)

    def _missing(self, h: BaseHTTPRequestHandler) -> None:
        h.send_response(404)
        h.send_header("X-Error-Code", "EntryNotFound")
        h.send_header("Content-Length", "0")
        h.end_headers()

    def _serve(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlparse(h.path).path)
        api = f"/api/models/{self.repo_id}/"
        if path.startswith(api + "revision/"):
            self._json(h, {"id": self.repo_id, "modelId": self.repo_id, "sha": COMMIT, "private": False,
                           "siblings": [{"rfilename": n} for n in self.files]}, body)
        elif path.startswith(api + "tree/"):
            self._json(h, [{"type": "file", "path": n, "size": f.stat().st_size, "oid": self.etags[n][:40]}
                           for n, f in self.files.items()], body)
        elif path.startswith(f"/{self.repo_id}/resolve/"):
            name = path.rsplit("/", 1)[1]
            if name not in self.files:
                self._missing(h)
            else:
                self._file(h, name, body)
        else:
            self._missing(h)

    def _file(self, h: BaseHTTPRequestHandler, name: str, body: bool) -> None:
        data = self.files[name].read_bytes()
        start, end = 0, len(data)
        ranged = h.headers.get("Range")
        if ranged and ranged.startswith("bytes="):
            a, _, b = ranged[len("bytes="):].partition("-")
            start, end = int(a or 0), min(len(data), int(b) + 1 if b else len(data))
        h.send_response(206 if ranged else 200)
        h.send_header("X-Repo-Commit", COMMIT)
        h.send_header("ETag", f'"{self.etags[name]}"')
        h.send_header("Content-Length", str(end - start))
        if ranged:
            h.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
        h.end_headers()
        if not body:
            return
        with self.lock:
            if ranged:
                self.range_gets[name] += 1
            else:
                self.whole_gets[name] += 1
        sent = 0
        began = time.monotonic()
        for i in range(start, end, CHUNK):
            piece = data[i:min(i + CHUNK, end)]
            try:
                h.wfile.write(piece)
            except OSError:
                break
            sent += len(piece)
            if not ranged:
                with self.lock:
                    self.whole_bytes[name] += len(piece)
            if self.bytes_per_s and not ranged:
                ahead = sent / self.bytes_per_s - (time.monotonic() - began)
                if ahead > 0:
                    time.sleep(ahead)
