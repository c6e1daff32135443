"""The shared-memory store is mode 0660 of `api.group`, so an engine running as another user of that group attaches."""

from __future__ import annotations

import grp
import os
import stat
import subprocess
from pathlib import Path

import pytest

from patchswarm.daemon.store_format import StoreError, StoreLayout
from patchswarm.daemon.weightstore import WeightStore
from patchswarm.protocol.served import TensorSpec
from tests.support.daemonkit import make_daemon
from tests.support.swarmkit import Swarm

GROUP = "users" if "users" in {g.gr_name for g in grp.getgrall()} else "nogroup"


def layout() -> StoreLayout:
    return StoreLayout.from_specs([TensorSpec("w", "F32", (4,))])


@pytest.fixture
def umask_077() -> object:
    old = os.umask(0o077)  # the strictest umask a shell could have: the mode must not depend on it
    yield
    os.umask(old)


@pytest.mark.usefixtures("umask_077")
@pytest.mark.parametrize("engine_buffer", [False, True])
def test_a_store_is_created_0660_of_the_given_group(tmp_path: Path, engine_buffer: bool) -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a file to another group needs root or membership")
    store = WeightStore.create("ps-perm", layout(), engine_buffer=engine_buffer, shm_dir=tmp_path, group=GROUP)
    try:
        st = os.stat(tmp_path / "ps-perm")
        assert stat.S_IMODE(st.st_mode) == 0o660
        assert st.st_gid == grp.getgrnam(GROUP).gr_gid
    finally:
        store.destroy()


@pytest.mark.usefixtures("umask_077")
def test_without_a_group_the_store_is_0660_of_the_creators_group(tmp_path: Path) -> None:
    store = WeightStore.create("ps-perm", layout(), shm_dir=tmp_path)
    try:
        st = os.stat(tmp_path / "ps-perm")
        assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == os.getegid()
    finally:
        store.destroy()


def test_an_unknown_group_is_one_line_naming_the_key_and_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match=r"^api.group: no such group 'no-such-group-x'$"):
        WeightStore.create("ps-perm", layout(), shm_dir=tmp_path, group="no-such-group-x")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.asyncio
async def test_an_engine_of_another_user_in_api_group_opens_the_daemons_store(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("running the engine as another user needs root")
    sw = Swarm(tmp_path)
    sw.publish()
    await sw.start_seed()
    d = make_daemon(sw, "d1", tmp_path)
    d.start(PATCHSWARM_API_GROUP=GROUP)
    try:
        await d.wait_version(1)
        path = f"/dev/shm/{d.store}"
        st = os.stat(path)
        assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == grp.getgrnam(GROUP).gr_gid
        opener = ["/usr/bin/python3", "-c", f"import os; os.close(os.open({path!r}, os.O_RDWR)); print('ok')"]
        as_member = subprocess.run(opener, user="nobody", group="nogroup", extra_groups=[GROUP], capture_output=True)
        assert as_member.stdout == b"ok\n", as_member.stderr
        if GROUP != "nogroup":  # and a user outside the group cannot
            outsider = subprocess.run(opener, user="nobody", group="nogroup", extra_groups=[], capture_output=True)
            assert b"PermissionError" in outsider.stderr
        assert await d.stop() == 0
    finally:
        d.cleanup()
        await sw.close()
