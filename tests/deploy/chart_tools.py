"""Rendering the specd Helm chart offline, and reading what it renders.

`render` runs Helm v4's own engine in-process (helm_python, no helm binary, no cluster) and
returns the manifests as dicts. `merge_values` combines values files the way ``helm -f a -f b``
does (maps merge, anything else is replaced; a null survives the merge and deletes the key when
Helm coalesces the values with the chart's defaults).

`launch` reads a container's command (``python -m`` or ``torchrun``) the way torchrun does.

`ingress_allowed` evaluates the rendered NetworkPolicies for one connection, with the
semantics of the Kubernetes NetworkPolicy API (ingress only, ``matchLabels`` selectors only: a
selector with ``matchExpressions`` raises rather than being misread).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml
from torch.distributed.run import get_args_parser as torchrun_parser

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "k8s" / "specd"
DOCKER = REPO / "deploy" / "docker"
RELEASE = "specd"
NAMESPACE = "inference"

Manifest = dict[str, Any]


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """A Dockerfile's (INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    logical, current = [], ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        current += " " + stripped.removesuffix("\\")
        if not stripped.endswith("\\"):
            keyword, _, rest = current.strip().partition(" ")
            logical.append((keyword.upper(), rest.strip()))
            current = ""
    return logical


def cpu_image_zoo() -> str:
    """Where Dockerfile.cpu builds the zoo (its ENV SPECD_ZOO)."""
    return next(rest.split("=", 1)[1] for keyword, rest in dockerfile_instructions(DOCKER / "Dockerfile.cpu")
                if keyword == "ENV" and rest.startswith("SPECD_ZOO="))


def load_values_file(name: str) -> dict[str, Any]:
    """A values file of the chart (e.g. "values-cpu.yaml") as a dict."""
    return yaml.safe_load((CHART / name).read_text()) or {}


def merge_values(*layers: dict[str, Any]) -> dict[str, Any]:
    """Later layers override earlier ones; nested maps merge (``helm -f`` semantics)."""
    merged: dict[str, Any] = {}
    for layer in layers:
        _merge_into(merged, copy.deepcopy(layer))
    return merged


def _merge_into(base: dict[str, Any], layer: dict[str, Any]) -> None:
    for key, value in layer.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge_into(base[key], value)
        else:
            base[key] = value


def render(values: dict[str, Any] | None = None, *, namespace: str = NAMESPACE) -> list[Manifest]:
    """Every manifest the chart renders with ``values`` over its defaults (NOTES.txt left out)."""
    with helm.Chart.load(CHART) as chart:
        rendered = chart.render(values=values or {}, name=RELEASE, namespace=namespace, is_install=True)
    manifests = []
    for path, text in sorted(rendered.items()):
        if path.endswith("NOTES.txt"):
            continue
        manifests.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return manifests


def find(manifests: Iterable[Manifest], kind: str, name: str) -> Manifest:
    """The manifest of ``kind`` named ``name``; AssertionError listing what there is otherwise."""
    manifests = list(manifests)
    for manifest in manifests:
        if manifest["kind"] == kind and manifest["metadata"]["name"] == name:
            return manifest
    present = sorted(f"{m['kind']}/{m['metadata']['name']}" for m in manifests)
    raise AssertionError(f"no {kind}/{name} among the rendered manifests: {present}")


def of_kind(manifests: Iterable[Manifest], kind: str) -> list[Manifest]:
    return [m for m in manifests if m["kind"] == kind]


def full_name(component: str) -> str:
    """The name the chart gives a component's objects (release "specd" contains the chart name)."""
    return f"{RELEASE}-{component}"


def container(deployment: Manifest, name: str | None = None) -> Manifest:
    """The Deployment's container named ``name`` (default: its only one)."""
    containers = deployment["spec"]["template"]["spec"]["containers"]
    if name is None:
        assert len(containers) == 1, f"{deployment['metadata']['name']} has {len(containers)} containers"
        return containers[0]
    return next(c for c in containers if c["name"] == name)


def flags(container_spec: Manifest) -> dict[str, str]:
    """A container's ``--name=value`` arguments as {"--name": "value"}."""
    parsed = {}
    for arg in container_spec.get("args", []):
        name, _, value = arg.partition("=")
        parsed[name] = value
    return parsed


@dataclass(frozen=True)
class Launch:
    """How a container starts its service."""

    module: str
    processes: int
    argv: list[str]
    """The service's own command line."""
    shutdown_timeout: int | None = None
    """torchrun's: seconds between passing SIGTERM to the ranks and killing them."""


