"""Board locations: store URLs parse into (provider, bucket, prefix) or are refused with one line;
a refusal from a store is "missing" unless it is about the credentials."""

from __future__ import annotations

import argparse

import pytest
from hypothesis import given
from hypothesis import strategies as st
from obstore.exceptions import GenericError, NotFoundError, PermissionDeniedError, UnauthenticatedError

from patchswarm.daemon import cli_args
from patchswarm.daemon.board_store import open_board
from patchswarm.daemon.config import parse_board_url
from patchswarm.swarm.board_store import (
    MAX_URL,
    StoreCredentialsError,
    StoreError,
    StoreURL,
    is_missing,
    local_path,
    parse_store_url,
    store_error,
)
from patchswarm.swarm.tls import TlsError, require_https

SCHEMES = st.sampled_from([("s3", "s3"), ("gs", "gs"), ("az", "az"), ("azure", "az"), ("S3", "s3")])
BUCKET = st.from_regex(r"[a-z0-9][a-z0-9-]{1,40}[a-z0-9]", fullmatch=True)
SEGMENT = st.from_regex(r"[A-Za-z0-9_~+=@,-][A-Za-z0-9._~+=@,-]{0,20}", fullmatch=True)


@given(SCHEMES, BUCKET, st.lists(SEGMENT, max_size=5), st.booleans())
def test_a_store_url_parses_into_its_parts_and_back(
    scheme: tuple[str, str], bucket: str, segments: list[str], slash: bool
) -> None:
    text = f"{scheme[0]}://{bucket}" + "".join(f"/{s}" for s in segments) + ("/" if slash else "")
    loc = parse_store_url(text)
    assert loc == StoreURL(scheme[1], bucket, "/".join(segments))
    assert parse_store_url(loc.url) == loc


@given(st.text(max_size=80))
def test_any_text_is_a_store_url_none_or_one_clear_refusal(text: str) -> None:
    try:
        loc = parse_store_url(text)
    except ValueError as e:
        assert "\n" not in str(e).replace(repr(text), "")
        return
    if loc is None:
        assert not text.lower().startswith(("s3://", "gs://", "az://", "azure://"))
        return
    assert len(loc.url) <= MAX_URL
    assert all(c not in loc.bucket for c in ":@/?#") and ".." not in loc.bucket
    assert all(s not in ("", ".", "..") for s in loc.prefix.split("/")) or loc.prefix == ""


@pytest.mark.parametrize(
    "text",
    [
        "s3://key:secret@bucket/p",  # credentials never come from a URL
        "s3://bucket:9000/p",  # nor endpoints
        "s3://b/p",  # too short for any provider
        "s3://Bucket/p",
        "s3://bucket/a/../b",
        "s3://bucket/a//b",
        "s3://bucket/./b",
        "s3://bucket?versionId=1",
        "s3://bucket/a b",
        "gs://bucket/a\nb",
        "az://",
        "s3://" + "a" * 300,
        "s3://bucket/" + "a/" * 600,
    ],
)
def test_malformed_store_urls_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_store_url(text)


def test_other_locations_are_not_store_urls() -> None:
    for text in ("/srv/board", "board", "https://cdn.example/board", "file:///srv/board", "s3bucket", "board:v1"):
        assert parse_store_url(text) is None
    assert local_path("file:///srv/board") == "/srv/board"
    assert local_path("/srv/board") is None
    with pytest.raises(ValueError, match="absolute path"):
        local_path("file://host/srv/board")


