"""A payload refused only at its end (a stream with a byte left over: every record decodes, then the
reader's last check refuses it), signed under a manifest that matches it, in both payload formats:
``apply_patch`` / ``apply_version`` have by then written every record into the model they were given
(the work copy), so each apply path must give them a copy it throws away, or write nothing before the
payload verified.  Each path here is checked to leave what it holds byte-identical: the daemon's held
model (decode_once: decoded against it, never written), the swarm node's held version (apply_chunks,
StagedApply: a clone), ``patchswarm apply``'s base file and output path; an anchor decoded into an
empty host store leaves it unpublished (not READY: no reader attributes its bytes)."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from patchswarm.daemon.cli import main
from patchswarm.daemon.shadow import decode_once, store_model
from patchswarm.daemon.store_format import StoreLayout, StoreState
from patchswarm.daemon.weightstore import WeightStore
from patchswarm.protocol.codec import apply_patch
from patchswarm.protocol.errors import FormatError
from patchswarm.protocol.held import Held
from patchswarm.protocol.patch_format import Encoding, read_header
from patchswarm.protocol.patchfile import Version, build_version, sign_version, write_file
from patchswarm.protocol.safetensors_io import save_safetensors
from patchswarm.protocol.served import ServedModel, state_root
from patchswarm.swarm.staging import StagedApply, apply_chunks
from tests.support.format2 import with_stream_tail
from tests.support.helpers import adam_like_pair
from tests.support.store_worker import remove_segments, unique_name

REFUSAL = "unused|more data than declared"


def _refused_at_the_end(v: Version, target: ServedModel, base: ServedModel | None) -> Version:
    """``v`` with a byte 1 after the end of a stream, under a manifest of its own: its ``bits`` stream's
    (declared: there is room under the layout's bound), or an anchor's last (not declared: an anchor's
    streams fill their bound, so only the stream's frame holds it)."""
    assert v.encoded is not None
    records, streams = read_header(v.payload, target.specs).records, read_header(v.payload, target.specs).streams
    anchor = all(e == Encoding.FULL for e, _ in records)
    stream = streams[-1][0] if anchor else "bits"
    payload = with_stream_tail(bytes(v.payload), stream, b"\x01", declared=not anchor)
    encoded = dataclasses.replace(v.encoded, payload=payload, raw_size=v.encoded.raw_size + (0 if anchor else 1))
    return sign_version(
        encoded,
        target.specs,
        target.digests(),
        run_id="r",
        version=v.manifest.version,
        now_ms=0,
        base_version=v.manifest.base_version,
        base_root=None if base is None else state_root(base.specs, base.digests()),
        metadata=target.metadata,
    )


@pytest.fixture(params=[1, 2], ids=["format1", "format2"])
def crafted(request: pytest.FixtureRequest) -> tuple[ServedModel, ServedModel, Version]:
    base, target = adam_like_pair(seed=11)
    v = build_version(base, target, run_id="r", version=2, base_version=1, now_ms=0, payload_format=request.param)
    if request.param == 2:
        assert Encoding.SPARSE_CTX in {e for e, _ in read_header(v.payload, target.specs).records}
    return base, target, _refused_at_the_end(v, target, base)


def test_the_payload_is_refused_after_every_record_was_written(
    crafted: tuple[ServedModel, ServedModel, Version],
) -> None:
    """The hazard the paths below guard against: the model applied to holds the whole target when refused."""
    base, target, bad = crafted
    work = base.clone()
    with pytest.raises(FormatError, match=REFUSAL):
        apply_patch(work, bad.payload, list(bad.manifest.specs))
    assert work.bitwise_equal(target) and not work.bitwise_equal(base)


def test_the_daemon_decodes_against_its_held_model_without_writing_it(
    crafted: tuple[ServedModel, ServedModel, Version],
) -> None:
    base, _, bad = crafted
    before, digests = base.clone(), base.digests()
    held = Held(1, base, list(digests))
    with pytest.raises(FormatError, match=REFUSAL):
        decode_once(held, bad.manifest, [bytes(bad.payload)])
    assert base.bitwise_equal(before) and held.digests == digests and held.version == 1


def test_the_swarm_applies_to_a_clone_of_its_held_version(crafted: tuple[ServedModel, ServedModel, Version]) -> None:
    base, _, bad = crafted
    before = base.clone()
    held = Held(1, base, base.digests())
    with pytest.raises(FormatError, match=REFUSAL):
        apply_chunks(held, bad.manifest, [bytes(bad.payload)])
    assert base.bitwise_equal(before)

    async def staged() -> None:
        stage = StagedApply()
        stage.prepare(held, bad.manifest)  # (the copy made while the chunks arrive)
        with pytest.raises(FormatError, match=REFUSAL):
            await stage(held, bad.manifest, [bytes(bad.payload)])

    asyncio.run(staged())
    assert base.bitwise_equal(before)


def test_patchswarm_apply_leaves_its_base_file_and_writes_no_output(
    crafted: tuple[ServedModel, ServedModel, Version], tmp_path: Path
) -> None:
    base, _, bad = crafted
    save_safetensors(base, tmp_path / "base.safetensors")
    write_file(tmp_path / "bad.psw", bad)
    before = (tmp_path / "base.safetensors").read_bytes()
    out = tmp_path / "out.safetensors"
    assert main(["apply", str(tmp_path / "base.safetensors"), str(tmp_path / "bad.psw"), "-o", str(out)]) != 0
    assert (tmp_path / "base.safetensors").read_bytes() == before
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["bad.psw", "base.safetensors"]


def test_an_anchor_refused_at_its_end_leaves_the_empty_store_unpublished(tmp_path: Path) -> None:
    """The one path that decodes into memory a reader maps (daemon/rollout_activation.py
    ``_empty_host_store``): a store that serves nothing, its fence odd (LOADING) throughout."""
    _, target = adam_like_pair(seed=11)
    bad = _refused_at_the_end(build_version(None, target, run_id="r", version=1, now_ms=0), target, None)
    name = unique_name("refused")
    store = WeightStore.create(name, StoreLayout.from_specs(list(target.specs)))
    try:
        store.control.begin(StoreState.LOADING, gated=False)
        with pytest.raises(FormatError, match=REFUSAL):
            decode_once(None, bad.manifest, [bytes(bad.payload)], into=store_model(store))
        assert any(bool(store.slot_bytes(i).any()) for i in range(len(target.specs)))  # (written, then refused)
        assert store.header().state == StoreState.LOADING
        assert store.control.snapshot() is None  # (mid-write: an engine's FenceReader reads no version)
    finally:
        store.close()
        remove_segments(name)
