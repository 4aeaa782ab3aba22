"""The zoo's stamps: a changed recipe rebuilds its step and every step downstream of it, and
nothing else (a drafter trained on an older target's answers is stale, whatever its own recipe)."""

from __future__ import annotations

import fcntl
import json
import threading
from pathlib import Path

import pytest

from specd import zoo


def _steps(runs: list[str], target_steps: int) -> list[zoo.Step]:
    def writes(name):
        def run(out: Path) -> None:
            runs.append(name)
            (out / "out.txt").write_text(name)
        return run

    return [
        zoo.Step(name="data", recipe={"size": 1}, run=writes("data")),
        zoo.Step(name="target", recipe={"steps": target_steps}, run=writes("target"), needs=("data",)),
        zoo.Step(name="other", recipe={"steps": 3}, run=writes("other"), needs=("data",)),
        zoo.Step(name="answers", recipe={"n": 4}, run=writes("answers"), needs=("target", "data")),
        zoo.Step(name="drafter", recipe={"lr": 1}, run=writes("drafter"), needs=("target", "answers")),
    ]


def _build(monkeypatch, target_steps: int, only: str | None = None) -> list[str]:
    runs: list[str] = []
    monkeypatch.setattr(zoo, "steps", lambda: _steps(runs, target_steps))
    assert zoo.build(log=lambda _: None, only=only) == runs
    return runs


def test_a_changed_recipe_rebuilds_its_step_and_what_reads_it(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECD_ZOO", str(tmp_path))
    assert _build(monkeypatch, 10) == ["data", "target", "other", "answers", "drafter"]
    assert _build(monkeypatch, 10) == []  # every stamp matches
    assert _build(monkeypatch, 20) == ["target", "answers", "drafter"]  # not data, not other
    stamp = json.loads((tmp_path / "drafter" / ".done").read_text())
    assert stamp["recipe"]["needs"]["target"]["steps"] == 20
    assert stamp["recipe"]["needs"]["answers"]["needs"]["target"]["steps"] == 20
    assert _build(monkeypatch, 10, only="answers") == ["target", "answers"]  # only what it needs
    assert _build(monkeypatch, 10) == ["drafter"]


def test_an_unknown_step_is_refused_with_the_names(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECD_ZOO", str(tmp_path))
    monkeypatch.setattr(zoo, "steps", lambda: _steps([], 1))
    with pytest.raises(ValueError, match="steps: data, target"):
        zoo.build(log=lambda _: None, only="nope")


def test_a_build_waiting_for_another_builds_lock_says_so_then_builds(tmp_path, monkeypatch):
    """A second build (say `specd bench recipe` while `specd zoo build` runs) blocks on the zoo's
    lock; it says why, and builds once the lock is free."""
    monkeypatch.setenv("SPECD_ZOO", str(tmp_path))
    runs: list[str] = []
    monkeypatch.setattr(zoo, "steps", lambda: _steps(runs, 1))
    said: list[str] = []
    waiting = threading.Event()

    def log(line: str) -> None:
        said.append(line)
        if "waiting" in line:
            waiting.set()

    with open(tmp_path / ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        builder = threading.Thread(target=zoo.build, kwargs={"log": log, "only": "data"})
        builder.start()
        assert waiting.wait(30), f"no line said the build waits for the lock: {said}"
        assert runs == []  # nothing built while the lock is held
        fcntl.flock(held, fcntl.LOCK_UN)
    builder.join(30)
    assert not builder.is_alive() and runs == ["data"]


def test_a_step_outside_the_list_builds_what_it_needs_and_is_stamped_like_the_rest(tmp_path, monkeypatch):
    """`zoo.build_step` (the bench's smaller answer sets): its needs first, itself once, and
    again after a step it reads changed."""
    monkeypatch.setenv("SPECD_ZOO", str(tmp_path))
    runs: list[str] = []
    extra = zoo.Step(name="answers-small", recipe={"n": 1},
                     run=lambda out: runs.append("answers-small"), needs=("target", "data"))
    monkeypatch.setattr(zoo, "steps", lambda: _steps(runs, 10))
    assert zoo.build_step(extra, log=lambda _: None) == tmp_path / "answers-small"
    assert runs == ["data", "target", "answers-small"]
    zoo.build_step(extra, log=lambda _: None)
    assert runs == ["data", "target", "answers-small"]  # every stamp matches
    monkeypatch.setattr(zoo, "steps", lambda: _steps(runs, 20))
    zoo.build_step(extra, log=lambda _: None)
    assert runs[3:] == ["target", "answers-small"]
