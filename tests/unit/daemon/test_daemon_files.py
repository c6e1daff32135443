"""The daemon's own files (activation journal, high-water marks, equivocation proofs) are read
bounded and only as regular files: a FIFO or an oversized file planted in data.dir is refused with
one line (a journal: treated as torn), never blocks the daemon or exhausts its memory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from patchswarm.daemon.journal import JOURNAL_NAME, TornJournalError, read_journal
from patchswarm.daemon.pull_state import PullState, evidence_dir
from patchswarm.protocol.errors import FormatError


def test_a_fifo_or_oversized_journal_is_torn_not_read(tmp_path: Path) -> None:
    assert read_journal(tmp_path) is None
    os.mkfifo(tmp_path / JOURNAL_NAME)  # an open would wait for a writer forever
    with pytest.raises(TornJournalError, match="FIFO"):
        read_journal(tmp_path)
    (tmp_path / JOURNAL_NAME).unlink()
    (tmp_path / JOURNAL_NAME).write_bytes(b"\0" * 4096)
    with pytest.raises(TornJournalError, match="larger than any journal"):
        read_journal(tmp_path, limit=1024)


def test_a_fifo_or_oversized_state_file_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = tmp_path / "pull-state.msgpack"
    os.mkfifo(state)
    with pytest.raises(FormatError, match="state file cannot be read \\(not a regular file \\(a FIFO\\)\\)"):
        PullState.load(state, "run")
    state.unlink()
    monkeypatch.setattr("patchswarm.daemon.pull_state.MAX_STATE_BYTES", 100)
    state.write_bytes(b"\0" * 101)
    with pytest.raises(FormatError, match="more than the 100 allowed"):
        PullState.load(state, "run")
    state.unlink()
    evidence_dir(state).mkdir()
    os.mkfifo(evidence_dir(state) / "run.0123.msgpack")
    with pytest.raises(FormatError, match="equivocation proof is corrupt"):
        PullState.load(state, "run")
