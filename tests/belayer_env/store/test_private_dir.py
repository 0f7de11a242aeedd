"""``private_dir``: a store (or scratch) is refused when anyone but this user and root can
replace it or any directory above it (issue 47, item 6), as ssh's StrictModes refuses a key.

The other user is the real ``nobody`` acting in real processes (``as_nobody``); its
directories live under a root-owned 0755 one in /tmp (``public_dir``) that it can reach.
"""

from __future__ import annotations

import os
import re

import pytest

from belayer_core.errors import ConfigError
from belayer_env.store.store import CheckpointStore
from tests.belayer_env.store.as_nobody import NOBODY, as_nobody, made_by_nobody

RENAME_AND_PLANT = """
import os, sys
store = sys.argv[1]
os.rename(store, store + ".old")
os.mkdir(store, 0o700)
print(os.stat(store).st_uid)
"""


def test_a_store_under_a_directory_another_user_owns_is_refused(public_dir, tmp_path):
    theirs = made_by_nobody(public_dir / "p", 0o755)
    with pytest.raises(ConfigError) as info:
        CheckpointStore(theirs / "store", scratch=tmp_path / "scratch")
    text = str(info.value)
    assert f"{theirs} " in text and "uid 65534 (nobody)" in text and "mode 0755" in text, text
    assert not (theirs / "store").exists(), "refused, yet a directory was made in nobody's"
    # why: a store made there (as the unchecked code made it) is nobody's to swap for their own
    (theirs / "store").mkdir(mode=0o700)
    assert as_nobody(RENAME_AND_PLANT, str(theirs / "store")).strip() == str(NOBODY)
    with pytest.raises(ConfigError, match=re.escape(f"{theirs} ")):
        CheckpointStore(theirs / "store", create=False)


def test_a_directory_above_writable_by_others_and_not_sticky_is_refused(public_dir, tmp_path):
    open_dir = public_dir / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)  # root's, but anyone may rename what is in it
    (open_dir / "a").mkdir(mode=0o755)
    with pytest.raises(ConfigError, match=re.escape(f"{open_dir} ") + ".*mode 0777"):
        CheckpointStore(open_dir / "a" / "store", scratch=tmp_path / "scratch")
    assert as_nobody(RENAME_AND_PLANT, str(open_dir / "a")).strip() == str(NOBODY)  # the threat, for real


def test_a_sticky_directory_above_is_fine_when_what_is_in_it_is_ours(public_dir, tmp_path):
    sticky = public_dir / "shm"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)  # like /tmp and /dev/shm: nobody may not rename root's entries
    store = CheckpointStore(sticky / "mine" / "store", scratch=tmp_path / "scratch")
    assert (store.path / ".staging").is_dir() and os.stat(store.path).st_mode & 0o777 == 0o700
    assert os.stat(sticky / "mine").st_mode & 0o022 == 0, "a parent it made is writable by others"
    theirs = made_by_nobody(sticky / "theirs", 0o755)
    with pytest.raises(ConfigError, match=re.escape(f"{theirs} ") + ".*uid 65534"):
        CheckpointStore(theirs / "store", scratch=tmp_path / "scratch")


def test_a_link_another_user_planted_above_the_store_is_refused(public_dir, tmp_path):
    sticky = public_dir / "shm"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    target = public_dir / "elsewhere"
    target.mkdir(mode=0o755)
    as_nobody("import os, sys; os.symlink(sys.argv[1], sys.argv[2])", str(target), str(sticky / "link"))
    with pytest.raises(ConfigError, match=re.escape(f"{sticky / 'link'} ") + ".*uid 65534"):
        CheckpointStore(sticky / "link" / "store", scratch=tmp_path / "scratch")
    assert not (target / "store").exists()
    # the same link made by root (nobody cannot replace it in a sticky directory) is followed
    os.unlink(sticky / "link")
    (sticky / "link").symlink_to(target)
    assert CheckpointStore(sticky / "link" / "store", scratch=tmp_path / "scratch").list() == []
    assert (target / "store" / ".staging").is_dir()


def test_a_scratch_base_under_a_directory_another_user_owns_is_refused(public_dir, tmp_path):
    theirs = made_by_nobody(public_dir / "p", 0o755)
    with pytest.raises(ConfigError, match="scratch directory.*" + re.escape(f"{theirs} ") + ".*uid 65534"):
        CheckpointStore(tmp_path / "store", scratch=theirs / "scratch")
    assert not (theirs / "scratch").exists()


def test_a_hard_link_of_a_root_link_in_a_sticky_directory_is_not_followed(public_dir, tmp_path):
    """With ``fs.protected_hardlinks=0`` anyone may give root's symlink a second name in
    /tmp: root's, yet placed by someone else. Made here by root itself: the same inode."""
    sticky = public_dir / "shm"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    (public_dir / "elsewhere").mkdir(mode=0o755)
    (public_dir / "roots-link").symlink_to(public_dir / "elsewhere")
    os.link(public_dir / "roots-link", sticky / "second-name", follow_symlinks=False)
    with pytest.raises(ConfigError, match="symlink with 2 names"):
        CheckpointStore(sticky / "second-name" / "store", scratch=tmp_path / "scratch")
    assert not (public_dir / "elsewhere" / "store").exists()
