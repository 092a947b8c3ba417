"""A small Hugging Face Hub look-alike for tests: the endpoints the real huggingface_hub client calls
to create a repo, upload a folder and download files, over plain HTTP on 127.0.0.1.

Point a client at it with HF_ENDPOINT=server.url and HF_HUB_DISABLE_XET=1 (in a subprocess: huggingface_hub
reads both at import time). Storage is in memory: repos hold commits (full snapshots of git blobs) and refs
(branches and pull-request refs).

Uploads take the paths the Hub assigns. preupload answers "lfs" for a file that the repo's .gitattributes sends to
LFS (*.safetensors, *.bin), that is 10 MiB or more, or whose sample holds a NUL byte (binary), and "regular"
otherwise. A regular file travels inline (base64) in the commit. An LFS file goes through the Git LFS batch API:
the client POSTs {repo}.git/info/lfs/objects/batch, PUTs the bytes to the signed upload URL it is given (on a
second port, `storage_url`: another origin, like the Hub's S3, so the client sends it no token), POSTs the verify
URL, and the commit then names the object (sha256 and size); the commit stores the LFS pointer as git does.
Downloads of an LFS file redirect, as the Hub does, to the storage origin with X-Linked-Etag (the sha256) and
X-Linked-Size. Xet storage is not served: its token endpoint answers 501, so a client that tries Xet fails loudly
(huggingface_hub uses Xet whenever hf_xet is installed, unless HF_HUB_DISABLE_XET is set).

Each request is recorded with its Authorization header; `fail` makes a route answer an HTTP error.

Dataset repos answer the same routes under /api/datasets/ and /datasets/{repo}/resolve/ (one namespace with the
models'). Downloads honour a `Range: bytes=a-b` header (206), as a streamed dataset's reads of parts of a file need.

Endpoints: POST /api/repos/create, POST /api/validate-yaml, GET /api/whoami-v2,
GET /api/models/{repo}[/revision/{rev}], POST /api/models/{repo}/preupload/{rev},
POST /api/models/{repo}/commit/{rev}, POST /api/models/{repo}/branch/{branch},
GET /api/models/{repo}/tree/{rev}[/{path}], POST /api/models/{repo}/discussions,
GET /api/models/{repo}/discussions/{num}, HEAD and GET /{repo}/resolve/{rev}/{path},
POST /{repo}.git/info/lfs/objects/batch and /{repo}.git/info/lfs/objects/verify; on the storage origin
PUT and GET /lfs-objects/{sha256}.
"""
from __future__ import annotations

import base64
import fnmatch
import hashlib
import hmac
import json
import re
import threading
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional
from urllib.parse import parse_qs, unquote, urlsplit

GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n*.bin filter=lfs diff=lfs merge=lfs -text\n"
LFS_SIZE = 10 * 1024 * 1024  # files this large always go to LFS, whatever .gitattributes says
LFS_POINTER = re.compile(rb"version https://git-lfs.github.com/spec/v1\noid sha256:([0-9a-f]{64})\nsize (\d+)\n")


