"""A tiny in-memory S3 server for the ``s3://`` store's bad-input tests: :class:`FakeS3`.

**Not a substitute for the real backend.** The store's suites run on Ceph RGW
(:mod:`fenced.testing.rgw`), which checks conditional writes atomically in its OSD; this server
exists for what no Debian package offers: a *misbehaving* server (one that ignores
``If-None-Match``/``If-Match``, which ``open_store``'s probe must refuse) and an AWS-like server
for the *quoted* ``If-Match`` form (RGW only matches the bare ETag). It is a stdlib
``ThreadingHTTPServer`` on 127.0.0.1 with a free port, started and stopped by the test; it checks
no signature, and one lock makes each request atomic.

Path-style S3, just enough for boto3 and the store: ``HEAD`` bucket; ``PUT``/``GET``/``HEAD``/
``DELETE`` object (ETag: the quoted MD5 of the body; ``x-amz-meta-*`` kept); ``POST ?delete``
(DeleteObjects) and ``GET ?list-type=2`` (ListObjectsV2: one page, no delimiter) in XML. Anything
else is 501 ``NotImplemented``.
``conditions`` says what a ``PUT`` does with its conditional headers:

* ``"quoted"`` (AWS): ``If-Match`` matches the quoted ETag (or ``*``), ``If-None-Match: *``
  fails on an existing key; a failed condition is 412 ``PreconditionFailed``.
* ``"bare"`` (Ceph RGW's quirk): the same, but ``If-Match`` matches only the unquoted ETag.
* ``"ignore"``: both headers ignored (the bad server); ``"ignore-if-match"``: only ``If-Match``.
"""

from __future__ import annotations

import email.utils
import hashlib
import threading
import time
import urllib.parse
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Literal, Self
from xml.sax.saxutils import escape

__all__ = ["Conditions", "FakeS3"]

Conditions = Literal["quoted", "bare", "ignore", "ignore-if-match"]
_XMLNS = "http://s3.amazonaws.com/doc/2006-03-01/"


@dataclass
class _Object:
    body: bytes
    metadata: dict[str, str]
    modified: float = field(default_factory=time.time)

    @property
    def etag(self) -> str:
        return f'"{hashlib.md5(self.body).hexdigest()}"'