def test_a_refusal_is_missing_unless_it_is_about_the_credentials() -> None:
    body = "Server returned non-2xx status code: 403 Forbidden: <?xml ?><Error><Code>{}</Code></Error>"
    assert is_missing(NotFoundError("404"))
    assert is_missing(PermissionDeniedError(body.format("AccessDenied")))  # S3 without ListBucket
    assert is_missing(PermissionDeniedError("403 Forbidden: "))  # an anonymous GET: no body
    for code in ("SignatureDoesNotMatch", "InvalidAccessKeyId", "ExpiredToken", "AuthenticationFailed"):
        e = PermissionDeniedError(body.format(code))
        assert not is_missing(e)
        err = store_error(e, "GET s3://b/x")
        assert isinstance(err, StoreCredentialsError) and code in str(err) and "\n" not in str(err)
    assert isinstance(store_error(UnauthenticatedError("401"), "GET"), StoreCredentialsError)
    other = store_error(GenericError("Generic S3 error: connection refused\n\nDebug source: ..."), "GET s3://b/x")
    assert type(other) is StoreError and str(other) == "GET s3://b/x: Generic S3 error: connection refused"
    no_token = GenericError(
        "Generic GCS error: Error performing token request: Error performing GET http://169.254.169.254/"
    )
    assert isinstance(store_error(no_token, "GET gs://b/x"), StoreCredentialsError)


@pytest.mark.parametrize(
    "text", ["s3:/bucket/p", "s3:bucket", "S3:/bucket", "gcs://bucket/p", "r2://bucket", "abfs://c/p"]
)
def test_a_mistyped_or_unknown_store_scheme_is_refused_not_taken_for_a_directory(text: str) -> None:
    """``s3:/bucket`` or ``gcs://bucket`` used to be a relative directory of that name: a publish wrote the
    run to ./s3:/bucket on the local disk and a host polled an empty directory, with no error anywhere."""
    with pytest.raises(ValueError, match="not a board location"):
        parse_store_url(text)
    with pytest.raises(ValueError):
        open_board(text)
    with pytest.raises(argparse.ArgumentTypeError):
        cli_args.board(text)


SECRET = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYzEXAMPLE"  # an AWS secret key may hold '/' and '+'


@pytest.mark.parametrize(
    "text",
    [
        f"s3://AKIAEXAMPLE:{SECRET}@bucket/p",
        f"gs://AKIAEXAMPLE:{SECRET}@bucket",
        f"gcs://AKIAEXAMPLE:{SECRET}@bucket/p",
        f"ftp://AKIAEXAMPLE:{SECRET}@host/p",
        f"s3://bucket/p?X-Amz-Security-Token=x&X-Amz-Signature={SECRET}",
        f"az://container/p?sv=2024&sig={SECRET}",
    ],
)
def test_a_refused_url_never_shows_the_credentials_in_it(text: str) -> None:
    """A URL with credentials is refused (they come from the environment), in one line that names the
    URL without them: error lines end up in logs, terminals and bug reports."""
    errors: list[str] = []
    for parse in (parse_store_url, parse_board_url, cli_args.board_url, cli_args.board):
        try:
            parse(text)
        except (ValueError, argparse.ArgumentTypeError) as e:
            errors.append(str(e))
    assert len(errors) == 4, errors
    for line in errors:
        assert "\n" not in line and "***" in line
        assert not any(part in line for part in SECRET.split("/")), line


def test_a_store_error_never_shows_credentials_in_the_endpoint_url() -> None:
    """obstore's errors name the request URL; an endpoint configured with credentials
    (``AWS_ENDPOINT_URL=http://user:secret@host``) put them in the one line a daemon logs."""
    failed = GenericError(
        f"Generic S3 error: Error performing GET http://minio:{SECRET}@10.0.0.5:9000/b/k in 9s, after 10 retries"
    )
    for line in (str(store_error(failed, "GET s3://bucket/k")), str(store_error(failed, "PUT s3://bucket/k"))):
        assert "http://***@10.0.0.5:9000/b/k" in line
        assert not any(part in line for part in SECRET.split("/")), line


def test_an_http_board_refused_for_writing_or_tls_never_shows_its_credentials() -> None:
    """An http(s) board given where it cannot serve (publishing to it; plain HTTP under the cluster's
    TLS) is refused in a line that shows it without its credentials."""
    url = f"http://reader:{SECRET}@cdn.example/board"
    errors: list[str] = []
    for refuse in (open_board, cli_args.board, lambda u: require_https(u, "seed URL")):
        try:
            refuse(url)
        except (ValueError, argparse.ArgumentTypeError, TlsError) as e:
            errors.append(str(e))
    assert len(errors) == 3, errors
    for line in errors:
        assert "http://***@cdn.example/board" in line and not any(p in line for p in SECRET.split("/")), line
