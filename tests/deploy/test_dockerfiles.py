"""deploy/docker: the images the chart runs, checked without a Docker daemon.

Each Dockerfile copies only files that exist (and that its .dockerignore lets through), installs
the pinned torch and the project, and runs as a numeric non-root USER equal to the chart's
securityContext.runAsUser (Kubernetes can verify runAsNonRoot only for a numeric user). The CPU
image builds the zoo where values-cpu.yaml looks for it.
"""

from __future__ import annotations

import fnmatch
import re
import shlex
import tomllib
from pathlib import Path

import pytest
from chart_tools import DOCKER, REPO, cpu_image_zoo, dockerfile_instructions, load_values_file

DOCKERFILES = ("Dockerfile.cpu", "Dockerfile.cuda")


def copied_sources(path: Path) -> list[str]:
    """The build-context paths COPY reads (COPY --from=<stage> reads a stage, not the context)."""
    sources = []
    for keyword, rest in dockerfile_instructions(path):
        if keyword == "COPY" and "--from=" not in rest:
            sources += [word for word in shlex.split(rest)[:-1] if not word.startswith("--")]
    return sources


def ignored(dockerignore: Path, relative: str) -> bool:
    """Whether .dockerignore's patterns (last match wins, ! re-includes) exclude ``relative``."""
    excluded = False
    for pattern in dockerignore.read_text().splitlines():
        pattern = pattern.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.removeprefix("!").rstrip("/")
        if fnmatch.fnmatch(relative, pattern) or relative.startswith(pattern + "/"):
            excluded = not negate
    return excluded


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_copies_existing_files_that_its_dockerignore_keeps(name):
    sources = copied_sources(DOCKER / name)
    assert {"pyproject.toml", "README.md", "specd", "services"} <= set(sources), sources
    for source in sources:
        assert (REPO / source).exists(), f"{name} copies {source}, which is not in the repository"
        assert not ignored(DOCKER / f"{name}.dockerignore", source), f"{name}.dockerignore drops {source}"
    assert ignored(DOCKER / f"{name}.dockerignore", ".venv"), "the virtualenv must stay out of the build context"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_runs_as_the_charts_numeric_non_root_user(name):
    steps = dockerfile_instructions(DOCKER / name)
    users = [rest for keyword, rest in steps if keyword == "USER"]
    assert users, f"{name} has no USER: the image would run as root"
    user, _, group = users[-1].partition(":")
    assert user.isdigit() and int(user) > 0, f"{name}: USER {users[-1]} must be a numeric id other than 0"
    security = load_values_file("values.yaml")["securityContext"]
    assert int(user) == security["runAsUser"] and int(group or user) == security["runAsGroup"]
    assert steps[-1][0] in ("CMD", "ENTRYPOINT") and ("ENTRYPOINT", '["python"]') in steps


def test_images_install_the_pinned_torch_and_the_project():
    pinned = next(d for d in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
                  if d.startswith("torch"))
    cpu, cuda = ((DOCKER / name).read_text() for name in DOCKERFILES)
    assert "FROM ${PYTHON_IMAGE}" in cpu and "ARG PYTHON_IMAGE=python:3.11-slim" in cpu
    assert re.search(r"ARG CUDA_IMAGE=nvidia/cuda:[\w.]+-runtime-", cuda), "the CUDA image needs a CUDA runtime base"
    for text in (cpu, cuda):
        assert pinned in text, f"the images must install {pinned} (pyproject's pin)"
    assert f"--index-url https://download.pytorch.org/whl/cpu {pinned}" in cpu
    assert "pip install .\n" in cpu and 'pip install ".[gpu]"' in cuda
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "gpu" in extras


def test_cpu_image_builds_the_zoo_where_values_cpu_looks():
    steps = dockerfile_instructions(DOCKER / "Dockerfile.cpu")
    zoo = cpu_image_zoo()
    assert any(keyword == "RUN" and "specd zoo build" in rest for keyword, rest in steps)
    assert ("COPY", f"--from=build {zoo} {zoo}") in steps, "the zoo must reach the final stage"
    values = load_values_file("values-cpu.yaml")
    assert values["models"]["storage"]["type"] == "image"
    for role in ("drafter", "verifier"):
        assert Path(values[role]["model"]).parent == Path(zoo), f"values-cpu.yaml {role}.model is not in {zoo}"
