"""Fixtures shared by the object-store board tests (tests/system/test_store_board*.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from patchswarm.protocol.keys import SigningKey
from tests.support.boards import Keys
from tests.support.moto_server import Moto, moto_server


@pytest.fixture(scope="module")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Moto]:
    """A real moto server process, one per test module."""
    with moto_server(tmp_path_factory.mktemp("moto")) as m:
        yield m


@pytest.fixture
def aws(moto: Moto, monkeypatch: pytest.MonkeyPatch) -> Moto:
    """This process's environment pointed at the server (the standard AWS variables, nothing else)."""
    for k, v in moto.env().items():
        monkeypatch.setenv(k, v)
    return moto


@pytest.fixture(scope="module")
def keys() -> Keys:
    return Keys(SigningKey.generate(), SigningKey.generate())