def _now() -> str:
    """The Hub's timestamp format: 2024-01-31T12:34:56.789Z."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def git_blob_sha1(content: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


def lfs_pointer(oid: str, size: int) -> bytes:
    """The git blob that stands for an LFS object (git-lfs spec v1)."""
    return b"version https://git-lfs.github.com/spec/v1\noid sha256:%s\nsize %d\n" % (oid.encode(), size)


def parse_lfs_pointer(blob: bytes) -> Optional[tuple[str, int]]:
    """(sha256, size) of an LFS pointer blob, None for any other blob."""
    match = LFS_POINTER.fullmatch(blob)
    return (match.group(1).decode(), int(match.group(2))) if match else None


def lfs_patterns(gitattributes: bytes) -> list[str]:
    return [line.split()[0] for line in gitattributes.decode().splitlines()
            if line.strip() and not line.startswith("#") and "filter=lfs" in line.split()[1:]]


@dataclass
class Request:
    method: str
    path: str
    authorization: Optional[str]
    route: str


@dataclass
class Repo:
    repo_id: str
    private: bool
    commits: dict = field(default_factory=dict)  # sha -> {"files": {path: git blob}, "parent", "message"}
    refs: dict = field(default_factory=dict)  # "main", "branch", "refs/pr/1" -> sha
    discussions: dict = field(default_factory=dict)  # num -> {"title", "description"}


class HubError(Exception):
    def __init__(self, status: int, message: str, code: Optional[str] = None, headers: Optional[dict] = None,
                 body: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers or {}
        self.body = body or {}


class HubServer:
    """`with HubServer(tokens={"hf_x"}) as hub:` ... `hub.url`, `hub.requests`, `hub.files("user/repo")`."""

    def __init__(self, tokens: Optional[set] = None, username: str = "user"):
        self.tokens = set(tokens) if tokens is not None else None  # None: any token is valid
        self.username = username
        self.repos: dict[str, Repo] = {}
        self.lfs_objects: dict[str, bytes] = {}  # sha256 -> bytes, what LFS uploads stored
        self.requests: list[Request] = []
        self.fail: dict[tuple[str, str], int] = {}  # (method, route) -> status, e.g. ("POST", "create"): 403
        self.lock = threading.RLock()
        self._counter = 0
        self._servers: list[tuple[ThreadingHTTPServer, threading.Thread]] = []  # the Hub, then the storage
        self._signing_key = hashlib.sha256(str(id(self)).encode()).digest()

    # ---- lifecycle -------------------------------------------------------------------------------------
    def start(self) -> "HubServer":
        server = self

        class Handler(_Handler):
            hub = server

        for name in ("hub-server", "hub-storage"):
            httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
            httpd.daemon_threads = True
            thread = threading.Thread(target=httpd.serve_forever, name=name, daemon=True)
            thread.start()
            self._servers.append((httpd, thread))
        return self

    def stop(self) -> None:
        for httpd, thread in self._servers:
            httpd.shutdown()
            httpd.server_close()
            thread.join(timeout=5)
        self._servers = []

    def __enter__(self) -> "HubServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def url(self) -> str:
        host, port = self._servers[0][0].server_address[:2]
        return f"http://{host}:{port}"

    @property
    def storage_url(self) -> str:
        """The LFS storage's origin (another port: the client treats it as off the Hub, like S3)."""
        host, port = self._servers[1][0].server_address[:2]
        return f"http://{host}:{port}"

    def signature(self, oid: str) -> str:
        return hmac.new(self._signing_key, oid.encode(), "sha256").hexdigest()

    # ---- inspection ------------------------------------------------------------------------------------
    def blobs(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        """The git blobs of `revision`: file contents, and LFS pointers for LFS files."""
        with self.lock:
            repo = self.repos[repo_id]
            return dict(repo.commits[repo.refs[revision]]["files"])

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        """The contents of `revision`'s files, as a download gets them (LFS pointers resolved)."""
        with self.lock:
            return {path: self._content(blob) for path, blob in self.blobs(repo_id, revision).items()}

    def lfs_files(self, repo_id: str, revision: str = "main") -> dict[str, tuple[str, int]]:
        """path -> (sha256, size) of the LFS files of `revision`."""
        pointers = {path: parse_lfs_pointer(blob) for path, blob in self.blobs(repo_id, revision).items()}
        return {path: pointer for path, pointer in pointers.items() if pointer is not None}

    def head(self, repo_id: str, revision: str = "main") -> str:
        with self.lock:
            return self.repos[repo_id].refs[revision]

    def commit_log(self, repo_id: str, revision: str = "main") -> list[str]:
        """Commit messages from the head of `revision` back to the first commit."""
        with self.lock:
            repo, sha, out = self.repos[repo_id], self.repos[repo_id].refs[revision], []
            while sha:
                out.append(repo.commits[sha]["message"])
                sha = repo.commits[sha]["parent"]
            return out

    def authorizations(self) -> list[Optional[str]]:
        return [r.authorization for r in self.requests]

    # ---- storage helpers (called with the lock held) -------------------------------------------------------
    def _content(self, blob: bytes) -> bytes:
        pointer = parse_lfs_pointer(blob)
        return blob if pointer is None else self.lfs_objects[pointer[0]]

    def _new_commit(self, repo: Repo, parent: Optional[str], files: dict, message: str) -> str:
        self._counter += 1
        digest = hashlib.sha1(f"{repo.repo_id}|{parent}|{message}|{self._counter}".encode())
        for path in sorted(files):
            digest.update(path.encode() + git_blob_sha1(files[path]).encode())
        sha = digest.hexdigest()
        repo.commits[sha] = {"files": dict(files), "parent": parent, "message": message,
                             "date": _now()}
        return sha

    def _repo(self, repo_id: str, token_ok: bool) -> Repo:
        repo = self.repos.get(repo_id)
        if repo is None or (repo.private and not token_ok):
            raise HubError(404, "Repository not found", "RepoNotFound")
        return repo

    def _sha(self, repo: Repo, revision: str) -> str:
        if revision in repo.refs:
            return repo.refs[revision]
        if revision in repo.commits:
            return revision
        raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")


class _Handler(BaseHTTPRequestHandler):
    hub: HubServer
    protocol_version = "HTTP/1.0"

    def log_message(self, *args) -> None:  # keep test output clean
        pass

    # ---- plumbing ----------------------------------------------------------------------------------------
    def do_GET(self):
        self._handle("GET")

    def do_HEAD(self):
        self._handle("HEAD")

    def do_POST(self):
        self._handle("POST")

    def do_PUT(self):
        self._handle("PUT")

    def do_DELETE(self):
        self._handle("DELETE")

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":  # how a streamed PUT may come
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                chunk = self.rfile.read(size + 2)[:size]  # each chunk ends with CRLF
                if not size:
                    while self.rfile.readline().strip():  # trailers, then the closing CRLF
                        pass
                    return b"".join(chunks)
                chunks.append(chunk)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _handle(self, method: str) -> None:
        self.body = self._read_body()
        parts = urlsplit(self.path)
        self.query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        segments = [unquote(s) for s in parts.path.split("/")[1:]]
        auth = self.headers.get("Authorization")
        route, handler, args = self._route(method, segments)
        hub = self.hub
        with hub.lock:
            hub.requests.append(Request(method, self.path, auth, route))
            status = hub.fail.get((method, route))
        try:
            if status:
                raise HubError(status, {401: "Invalid credentials in Authorization header",
                                        403: "You don't have the rights to create a model under this namespace",
                                        429: "Too many requests"}.get(status, f"injected error {status}"))
            if handler is None:
                raise HubError(404, f"no route for {method} {parts.path}")
            token = auth[len("Bearer "):] if auth and auth.startswith("Bearer ") else None
            self.token_ok = token is not None and (hub.tokens is None or token in hub.tokens)
            self.token_given = token is not None
            handler(*args)
        except HubError as err:
            self._error(err)
        except Exception as err:  # noqa: BLE001 - a server bug: answer 500 rather than drop the connection
            self._error(HubError(500, f"{type(err).__name__}: {err}"))

    def _route(self, method: str, seg: list[str]):
        if seg[:2] == ["api", "repos"] and seg[2:] == ["create"] and method == "POST":
            return "create", self._create, ()
        if seg == ["api", "validate-yaml"] and method == "POST":
            return "validate", self._validate, ()
        if seg == ["api", "whoami-v2"] and method == "GET":
            return "whoami", self._whoami, ()
        if len(seg) >= 4 and seg[:2] in (["api", "models"], ["api", "datasets"]):
            repo_id, rest = "/".join(seg[2:4]), seg[4:]
            if not rest and method == "GET":
                return "info", self._info, (repo_id, "main")
            if len(rest) == 2 and rest[0] == "revision" and method == "GET":
                return "info", self._info, (repo_id, rest[1])
            if len(rest) == 2 and rest[0] == "preupload" and method == "POST":
                return "preupload", self._preupload, (repo_id, rest[1])
            if len(rest) == 2 and rest[0] == "commit" and method == "POST":
                return "commit", self._commit, (repo_id, rest[1])
            if len(rest) == 2 and rest[0] == "branch" and method == "POST":
                return "branch", self._branch, (repo_id, rest[1])
            if len(rest) >= 2 and rest[0] == "tree" and method == "GET":
                return "tree", self._tree, (repo_id, rest[1], "/".join(rest[2:]))
            if len(rest) in (1, 2) and rest[0] == "xet-write-token":
                return "xet", self._no_xet, ()
            if rest == ["discussions"] and method == "POST":
                return "discussion", self._new_discussion, (repo_id,)
            if len(rest) == 2 and rest[0] == "discussions" and method == "GET":
                return "discussion", self._discussion, (repo_id, rest[1])
        if seg[0] == "datasets" and len(seg) >= 6:  # a dataset repo's files: /datasets/{repo}/resolve/...
            seg = seg[1:]
        if len(seg) >= 5 and seg[2] == "resolve" and method in ("GET", "HEAD"):
            return "resolve", self._resolve, ("/".join(seg[:2]), seg[3], "/".join(seg[4:]), method)
        if len(seg) == 6 and seg[1].endswith(".git") and seg[2:5] == ["info", "lfs", "objects"] and method == "POST":
            repo_id = f"{seg[0]}/{seg[1][:-len('.git')]}"
            if seg[5] == "batch":
                return "lfs-batch", self._lfs_batch, (repo_id,)
            if seg[5] == "verify":
                return "lfs-verify", self._lfs_verify, (repo_id,)
        if len(seg) == 2 and seg[0] == "lfs-objects" and method == "PUT":
            return "lfs-upload", self._lfs_upload, (seg[1],)
        if len(seg) == 2 and seg[0] == "lfs-objects" and method in ("GET", "HEAD"):
            return "lfs-download", self._lfs_download, (seg[1], method)
        return "unknown", None, ()

    def _send(self, status: int, body: bytes = b"", headers: Optional[dict] = None,
              content_type: str = "application/json", send_body: bool = True) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if send_body and body:
            self.wfile.write(body)

    def _json(self, value, status: int = 200, headers: Optional[dict] = None) -> None:
        self._send(status, json.dumps(value).encode(), headers)

    def _error(self, err: HubError) -> None:
        headers = {"X-Error-Message": err.message, **err.headers}
        if err.code:
            headers["X-Error-Code"] = err.code
        body = json.dumps({"error": err.message, **err.body}).encode()
        self._send(err.status, body, headers, send_body=self.command != "HEAD")

    def _need_token(self) -> None:
        if not self.token_ok:
            raise HubError(401, "Invalid credentials in Authorization header" if self.token_given
                           else "Unauthorized: a token is required")

    def _payload(self) -> dict:
        try:
            return json.loads(self.body or b"{}")
        except ValueError as err:
            raise HubError(400, f"invalid JSON body: {err}") from None

    # ---- endpoints -------------------------------------------------------------------------------------
    def _whoami(self) -> None:
        self._need_token()
        self._json({"type": "user", "name": self.hub.username, "orgs": []})

    def _create(self) -> None:
        self._need_token()
        payload = self._payload()
        if payload.get("type", "model") != "model":
            raise HubError(400, "this test server only hosts model repos")
        repo_id = f"{payload.get('organization') or self.hub.username}/{payload['name']}"
        hub = self.hub
        with hub.lock:
            if repo_id in hub.repos:
                raise HubError(409, "You already created this model repo", body={"url": f"{hub.url}/{repo_id}"})
            repo = Repo(repo_id, private=payload.get("visibility") == "private" or bool(payload.get("private")))
            repo.refs["main"] = hub._new_commit(repo, None, {".gitattributes": GITATTRIBUTES}, "initial commit")
            hub.repos[repo_id] = repo
        self._json({"url": f"{hub.url}/{repo_id}", "name": repo_id, "id": repo_id})

    def _validate(self) -> None:
        import yaml

        content = self._payload().get("content", "")
        errors = []
        if content.startswith("---"):
            try:
                meta = yaml.safe_load(content.split("---", 2)[1])
                if meta is not None and not isinstance(meta, dict):
                    errors.append({"message": "metadata must be a mapping"})
            except (yaml.YAMLError, IndexError) as err:
                errors.append({"message": f"invalid YAML: {err}"})
        self._json({"errors": errors, "warnings": []}, status=400 if errors else 200)

    def _info(self, repo_id: str, revision: str) -> None:
        hub = self.hub
        with hub.lock:
            repo = hub._repo(repo_id, self.token_ok)
            sha = hub._sha(repo, revision)
            files = repo.commits[sha]["files"]
            self._json({"id": repo_id, "modelId": repo_id, "author": repo_id.split("/")[0], "sha": sha,
                        "private": repo.private, "disabled": False, "gated": False, "tags": [],
                        "lastModified": repo.commits[sha]["date"],
                        "siblings": [{"rfilename": p} for p in sorted(files)]})

    def _preupload(self, repo_id: str, revision: str) -> None:
        self._need_token()
        hub = self.hub
        with hub.lock:
            repo = hub._repo(repo_id, True)
            files = repo.commits[hub._sha(repo, revision)]["files"]
        patterns = lfs_patterns(files.get(".gitattributes", b""))
        out = []
        for item in self._payload().get("files", []):
            path, size, sample = item["path"], int(item["size"]), base64.b64decode(item.get("sample", ""))
            lfs = size >= LFS_SIZE or b"\0" in sample or any(
                fnmatch.fnmatchcase(path if "/" in pattern else path.rsplit("/", 1)[-1], pattern)
                for pattern in patterns)
            existing = files.get(path)
            pointer = parse_lfs_pointer(existing) if existing is not None else None
            # the client compares this with its own oid: sha256 of the content for LFS, the git blob sha1 otherwise
            oid = None if existing is None else pointer[0] if pointer else git_blob_sha1(existing)
            out.append({"path": path, "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False, "oid": oid})
        self._json({"files": out, "commitOid": None})

    def _no_xet(self) -> None:
        raise HubError(501, "this test Hub serves no Xet storage: set HF_HUB_DISABLE_XET=1 to upload through LFS")

    def _lfs_batch(self, repo_id: str) -> None:
        """The Git LFS batch API (upload): signed upload and verify actions for the objects not yet stored."""
        self._need_token()
        payload = self._payload()
        if payload.get("operation") != "upload" or payload.get("hash_algo", "sha256") != "sha256":
            raise HubError(400, "this test Hub's LFS batch API only takes sha256 uploads")
        if "basic" not in payload.get("transfers", ["basic"]):
            raise HubError(400, "this test Hub's LFS batch API only serves the basic transfer")
        hub = self.hub
        objects = []
        with hub.lock:
            hub._repo(repo_id, True)
            for obj in payload.get("objects", []):
                oid, size = obj["oid"], int(obj["size"])
                stored = hub.lfs_objects.get(oid)
                if not re.fullmatch(r"[0-9a-f]{64}", oid):
                    objects.append({"oid": oid, "size": size, "error": {"code": 422, "message": "invalid oid"}})
                elif stored is not None and len(stored) != size:
                    objects.append({"oid": oid, "size": size,
                                    "error": {"code": 422, "message": f"stored with size {len(stored)}"}})
                elif stored is not None:  # already there: no actions, the client skips the upload
                    objects.append({"oid": oid, "size": size, "authenticated": True})
                else:
                    upload = f"{hub.storage_url}/lfs-objects/{oid}?size={size}&signature={hub.signature(oid)}"
                    verify = f"{hub.url}/{repo_id}.git/info/lfs/objects/verify"
                    objects.append({"oid": oid, "size": size, "authenticated": True,
                                    "actions": {"upload": {"href": upload, "header": {}},
                                                "verify": {"href": verify, "header": {}}}})
        self._send(200, json.dumps({"transfer": "basic", "objects": objects}).encode(),
                   content_type="application/vnd.git-lfs+json")

    def _lfs_upload(self, oid: str) -> None:
        """The signed PUT of the storage origin: the bytes must have the announced size and sha256."""
        hub = self.hub
        if not hmac.compare_digest(self.query.get("signature", ""), hub.signature(oid)):
            raise HubError(403, "the upload URL's signature is invalid")
        if len(self.body) != int(self.query.get("size", -1)) or hashlib.sha256(self.body).hexdigest() != oid:
            raise HubError(400, f"the uploaded bytes are not the object {oid} of size {self.query.get('size')}")
        with hub.lock:
            hub.lfs_objects[oid] = self.body
        self._send(200, b"", {"ETag": f'"{hashlib.md5(self.body).hexdigest()}"'})

    def _lfs_verify(self, repo_id: str) -> None:
        self._need_token()
        payload = self._payload()
        hub = self.hub
        with hub.lock:
            hub._repo(repo_id, True)
            stored = hub.lfs_objects.get(payload.get("oid", ""))
        if stored is None or len(stored) != payload.get("size"):
            raise HubError(404, f"LFS object {payload.get('oid')} of size {payload.get('size')} was not uploaded")
        self._json({"success": True})

    def _lfs_download(self, oid: str, method: str) -> None:
        with self.hub.lock:
            content = self.hub.lfs_objects.get(oid)
        if content is None:
            raise HubError(404, "no such LFS object")
        self._send_ranged(content, {"ETag": f'"{oid}"'}, method)

    def _send_ranged(self, content: bytes, headers: dict, method: str) -> None:
        """The bytes, or the part a `Range: bytes=a-b` header asks for (206), as the Hub's storage serves them to
        readers of parts of a file (a streamed dataset reads a parquet file's footer, then its row groups)."""
        match = re.fullmatch(r"bytes=(\d*)-(\d*)", self.headers.get("Range", ""))
        if match is None:
            self._send(200, content, {**headers, "Accept-Ranges": "bytes"}, content_type="application/octet-stream",
                       send_body=method == "GET")
            return
        first, last = match.groups()
        start = int(first) if first else max(0, len(content) - int(last))
        end = min(len(content) - 1, int(last)) if first and last else len(content) - 1
        self._send(206, content[start:end + 1], {**headers, "Content-Range": f"bytes {start}-{end}/{len(content)}"},
                   content_type="application/octet-stream", send_body=method == "GET")

    def _commit(self, repo_id: str, revision: str) -> None:
        self._need_token()
        lines = [json.loads(line) for line in self.body.splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            raise HubError(400, "the commit payload must start with a header line")
        header = lines[0]["value"]
        hub = self.hub
        with hub.lock:
            repo = hub._repo(repo_id, True)
            create_pr = self.query.get("create_pr") == "1"
            parent = hub._sha(repo, revision)
            if not create_pr and revision not in repo.refs:
                raise HubError(400, f"cannot commit to {revision}: not a branch")
            if header.get("parentCommit") and not parent.startswith(header["parentCommit"]):
                raise HubError(412, "A commit has happened since. Please refresh and try again.")
            files = dict(repo.commits[parent]["files"])
            for line in lines[1:]:
                key, value = line.get("key"), line.get("value", {})
                if key == "file":
                    if value.get("encoding", "base64") != "base64":
                        raise HubError(400, "only base64 file content is supported")
                    files[value["path"]] = base64.b64decode(value["content"])
                elif key == "lfsFile":
                    oid, stored = value["oid"], hub.lfs_objects.get(value["oid"])
                    if value.get("algo", "sha256") != "sha256" or stored is None or (
                            "size" in value and value["size"] != len(stored)):
                        raise HubError(422, f"Your push was rejected because an LFS pointer pointed to a file that "
                                            f"does not exist ({value['path']}: {oid})")
                    files[value["path"]] = lfs_pointer(oid, len(stored))
                elif key == "deletedFile":
                    if value["path"] not in files:
                        raise HubError(404, "A file with this name doesn't exist", "EntryNotFound")
                    del files[value["path"]]
                elif key == "deletedFolder":
                    prefix = value["path"].rstrip("/") + "/"
                    files = {p: c for p, c in files.items() if not p.startswith(prefix)}
                else:
                    raise HubError(400, f"unsupported commit operation {key!r}")
            sha = hub._new_commit(repo, parent, files, header.get("summary", ""))
            pr_url = None
            if create_pr:
                num = len(repo.discussions) + 1
                repo.discussions[num] = {"title": header.get("summary", ""), "description": ""}
                repo.refs[f"refs/pr/{num}"] = sha
                pr_url = f"{hub.url}/{repo_id}/discussions/{num}"
            else:
                repo.refs[revision] = sha
        self._json({"success": True, "commitOid": sha, "commitUrl": f"{hub.url}/{repo_id}/commit/{sha}",
                    "pullRequestUrl": pr_url, "hookOutput": ""})

    def _branch(self, repo_id: str, branch: str) -> None:
        self._need_token()
        hub = self.hub
        with hub.lock:
            repo = hub._repo(repo_id, True)
            if branch in repo.refs:
                raise HubError(409, f"Reference refs/heads/{branch} already exists")
            repo.refs[branch] = hub._sha(repo, self._payload().get("startingPoint") or "main")
        self._json({"success": True})

    def _tree(self, repo_id: str, revision: str, path: str) -> None:
        hub = self.hub
        with hub.lock:
            repo = hub._repo(repo_id, self.token_ok)
            files = repo.commits[hub._sha(repo, revision)]["files"]
        prefix = path.rstrip("/") + "/" if path else ""
        recursive = self.query.get("recursive", "false").lower() == "true"
        entries, folders = [], set()
        for name in sorted(files):
            if not name.startswith(prefix):
                continue
            rel = name[len(prefix):]
            if "/" in rel and not recursive:
                folders.add(prefix + rel.split("/")[0])
                continue
            entry = {"type": "file", "path": name, "size": len(files[name]), "oid": git_blob_sha1(files[name])}
            pointer = parse_lfs_pointer(files[name])
            if pointer is not None:
                entry.update(size=pointer[1], lfs={"oid": pointer[0], "size": pointer[1],
                                                   "pointerSize": len(files[name])})
            entries.append(entry)
        entries += [{"type": "directory", "path": f, "oid": hashlib.sha1(f.encode()).hexdigest()}
                    for f in sorted(folders)]
        self._json(entries)

    def _new_discussion(self, repo_id: str) -> None:
        self._need_token()
        payload = self._payload()
        hub = self.hub
        with hub.lock:
            repo = hub._repo(repo_id, True)
            num = len(repo.discussions) + 1
            repo.discussions[num] = {"title": payload.get("title", ""), "description": payload.get("description", "")}
            if payload.get("pullRequest"):
                repo.refs[f"refs/pr/{num}"] = repo.refs["main"]
        self._json({"num": num, "url": f"{hub.url}/{repo_id}/discussions/{num}"})

    def _discussion(self, repo_id: str, num: str) -> None:
        hub = self.hub
        with hub.lock:
            repo = hub._repo(repo_id, self.token_ok)
            info = repo.discussions.get(int(num)) if num.isdigit() else None
            if info is None:
                raise HubError(404, "Discussion not found")
            is_pr = f"refs/pr/{num}" in repo.refs
        self._json({"title": info["title"], "num": int(num), "author": {"name": hub.username},
                    "createdAt": _now(), "status": "draft" if is_pr else "open",
                    "repo": {"name": repo_id, "type": "model"}, "isPullRequest": is_pr, "events": [],
                    "changes": {"base": "refs/heads/main"}, "filesWithConflicts": [], "diff": ""})

    def _resolve(self, repo_id: str, revision: str, path: str, method: str) -> None:
        hub = self.hub
        with hub.lock:
            repo = hub._repo(repo_id, self.token_ok)
            sha = hub._sha(repo, revision)
            content = repo.commits[sha]["files"].get(path)
        if content is None:
            raise HubError(404, "Entry not found", "EntryNotFound", headers={"X-Repo-Commit": sha})
        etag = git_blob_sha1(content)
        pointer = parse_lfs_pointer(content)
        if pointer is not None:  # as the Hub does: a redirect to the storage, the object's sha256 and size
            oid, size = pointer
            self._send(302, b"", {"X-Repo-Commit": sha, "ETag": f'"{etag}"', "X-Linked-Etag": f'"{oid}"',
                                  "X-Linked-Size": str(size), "Location": f"{hub.storage_url}/lfs-objects/{oid}"},
                       send_body=False)
            return
        self._send_ranged(content, {"X-Repo-Commit": sha, "ETag": f'"{etag}"'}, method)


def put_files(hub: HubServer, repo_id: str, files: dict[str, bytes], message: str = "edit on the Hub",
              revision: str = "main") -> str:
    """A commit made outside the client (like an edit in the Hub's web UI); returns its sha."""
    with hub.lock:
        repo = hub.repos[repo_id]
        parent = repo.refs[revision]
        sha = hub._new_commit(repo, parent, {**repo.commits[parent]["files"], **files}, message)
        repo.refs[revision] = sha
        return sha
