"""Review (issue 32): a certificate asked for under a name parse_rel does not take (a head envelope's
key_id is any bytes, not checked to be 32) must still be checked like any certificate answer."""

from __future__ import annotations

import pytest

from patchswarm.protocol.board_names import cert_rel, head_rel
from tests.support.swarmkit import RUN
from tests.unit.swarm.test_swarm_objects import Recorder, source


@pytest.mark.asyncio
async def test_a_liar_s_answer_for_an_odd_length_key_s_certificate_is_refused_and_the_next_source_asked() -> None:
    head, cert = head_rel(RUN), cert_rel(b"\x01" * 31)  # a forged head's signer: 31 bytes
    liar = {cert: b"not a certificate"}
    t = Recorder(have={f"p{i}": dict(liar) for i in range(5)} | {"seed": dict(liar)})
    t.have["p4"][head] = b"head"
    src = source(t)
    await src.get(head, 1 << 20, prefer="p4")
    assert await src.get(cert, 1 << 16) is None  # 1790bbd: refused, every source asked, nothing held
    assert src.refused >= 1
    assert cert not in src.fetched
