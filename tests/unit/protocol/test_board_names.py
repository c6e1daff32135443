"""Board names: what the builders write parses back to what they were given, and nothing else parses."""

from __future__ import annotations

import string

import pytest
from hypothesis import given
from hypothesis import strategies as st

from patchswarm.protocol.board_names import (
    MAX_DOC_BYTES,
    MAX_HEAD_BYTES,
    BoardName,
    CertName,
    ChunkName,
    HeadName,
    ManifestName,
    RootName,
    board_limit,
    cert_rel,
    chunk_rel,
    head_rel,
    manifest_rel,
    parse_rel,
    root_rel,
)

hashes = st.binary(min_size=32, max_size=32)
run_ids = st.text(min_size=1, max_size=40).filter(lambda r: "/" not in r and not r.startswith("."))
names: st.SearchStrategy[BoardName] = st.one_of(
    run_ids.map(HeadName),
    hashes.map(ManifestName),
    hashes.map(ChunkName),
    hashes.map(CertName),
    st.integers(min_value=0, max_value=1 << 64).map(RootName),
)


@given(names)
def test_a_built_name_parses_back(name: BoardName) -> None:
    assert parse_rel(name.rel) == name
    assert board_limit(name.rel) is not None  # every name the layout has is one a board serves


@given(st.text(max_size=80))
def test_only_the_builders_form_parses(rel: str) -> None:
    name = parse_rel(rel)
    assert name is None or name.rel == rel


@given(st.text(alphabet=string.hexdigits + "/._runsmaifetchkrot", max_size=90))
def test_only_the_builders_form_parses_near_the_layout(rel: str) -> None:
    name = parse_rel(rel)
    assert name is None or name.rel == rel


def test_the_builders_write_the_layout() -> None:
    h = bytes(range(32))
    assert head_rel("run-1") == "runs/run-1/head"
    assert manifest_rel(h) == f"manifests/{h.hex()}"
    assert chunk_rel(h) == f"chunks/{h.hex()}"
    assert cert_rel(h) == f"certs/{h.hex()}"
    assert root_rel(7) == "trust/root.7"
    assert board_limit(head_rel("r")) == MAX_HEAD_BYTES
    assert board_limit(cert_rel(h)) == board_limit(root_rel(1)) == MAX_DOC_BYTES


@pytest.mark.parametrize(
    "rel",
    [
        "",
        "runs",
        "runs/r",
        "runs/r/head/x",
        "runs//head",
        "runs/.r/head",
        "runs/r/tail",
        "manifests/" + "ab" * 31,  # 31 bytes
        "manifests/" + "AB" * 32,  # upper case: not the form bytes.hex writes
        "chunks/" + "ab" * 32 + "/x",
        "certs/" + "zz" * 32,
        "trust/root.",
        "trust/root.01",
        "trust/root.-1",
        "trust/root. 1",
        "trust/root.١",  # a digit, but not an ASCII one
        "trust/other.1",
        "other/" + "ab" * 32,
        "/manifests/" + "ab" * 32,
    ],
)
def test_names_outside_the_layout_do_not_parse(rel: str) -> None:
    assert parse_rel(rel) is None


@pytest.mark.parametrize("run_id", ["", "a/b", ".hidden"])
def test_a_run_id_that_cannot_name_a_directory_is_refused(run_id: str) -> None:
    with pytest.raises(ValueError):
        head_rel(run_id)