class FakeS3:
    """See the module docstring. ``with FakeS3("quoted") as s3:`` … ``s3.endpoint``."""

    def __init__(self, conditions: Conditions = "quoted", bucket: str = "fake-bucket") -> None:
        self.conditions: Conditions = conditions
        self.bucket = bucket
        self.objects: dict[str, _Object] = {}
        """The bucket's objects by key (read it under :attr:`lock`, or when stopped)."""
        self.lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        assert self._server is not None, "not started"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def keys(self) -> list[str]:
        with self.lock:
            return sorted(self.objects)

    def start(self) -> Self:
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        server.daemon_threads = True
        server.fake = self  # type: ignore[attr-defined]
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, args=(0.05,), name="fake-s3", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def precondition(self, key: str, if_match: str | None, if_none_match: str | None) -> bool:
        """Whether a PUT of ``key`` with these headers may proceed (call under the lock)."""
        current = self.objects.get(key)
        mode = self.conditions
        if if_none_match == "*" and mode != "ignore" and current is not None:
            return False
        if if_match is None or mode in ("ignore", "ignore-if-match"):
            return True
        if current is None:
            return False
        wanted = current.etag if mode == "quoted" else current.etag.strip('"')
        return if_match in ("*", wanted)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive and ``Expect: 100-continue``, as boto3 likes
    timeout = 10  # an idle keep-alive connection's thread ends after this

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base's name)
        pass

    def reply(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        headers = {"Content-Length": str(len(body)), **(headers or {})}
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def xml(self, body: str, status: int = 200) -> None:
        text = f'<?xml version="1.0" encoding="UTF-8"?>{body}'.encode()
        self.reply(status, text, {"Content-Type": "application/xml"})

    def error(self, status: int, code: str, message: str) -> None:
        self.xml(f"<Error><Code>{code}</Code><Message>{escape(message)}</Message></Error>", status)

    def dispatch(self) -> None:
        """Every method: route the request (see the module docstring)."""
        fake: FakeS3 = self.server.fake  # type: ignore[attr-defined]
        path, _, raw_query = self.path.partition("?")
        bucket, _, key = path.lstrip("/").partition("/")
        key, query = urllib.parse.unquote(key), urllib.parse.parse_qs(raw_query, True)
        query.pop("x-id", None)  # botocore names some operations in the query
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        method = self.command
        if bucket != fake.bucket:
            self.error(404, "NoSuchBucket", f"no bucket {bucket}")
        elif method == "HEAD" and not key and not query:
            self.reply(200)
        elif method in ("GET", "HEAD") and key and not query:
            self.send_object(fake, key)
        elif method == "GET" and not key and query.get("list-type") == ["2"]:
            self.list_objects(fake, query)
        elif method == "PUT" and key and not query:
            self.put_object(fake, key, body)
        elif method == "DELETE" and key and not query:
            with fake.lock:
                fake.objects.pop(key, None)
            self.reply(204)
        elif method == "POST" and not key and "delete" in query:
            self.delete_objects(fake, body)
        else:
            self.error(501, "NotImplemented", f"{method} {self.path} is not faked")

    do_HEAD = do_GET = do_PUT = do_DELETE = do_POST = dispatch

    def send_object(self, fake: FakeS3, key: str) -> None:
        with fake.lock:
            found = fake.objects.get(key)
        if found is None:
            self.error(404, "NoSuchKey", f"no key {key}")
            return
        headers = {
            "ETag": found.etag,
            "Content-Type": "application/octet-stream",
            "Last-Modified": email.utils.formatdate(found.modified, usegmt=True),
            **{f"x-amz-meta-{name}": value for name, value in found.metadata.items()},
        }
        self.reply(200, found.body, headers)

    def list_objects(self, fake: FakeS3, query: dict[str, list[str]]) -> None:
        """One page, all of it (no delimiter, no continuation)."""
        if "delimiter" in query:
            self.error(501, "NotImplemented", "no delimiter in the fake's listings")
            return
        prefix = query.get("prefix", [""])[0]
        with fake.lock:
            listed = sorted((k, o) for k, o in fake.objects.items() if k.startswith(prefix))
        contents = "".join(
            f"<Contents><Key>{escape(key)}</Key><LastModified>"
            f"{time.strftime('%Y-%m-%dT%H:%M:%S.000Z', time.gmtime(found.modified))}"
            f"</LastModified><ETag>{escape(found.etag)}</ETag><Size>{len(found.body)}</Size>"
            "<StorageClass>STANDARD</StorageClass></Contents>"
            for key, found in listed
        )
        self.xml(
            f'<ListBucketResult xmlns="{_XMLNS}"><Name>{fake.bucket}</Name>'
            f"<Prefix>{escape(prefix)}</Prefix><KeyCount>{len(listed)}</KeyCount>"
            f"<MaxKeys>1000</MaxKeys><IsTruncated>false</IsTruncated>{contents}"
            "</ListBucketResult>"
        )

    def put_object(self, fake: FakeS3, key: str, body: bytes) -> None:
        metadata = {
            name.lower().removeprefix("x-amz-meta-"): value
            for name, value in self.headers.items()
            if name.lower().startswith("x-amz-meta-")
        }
        if_match, if_none_match = self.headers.get("If-Match"), self.headers.get("If-None-Match")
        with fake.lock:
            allowed = fake.precondition(key, if_match, if_none_match)
            if allowed:
                fake.objects[key] = _Object(body, metadata)
        if allowed:
            self.reply(200, headers={"ETag": _Object(body, metadata).etag})
        else:
            self.error(412, "PreconditionFailed", "At least one of the pre-conditions failed")

    def delete_objects(self, fake: FakeS3, body: bytes) -> None:
        """DeleteObjects: every ``<Key>`` of the request, reported deleted unless ``Quiet``."""
        keys = [e.text or "" for e in ET.fromstring(body).iter() if e.tag.endswith("Key")]
        with fake.lock:
            for key in keys:
                fake.objects.pop(key, None)
        deleted = "".join(f"<Deleted><Key>{escape(key)}</Key></Deleted>" for key in keys)
        quiet = b"<Quiet>true</Quiet>" in body
        self.xml(f'<DeleteResult xmlns="{_XMLNS}">{"" if quiet else deleted}</DeleteResult>')
