"""A checkpoint swapped in by renames (`specd.train.opd.swap_in`) survives a kill at any point:
`recover_checkpoint` finds the newest complete one, and the next save works whatever was left."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from specd.train.opd import complete_checkpoint, recover_checkpoint, swap_in


def write(directory: Path, content: str) -> Path:
    directory.mkdir(parents=True)
    (directory / "state").write_text(content)
    return directory


def content(directory: Path) -> str:
    return (directory / "state").read_text()


def crashed(root: Path, point: str) -> Path:
    """The checkpoint ``root/online`` after a save of "B" over "A" was killed at ``point``."""
    online, partial, old = root / "online", root / "online.partial", root / "online.old"
    write(online, "A")
    if point == "writing":  # NAME.partial is cut short
        partial.mkdir()
    elif point == "written":
        write(partial, "B")
    elif point == "moved aside":  # NAME -> NAME.old, NAME.partial not renamed yet
        write(partial, "B")
        online.rename(old)
    elif point == "swapped":  # NAME.partial -> NAME, NAME.old not removed yet
        online.rename(old)
        write(online, "B")
    return online


@pytest.mark.parametrize("point, expected", [("writing", "A"), ("written", "A"), ("moved aside", "B"),
                                             ("swapped", "B")])
def test_a_kill_anywhere_in_a_save_leaves_a_complete_checkpoint(tmp_path, point, expected):
    online = crashed(tmp_path, point)
    assert content(complete_checkpoint(online)) == expected  # readable without renaming anything
    recover_checkpoint(online)
    assert content(online) == expected
    assert not (tmp_path / "online.old").exists()
    shutil.rmtree(tmp_path / "online.partial", ignore_errors=True)  # the next save, as save_checkpoint does it
    swap_in(write(tmp_path / "online.partial", "C"), online)
    assert content(online) == "C" and sorted(p.name for p in tmp_path.iterdir()) == ["online"]


def test_a_first_save_cut_short_is_no_checkpoint(tmp_path):
    (tmp_path / "online.partial").mkdir()
    assert complete_checkpoint(tmp_path / "online") is None
    recover_checkpoint(tmp_path / "online")
    assert not (tmp_path / "online").exists()


def test_a_leftover_old_checkpoint_does_not_stop_the_next_swap(tmp_path):
    online = write(tmp_path / "online", "A")
    write(tmp_path / "online.old", "stale")  # a kill after the swap, before the cleanup
    swap_in(write(tmp_path / "online.partial", "B"), online)
    assert content(online) == "B" and not (tmp_path / "online.old").exists()
