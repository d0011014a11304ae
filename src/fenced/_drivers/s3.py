"""S3 plumbing for the ``s3://`` store (``pip install 'fenced[s3]'``: boto3).

* :func:`parse_url` — ``s3://BUCKET[/PREFIX][?endpoint=URL&region=R&timeout=S&addressing=A]``
  as a :class:`S3Location`. Credentials never appear in the URL (a user or password is refused):
  boto3 finds them by the standard AWS chain (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``,
  ``AWS_PROFILE``, the shared files, an instance or container role). Without ``endpoint`` the
  chain's endpoint applies (``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``, else AWS itself).
* :func:`clients` — two boto3 clients on one connection pool size: ``reads`` (and idempotent
  writes: fresh keys, deterministic bodies) retried by botocore's standard mode, and ``commits``
  with no retry at all: a conditional write whose reply was lost must not be sent again blindly
  (the second attempt's 412 would hide that the first one committed); the store resolves it.
* :func:`translate` — a botocore error as fenced's: :class:`~fenced.ConfigurationError` for a
  missing bucket, refused credentials or a denied request (permanent: retrying changes nothing),
  :class:`~fenced.Unavailable` for an endpoint that refuses, times out or is busy (nothing
  happened), and :func:`status` / :func:`code` to read a ``ClientError``.
"""

from __future__ import annotations

import math
import re
import urllib.parse
from dataclasses import dataclass
from typing import Any

import botocore.exceptions
from botocore.config import Config

from fenced.core._errors import ConfigurationError, Unavailable
from fenced.core._urls import redacted

__all__ = [
    "CONFLICT_CODES",
    "DENIED_CODES",
    "ERRORS",
    "MISSING_CODES",
    "S3Clients",
    "S3Location",
    "clients",
    "code",
    "parse_url",
    "status",
    "translate",
]

_OPTIONS = frozenset({"endpoint", "region", "timeout", "addressing"})
_CREDENTIAL = re.compile(r"key|secret|token|password|credential", re.IGNORECASE)
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
DEFAULT_TIMEOUT = 10.0

