"""A board in an object store (S3 and S3-compatible stores, GCS, Azure Blob), read through obstore.

A board location is a directory, an ``http(s)://`` URL (a static server, the store's HTTPS
endpoint, a CDN: swarm/board_sources.py ``HttpSource``) or a store URL parsed here:

    s3://bucket/prefix        gs://bucket/prefix        az://container/prefix (or azure://)
    file:///srv/board         (a directory, as a plain path is)

Credentials and endpoints come only from each provider's standard environment and config files,
never from a URL or a command line: ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``,
``AWS_REGION``, ``AWS_ENDPOINT_URL`` (an S3-compatible store), ``AWS_ALLOW_HTTP`` (a loopback test
store), ``AWS_SKIP_SIGNATURE`` (anonymous reads of a public board); ``~/.aws/credentials`` and
profiles through boto3 when it is importable (obstore alone does not read them);
``GOOGLE_APPLICATION_CREDENTIALS``/``GOOGLE_SERVICE_ACCOUNT``; ``AZURE_STORAGE_ACCOUNT_NAME`` with
``AZURE_STORAGE_ACCOUNT_KEY``, a SAS token or the Azure CLI.  docs/board.md, "Object stores".

Errors: a missing object is None.  S3 answers 403 ``AccessDenied`` instead of 404 for a missing key
when the reader may not list the bucket, so a refusal that is not about the credentials counts as
missing too; bad credentials (``SignatureDoesNotMatch``, ``InvalidAccessKeyId``, an expired token)
raise ``StoreCredentialsError`` with one line.  Every read is bounded by its caller's limit.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

import obstore
from obstore.exceptions import NotFoundError, PermissionDeniedError, UnauthenticatedError
from obstore.store import AzureStore, GCSStore, ObjectStore, S3Store

from patchswarm.protocol.board_names import board_limit
from patchswarm.protocol.errors import LimitExceededError
from patchswarm.swarm.client_errors import SourceError, shown_url

SCHEMES = {"s3": "s3", "gs": "gs", "az": "az", "azure": "az"}  # URL scheme -> provider
MAX_URL = 1024
# Bucket / container names: what S3, GCS and Azure all accept at most (each provider checks its own rules).
_BUCKET = re.compile(r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]")
_SEGMENT = re.compile(r"[A-Za-z0-9._~+=@,-]{1,255}")
# S3 error codes that mean "these credentials are wrong", not "you may not read this object".
_CREDENTIAL_CODES = (
    "SignatureDoesNotMatch",
    "InvalidAccessKeyId",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
    "InvalidClientTokenId",
    # Azure answers 404 for a missing blob whenever it answers at all: its 403s are all about access.
    "AuthenticationFailed",
    "AuthorizationFailure",  # (Azurite's answer to a wrong key; Azure's to a request its rules forbid)
    "InvalidAuthenticationInfo",
)
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]{0,31}):")
_URL_CREDENTIALS = re.compile(r"([A-Za-z][A-Za-z0-9+.-]{0,31}://)[^\s@]*@")
_CODE = re.compile(r"<Code>([A-Za-z0-9.]{1,64})</Code>")
STREAM_CHUNK = 1 << 20


class StoreError(SourceError):
    """An object store refused or failed a request (one line: what, where, why)."""


class StoreCredentialsError(StoreError):
    """The store rejected the credentials (or none were found)."""


@dataclass(frozen=True, slots=True)
class StoreURL:
    provider: str  # "s3", "gs" or "az"
    bucket: str  # bucket or container
    prefix: str  # "" or "a/b": object names are prefix + "/" + board path

    @property
    def url(self) -> str:
        return f"{self.provider}://{self.bucket}" + (f"/{self.prefix}" if self.prefix else "")


def parse_store_url(text: str) -> StoreURL | None:
    """The store a board URL names; None for anything that is not a store URL (a path, http(s), file).

    ValueError (one line) for a store URL that is malformed: a bucket name no provider accepts,
    credentials or a port in it, a query, empty/``.``/``..`` path segments, odd characters; and for
    a URL of a scheme no board has (``gcs://``, ``s3:/bucket``), which would otherwise be taken for
    a directory of that name and published into.
    """
    m = _SCHEME.match(text)
    if m is None:
        return None
    scheme, rest = m.group(1).lower(), text[m.end() :]
    if scheme in ("http", "https", "file"):
        return None
    if scheme not in SCHEMES or not rest.startswith("//"):
        if scheme not in SCHEMES and not rest.startswith("//"):
            return None  # a directory whose name holds a colon ("board:v1")
        raise ValueError(
            f"{shown_url(text)!r}: not a board location (s3://bucket/prefix, gs://..., az://..., http(s)://..., "
            "file:///path or a directory)"
        )
    if len(text) > MAX_URL:
        raise ValueError(f"board URL longer than {MAX_URL} characters")
    bucket, _, prefix = rest[2:].partition("/")
    prefix = prefix.rstrip("/")
    if not _BUCKET.fullmatch(bucket) or ".." in bucket:
        raise ValueError(
            f"{shown_url(text)!r}: the bucket is not a bucket name (3-222 lowercase letters, digits, '.', '-', '_'; "
            "credentials and endpoints come from the environment, never the URL)"
        )
    if prefix and not all(_SEGMENT.fullmatch(s) and s not in (".", "..") for s in prefix.split("/")):
        raise ValueError(f"{shown_url(text)!r}: the prefix must be '/'-separated names of letters, digits and ._~+=@,-")
    return StoreURL(SCHEMES[scheme], bucket, prefix)


def is_store_url(text: str) -> bool:
    """Whether ``text`` names an object store (``s3://``, ``gs://``, ``az://``), well formed or not."""
    m = _SCHEME.match(text)
    return m is not None and m.group(1).lower() in SCHEMES and text[m.end() :].startswith("//")


def local_path(text: str) -> str | None:
    """The directory a ``file://`` URL names (absolute, no host), or None if ``text`` is not one."""
    if not text.startswith("file://"):
        return None
    path = text.removeprefix("file://")
    if not path.startswith("/"):
        raise ValueError(f"{text!r}: a file URL names an absolute path (file:///srv/board)")
    return path


# ---------------------------------------------------------------- opening a store


def _s3_credentials() -> dict[str, Any]:
    """How an S3 store finds credentials: obstore reads ``AWS_*`` variables itself; otherwise boto3's
    chain (``~/.aws/credentials``, profiles, SSO, instance roles) when boto3 is importable."""
    env = os.environ
    if env.get("AWS_ACCESS_KEY_ID") or env.get("AWS_SKIP_SIGNATURE", "").lower() in ("1", "true"):
        return {}
    if env.get("AWS_WEB_IDENTITY_TOKEN_FILE") or env.get("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI"):
        return {}  # obstore handles web identity (EKS) and ECS task roles natively
    try:
        import boto3
        from obstore.auth.boto3 import Boto3CredentialProvider
    except ImportError:
        return {}  # obstore alone: instance metadata (IMDS) is its last resort
    session = boto3.Session()
    if session.get_credentials() is None:
        raise StoreCredentialsError(
            "no AWS credentials found (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, ~/.aws/credentials, AWS_PROFILE, "
            "an instance role); set AWS_SKIP_SIGNATURE=true to read a public board anonymously"
        )
    return {"credential_provider": Boto3CredentialProvider(session)}


def _check_aws_environment() -> None:
    """A control character in an ``AWS_*`` setting that S3 requests carry in a header (a key id, session
    token or region pasted with its newline or carriage return) makes obstore panic on the first
    request: pyo3's PanicException, a BaseException that no ``except Exception`` stops (a traceback in
    the CLI; in a daemon, the task that asked dies: a seed's copy stops unlogged).  Refused here in one
    line that names the variable and never shows its value.  (Not GOOGLE_*: a service account key
    given inline is JSON, newlines and all.)"""
    for name, value in os.environ.items():
        if name.startswith("AWS_") and any((c < " " and c != "\t") or c == "\x7f" for c in value):
            raise StoreCredentialsError(
                f"the environment variable {name} holds a control character (a newline or carriage return pasted "
                "with it?): remove it"
            )


def open_store(loc: StoreURL) -> ObjectStore:
    """An obstore store for ``loc``, configured from the environment (StoreError if it cannot be)."""
    try:
        # No client_options here: given, they replace those obstore reads from the environment
        # (AWS_ALLOW_HTTP, proxies, timeouts) instead of adding to them.
        if loc.provider == "s3":
            _check_aws_environment()
            return S3Store.from_url(loc.url, **_s3_credentials())
        if loc.provider == "gs":
            return GCSStore.from_url(loc.url)
        return AzureStore.from_url(loc.url)
    except StoreError:
        raise
    except Exception as e:  # obstore's configuration errors (no account name, an unreadable key file)
        raise StoreError(f"{loc.url}: cannot configure the store: {first_line(e)}") from None


# ---------------------------------------------------------------- errors


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    text = text.split(": <?xml", 1)[0]  # the response body follows; its <Code> is reported apart
    # obstore names the request's URL: an endpoint given with credentials (AWS_ENDPOINT_URL=http://u:p@host) shows them.
    return _URL_CREDENTIALS.sub(r"\1***@", text)[:300]


def error_code(e: BaseException) -> str | None:
    m = _CODE.search(str(e))
    return m.group(1) if m else None


def is_missing(e: BaseException) -> bool:
    """Whether a failed read means "not there": 404, or a 403 that is not about the credentials."""
    if isinstance(e, NotFoundError | FileNotFoundError):
        return True
    return isinstance(e, PermissionDeniedError) and error_code(e) not in _CREDENTIAL_CODES


def store_error(e: BaseException, what: str) -> StoreError:
    """One line for a failed request; StoreCredentialsError when the credentials are the cause."""
    code = error_code(e)
    if isinstance(e, UnauthenticatedError) or code in _CREDENTIAL_CODES:
        return StoreCredentialsError(
            f"{what}: the store rejected the credentials ({code or 'unauthenticated'}): check the provider's "
            "environment variables or config files"
        )
    if "token request" in first_line(e):  # GCS/Azure found no credentials and asked a metadata service
        return StoreCredentialsError(f"{what}: no credentials found for the store ({first_line(e)[:160]})")
    return StoreError(f"{what}: {first_line(e)}" + (f" ({code})" if code else ""))


# ---------------------------------------------------------------- reading


@dataclass(frozen=True, slots=True)
class Found:
    """An object read with its entity tag (what a conditional write of it must match)."""

    data: bytes
    e_tag: str | None


def _too_large(url: str, rel: str, limit: int) -> LimitExceededError:
    return LimitExceededError(f"{url}/{rel}: larger than the {limit} bytes expected")


class _BoundedRead:
    """One object's bytes as they stream in, at most ``limit``: the size the store reports is checked
    first, and the bytes are counted too (that size is the server's word).  LimitExceededError past it."""

    def __init__(self, url: str, rel: str, limit: int, size: int) -> None:
        self.url, self.rel, self.limit = url, rel, limit
        if size > limit:
            raise _too_large(url, rel, limit)
        self.out = bytearray()

    def add(self, chunk: Any) -> None:
        self.out += chunk
        if len(self.out) > self.limit:
            raise _too_large(self.url, self.rel, self.limit)


def _raise_unless_missing(e: Exception, url: str, rel: str) -> None:
    """A failed GET of ``rel``: nothing when the object is missing (the caller answers None); else the
    store's one-line error (a LimitExceededError as it is)."""
    if isinstance(e, LimitExceededError):
        raise e
    if not is_missing(e):
        raise store_error(e, f"GET {url}/{rel}") from None


def read_object(store: ObjectStore, url: str, rel: str, limit: int) -> Found | None:
    """``rel`` read whole (at most ``limit`` bytes, else LimitExceededError), or None if missing."""
    try:
        resp = obstore.get(store, rel)
        read = _BoundedRead(url, rel, limit, resp.meta["size"])
        for chunk in resp.stream(min_chunk_size=STREAM_CHUNK):
            read.add(chunk)
    except Exception as e:
        _raise_unless_missing(e, url, rel)
        return None
    return Found(bytes(read.out), resp.meta.get("e_tag"))


class StoreSource:
    """A board in an object store, read through the provider's SDK with its credentials (a BoardSource)."""

    def __init__(self, loc: StoreURL) -> None:
        self.loc = loc
        self.store = open_store(loc)

    async def get(self, rel: str, limit: int) -> bytes | None:
        """The object at board path ``rel`` (None outside the board's layout, as a directory would
        have it), at most ``limit`` bytes and its kind's bound."""
        url = self.loc.url
        bound = board_limit(rel)
        if bound is None:
            return None
        limit = min(limit, bound)
        try:
            resp = await obstore.get_async(self.store, rel)
            read = _BoundedRead(url, rel, limit, resp.meta["size"])
            async for chunk in resp.stream(min_chunk_size=STREAM_CHUNK):
                read.add(chunk)
        except Exception as e:
            _raise_unless_missing(e, url, rel)
            return None
        return bytes(read.out)

    async def close(self) -> None:
        return None
