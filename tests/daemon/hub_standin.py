"""A local stand-in for the Hugging Face hub's HTTP API: what ``huggingface_hub.snapshot_download`` asks of a
public model repo (revision info, the file tree, each file's HEAD and GET), served from memory on 127.0.0.1."""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@contextlib.contextmanager
def hub_standin(repo: str, files: dict[str, bytes], commit: str = "c" * 40):
    """Serve ``files`` as model repo ``repo`` at ``commit`` for the ``with`` block; yields ``(endpoint,
    requests)``: the base URL (for ``HF_ENDPOINT``) and the ``(method, path)`` of every request served."""
    requests: list[tuple[str, str]] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def _answer(self, status: int, body: bytes, headers: dict[str, str], head: bool) -> None:
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _route(self, head: bool) -> None:
            path = self.path.split("?")[0]
            requests.append((self.command, path))
            as_json = {"Content-Type": "application/json"}
            if path.startswith(f"/api/models/{repo}/revision/"):
                info = {"id": repo, "sha": commit, "siblings": [{"rfilename": name} for name in files]}
                return self._answer(200, json.dumps(info).encode(), as_json, head)
            if path.startswith(f"/api/models/{repo}/tree/"):
                tree = [{"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                        for name, data in files.items()]
                return self._answer(200, json.dumps(tree).encode(), as_json, head)
            prefix = f"/{repo}/resolve/"
            if path.startswith(prefix) and path[len(prefix):].split("/", 1)[-1] in files:
                data = files[path[len(prefix):].split("/", 1)[1]]
                return self._answer(200, data, {"X-Repo-Commit": commit,
                                                "ETag": f'"{hashlib.sha1(data).hexdigest()}"'}, head)
            return self._answer(404, b'{"error": "Repository not found"}',
                                {"X-Error-Code": "RepoNotFound", **as_json}, head)

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self._route(False)

        def do_HEAD(self) -> None:  # noqa: N802
            self._route(True)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", requests
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