ERRORS = (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError)
"""What a boto3 call raises: transport and library errors, and the server's error replies."""
CONFLICT_CODES = frozenset({"PreconditionFailed", "ConditionalRequestConflict", "412", "409"})
"""Error codes of a conditional write that lost: the object is not the version it named."""
MISSING_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
"""Error codes of a key that does not exist."""
DENIED_CODES = frozenset(
    {
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "InvalidToken",
        "ExpiredToken",
        "AllAccessDisabled",
        "403",
    }
)
"""Error codes of a request the credentials may not make (or that carry bad credentials)."""
_BUSY = frozenset(
    {"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "503", "500"}
)


@dataclass(frozen=True, slots=True)
class S3Location:
    """Where an ``s3://`` store lives and how to reach it (from :func:`parse_url`)."""

    url: str
    """The URL as given (it holds no secret)."""
    bucket: str
    prefix: str
    """The store's key prefix: ``""`` or ``"a/b/"`` (always ending with ``/``)."""
    endpoint: str | None = None
    region: str | None = None
    timeout: float = DEFAULT_TIMEOUT
    """Seconds to connect and to wait for each reply."""
    addressing: str = "auto"
    """``path``, ``virtual`` or ``auto`` (boto3's choice; ``path`` with an ``endpoint``)."""

    def key(self, *parts: str) -> str:
        """The bucket key of ``parts`` under the store's prefix."""
        return self.prefix + "/".join(parts)

    @property
    def where(self) -> str:
        """``s3://bucket/prefix`` for messages."""
        return f"s3://{self.bucket}/{self.prefix}".rstrip("/")


def parse_url(url: str) -> S3Location:
    """The location of ``url``; :class:`ConfigurationError` for credentials in it, a bad bucket
    name, an empty prefix segment, an unknown option or a bad option value."""
    parts = urllib.parse.urlsplit(url)
    # the query is left out of messages: an unknown option may be a secret under any name
    shown = redacted(urllib.parse.urlunsplit(parts._replace(query="", fragment="")))
    if parts.scheme != "s3":
        raise ConfigurationError(f"not an s3:// URL: {shown}")
    if "@" in parts.netloc:
        raise ConfigurationError(
            f"{shown}: an s3:// URL carries no credentials; they come from the AWS chain "
            "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, ~/.aws, an instance role)"
        )
    bucket = parts.netloc
    if not _BUCKET.fullmatch(bucket) or ".." in bucket:
        raise ConfigurationError(
            f"{shown}: {bucket!r} is not a bucket name (3-63 characters of a-z 0-9 . -, "
            "starting and ending with a letter or digit)"
        )
    prefix = parts.path.removeprefix("/").removesuffix("/")
    if prefix and any(not segment for segment in prefix.split("/")):
        raise ConfigurationError(f"{shown}: the key prefix {prefix!r} has an empty segment")
    if parts.fragment:
        raise ConfigurationError(f"{shown}: an s3:// URL has no fragment")
    found = urllib.parse.parse_qs(parts.query, keep_blank_values=True)
    unknown = sorted(set(found) - _OPTIONS)
    if any(_CREDENTIAL.search(name) for name in unknown):
        raise ConfigurationError(
            f"{shown}: an s3:// URL carries no credentials ({unknown[0]}=…); they come from the "
            "AWS chain (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, ~/.aws, a role)"
        )
    if unknown:
        raise ConfigurationError(
            f"{shown}: unknown option {unknown[0]!r} (s3:// takes {', '.join(sorted(_OPTIONS))})"
        )
    for name, values in found.items():
        if len(values) != 1 or not values[0]:
            raise ConfigurationError(f"{shown}: give {name}= once, with a value")
    options = {name: values[0] for name, values in found.items()}
    endpoint = options.get("endpoint")
    if endpoint is not None:
        scheme = urllib.parse.urlsplit(endpoint)
        if scheme.scheme not in ("http", "https") or not scheme.netloc:
            raise ConfigurationError(f"{shown}: endpoint= must be an http(s):// URL")
    timeout = DEFAULT_TIMEOUT
    if "timeout" in options:
        try:
            timeout = float(options["timeout"])
        except ValueError:
            timeout = math.nan
        if not (math.isfinite(timeout) and timeout > 0):
            raise ConfigurationError(f"{shown}: timeout= must be a positive number of seconds")
    addressing = options.get("addressing", "path" if endpoint else "auto")
    if addressing not in ("path", "virtual", "auto"):
        raise ConfigurationError(f"{shown}: addressing= is path, virtual or auto")
    return S3Location(
        url=url,
        bucket=bucket,
        prefix=f"{prefix}/" if prefix else "",
        endpoint=endpoint,
        region=options.get("region"),
        timeout=timeout,
        addressing=addressing,
    )


@dataclass(frozen=True, slots=True)
class S3Clients:
    """The two clients of one store (see the module docstring)."""

    reads: Any
    """Retried by botocore (standard mode, 3 attempts)."""
    commits: Any
    """Never retried: one attempt per conditional write."""


def clients(location: S3Location, pool: int = 16) -> S3Clients:
    """boto3 clients for ``location`` (see the module docstring); ``pool``: connections each.

    Raises :class:`ConfigurationError` if boto3 finds no region it can use or a bad setting.
    """
    import boto3  # noqa: PLC0415 - only a store that uses s3:// needs the extra

    session = boto3.session.Session()  # one session: the service model is loaded once

    def make(attempts: int) -> Any:
        config = Config(
            connect_timeout=location.timeout,
            read_timeout=location.timeout,
            retries={"total_max_attempts": attempts, "mode": "standard"},
            max_pool_connections=pool,
            s3={"addressing_style": location.addressing},
            tcp_keepalive=True,
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        return session.client(
            "s3", endpoint_url=location.endpoint, region_name=location.region, config=config
        )

    try:
        return S3Clients(make(3), make(1))
    except botocore.exceptions.BotoCoreError as error:
        raise ConfigurationError(f"{location.where}: {error}") from None


def status(error: BaseException) -> int | None:
    """The HTTP status of a ``ClientError``; None for any other error."""
    if isinstance(error, botocore.exceptions.ClientError):
        value = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return value if isinstance(value, int) else None
    return None


def code(error: BaseException) -> str:
    """The S3 error code of a ``ClientError`` (``NoSuchKey``, ``PreconditionFailed``, or the
    status as text for a body-less reply); ``""`` for any other error."""
    if isinstance(error, botocore.exceptions.ClientError):
        return str(error.response.get("Error", {}).get("Code", "") or status(error) or "")
    return ""


def translate(error: Exception, location: S3Location, what: str) -> Exception:
    """``error`` (raised by boto3 while doing ``what``) as fenced's exception, to raise
    ``from error``: ConfigurationError (permanent), or Unavailable (nothing happened; retry)."""
    where = location.where
    found = code(error)
    if found in ("NoSuchBucket",):
        return ConfigurationError(f"{where}: the bucket {location.bucket} does not exist")
    if found in DENIED_CODES:
        return ConfigurationError(
            f"{where}: {what} was refused ({found}): check the credentials the AWS chain "
            "found and the bucket policy"
        )
    if isinstance(
        error, botocore.exceptions.NoCredentialsError | botocore.exceptions.PartialCredentialsError
    ):
        return ConfigurationError(
            f"{where}: no AWS credentials found (set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or run with a role)"
        )
    if isinstance(error, botocore.exceptions.NoRegionError):
        return ConfigurationError(f"{where}: no region: add region= to the URL or set AWS_REGION")
    if found in _BUSY or isinstance(
        error,
        botocore.exceptions.EndpointConnectionError
        | botocore.exceptions.ConnectTimeoutError
        | botocore.exceptions.ReadTimeoutError
        | botocore.exceptions.ConnectionClosedError
        | botocore.exceptions.ResponseStreamingError,
    ):
        return Unavailable(f"{where}: {what} failed: {error}")
    if isinstance(error, botocore.exceptions.ClientError):
        return ConfigurationError(f"{where}: {what} was refused: {error}")
    if isinstance(error, botocore.exceptions.BotoCoreError):
        return Unavailable(f"{where}: {what} failed: {error}")
    return error