def launch(container_spec: Manifest) -> Launch:
    """``python -m MODULE ARGS`` (one process) or ``torchrun ... -m MODULE ARGS`` (one node, N
    processes), the latter read with torchrun's own argument parser."""
    command, args = container_spec["command"], container_spec.get("args", [])
    if command[0] == "torchrun":
        parsed = torchrun_parser().parse_args(command[1:] + args)
        assert parsed.module and parsed.standalone, f"not a one-node `torchrun -m` launch: {command}"
        return Launch(parsed.training_script, int(parsed.nproc_per_node), list(parsed.training_script_args),
                      parsed.shutdown_timeout)
    assert command[:2] == ["python", "-m"] and len(command) == 3, f"not a `python -m` launch: {command}"
    return Launch(command[2], 1, list(args))


def pod_env(manifests: list[Manifest], deployment: Manifest, secrets: dict[str, dict[str, str]] | None = None,
            ) -> dict[str, str]:
    """The environment the container of ``deployment`` starts with, as the kubelet builds it:
    ConfigMaps of envFrom first, then ``env`` in order (later wins), $(VAR) expanded from what
    is defined before it; secretKeyRef values come from ``secrets`` ({name: {key: value}}) and
    are "<secret name/key>" placeholders otherwise."""
    spec = container(deployment)
    env: dict[str, str] = {}
    for source in spec.get("envFrom", []):
        env.update(find(manifests, "ConfigMap", source["configMapRef"]["name"]).get("data") or {})
    for item in spec.get("env", []):
        if "valueFrom" in item:
            ref = item["valueFrom"]["secretKeyRef"]
            default = f"<{ref['name']}/{ref['key']}>"
            env[item["name"]] = (secrets or {}).get(ref["name"], {}).get(ref["key"], default)
        else:
            value = item.get("value", "")
            for name, defined in env.items():
                value = value.replace(f"$({name})", defined)
            env[item["name"]] = value
    return env


# ---------------------------------------------------------------------------- NetworkPolicy
@dataclass(frozen=True)
class Pod:
    """A pod as NetworkPolicies see it: labels, namespace (and its labels), named ports."""

    name: str
    namespace: str
    labels: dict[str, str]
    ports: dict[str, int]

    @property
    def namespace_labels(self) -> dict[str, str]:
        return {"kubernetes.io/metadata.name": self.namespace}


def pods_of(manifests: list[Manifest]) -> dict[str, Pod]:
    """One pod per rendered Deployment, keyed by its component label."""
    pods = {}
    for deployment in of_kind(manifests, "Deployment"):
        template = deployment["spec"]["template"]
        labels = template["metadata"]["labels"]
        ports = {p["name"]: p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
        component = labels["app.kubernetes.io/component"]
        pods[component] = Pod(deployment["metadata"]["name"], NAMESPACE, labels, ports)
    return pods


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if set(selector) - {"matchLabels"}:
        raise NotImplementedError(f"selector {selector} uses more than matchLabels; extend ingress_allowed")
    return all(labels.get(key) == value for key, value in (selector.get("matchLabels") or {}).items())


def _peer_matches(peer: dict[str, Any], source: Pod, policy_namespace: str) -> bool:
    if "ipBlock" in peer:
        return False  # pod-to-pod traffic is judged by selectors only
    if "namespaceSelector" in peer:
        in_namespace = _selects(peer["namespaceSelector"], source.namespace_labels)
    else:
        in_namespace = source.namespace == policy_namespace
    return in_namespace and _selects(peer.get("podSelector", {}), source.labels)


def _port_matches(rule_ports: list[dict[str, Any]] | None, destination: Pod, port_name: str) -> bool:
    if not rule_ports:
        return True
    number = destination.ports[port_name]
    return any(p.get("port") in (port_name, number) and p.get("protocol", "TCP") == "TCP" for p in rule_ports)


def ingress_allowed(policies: list[Manifest], source: Pod, destination: Pod, port_name: str) -> bool:
    """Whether ``source`` may open a TCP connection to ``destination``'s port ``port_name``."""
    selecting = [
        p for p in policies
        if p["metadata"].get("namespace", NAMESPACE) == destination.namespace
        and _selects(p["spec"]["podSelector"], destination.labels)
        and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
    ]
    if not selecting:
        return True  # not isolated for ingress
    for policy in selecting:
        for rule in policy["spec"].get("ingress") or []:
            peers = rule.get("from")
            from_ok = not peers or any(_peer_matches(peer, source, destination.namespace) for peer in peers)
            if from_ok and _port_matches(rule.get("ports"), destination, port_name):
                return True
    return False
