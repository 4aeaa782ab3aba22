"""The Helm chart deploy/k8s/specd, rendered offline by Helm's own engine (helm_python).

What must hold for every values set we ship (defaults, values-gpu.yaml with its tensor-parallel
verifiers, values-cpu.yaml, and one with every optional object switched on): the chart lints
strictly, each manifest validates (strict) against the Kubernetes 1.29-1.33 schemas, and the
rendered command lines (`python -m` or `torchrun`) and environments parse with the services' own
config parser. Then the properties the chart exists for: replica counts are the compute split, a
multi-process pod (verifier.tensorParallel, trainer.dataParallel) asks for one GPU per rank and
launches its ranks with /dev/shm and a drain-long shutdown, probes are gRPC probes on the gRPC
ports, the token lives only in a Secret, every verifier reaches every drafter through a headless
Service, the NetworkPolicies allow exactly the paths the services use, pods are locked down, and
the values schema refuses bad values with an error that names the key.
"""

from __future__ import annotations

import base64
import functools
import json

import helm_python as helm
import jsonschema
import kubernetes_validate
import kubernetes_validate.utils
import pytest
import yaml
from chart_tools import (
    CHART,
    NAMESPACE,
    RELEASE,
    Pod,
    container,
    cpu_image_zoo,
    find,
    flags,
    full_name,
    ingress_allowed,
    launch,
    load_values_file,
    merge_values,
    of_kind,
    pod_env,
    pods_of,
    render,
)
from yamllint import config as yamllint_config
from yamllint import linter

from services.common.config import ServiceConfig, parse_config
from services.drafter.server import DrafterConfig
from services.trainer.server import TrainerConfig
from services.verifier import drafter_pool
from services.verifier.server import VerifierConfig
from specd.data.tokenizer import ENDOFTEXT, IM_END, SPECIAL_TOKENS
from specd.flags import flag_types

KUBERNETES_VERSIONS = ("1.29", "1.30", "1.31", "1.32", "1.33")
ROLES = {"drafter": DrafterConfig, "verifier": VerifierConfig, "trainer": TrainerConfig}
GATEWAY = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}}
MONITORING = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
EVERYTHING = {  # every optional object and every non-default source of a setting
    "drafter": {"autoscaling": {"enabled": True, "kind": "keda"}, "shmSize": "1Gi"},
    "verifier": {"autoscaling": {"enabled": True, "kind": "hpa"}},
    "metrics": {"serviceMonitor": {"enabled": True}},
    "networkPolicy": {"clients": [GATEWAY], "metrics": [MONITORING]},
    "models": {"storage": {"type": "emptyDir"},
               "populate": {"enabled": True, "command": ["specd", "zoo", "build"],
                            "env": [{"name": "SPECD_ZOO", "value": "/models"}]}},
    "trainer": {"checkpoints": {"type": "emptyDir"}},
    "redis": {"external": {"existingSecret": "redis-credentials"}},
    "auth": {"existingSecret": "specd-token", "existingSecretKey": "token"},
}
MINIMAL = {  # every optional object switched off, the other model volume kind
    "trainer": {"enabled": False, "pdb": {"enabled": False}},
    "drafter": {"pdb": {"enabled": False}},
    "auth": {"enabled": False},
    "redis": {"internal": {"enabled": False}},
    "networkPolicy": {"enabled": False},
    "serviceAccount": {"create": False},
    "models": {"storage": {"type": "hostPath"}},
}
VALUE_SETS = {
    "default": {},
    "gpu": load_values_file("values-gpu.yaml"),  # verifier.tensorParallel 2
    "cpu": load_values_file("values-cpu.yaml"),
    "everything": EVERYTHING,
}
PARALLEL = merge_values(VALUE_SETS["gpu"], {  # multi-process verifier and trainer pods, GPUs for both
    "verifier": {"tensorParallel": 4},
    "trainer": {"dataParallel": 2, "resources": {"requests": {"nvidia.com/gpu": 1}}}})
CHECKED_VALUE_SETS = {**VALUE_SETS, "minimal": MINIMAL, "parallel": PARALLEL}  # lint, schemas, pod hardening
# Config fields the chart sets from verifier.tensorParallel and trainer.dataParallel (as
# --tensor-parallel / --data-parallel, only when > 1).
PARALLEL_FIELDS = {"verifier": ("tensorParallel", "tensor_parallel"), "trainer": ("dataParallel", "data_parallel")}
_RENDERED: dict[str, list[dict]] = {}


def rendered(value_set: str) -> list[dict]:
    if value_set not in _RENDERED:
        _RENDERED[value_set] = render(CHECKED_VALUE_SETS[value_set])
    return _RENDERED[value_set]


def deployment(manifests: list[dict], role: str) -> dict:
    return find(manifests, "Deployment", full_name(role))


# ---------------------------------------------------------------------------- lint and schemas
@pytest.mark.parametrize("value_set", CHECKED_VALUE_SETS)
def test_chart_lints_strictly(value_set):
    for version in KUBERNETES_VERSIONS:
        report = helm.lint(CHART, CHECKED_VALUE_SETS[value_set], strict=True, namespace=NAMESPACE,
                           kube_version=f"v{version}.0")
        # severity 1 is INFO ("icon is recommended"); strict makes warnings (2) failures too
        problems = [m for m in report["messages"] if m["severity"] >= 2]
        assert not problems and not report["errors"], f"helm lint --strict (Kubernetes {version}): {problems}"


# Custom resources are not in Kubernetes' schemas: each is checked against the part of its CRD's
# schema the chart uses (Prometheus Operator ServiceMonitor, KEDA ScaledObject), closed to other
# fields so a misspelt one fails.
_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_DURATION = {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"}
_METADATA = {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}, "labels": _STRING_MAP}}
_TARGET_REF = {"type": "object", "additionalProperties": False, "required": ["name"],
               "properties": {"apiVersion": {"type": "string"}, "kind": {"type": "string"}, "name": {"type": "string"}}}
CUSTOM_RESOURCE_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): {
        "type": "object", "required": ["metadata", "spec"], "properties": {"metadata": _METADATA, "spec": {
            "type": "object", "additionalProperties": False, "required": ["selector", "endpoints"], "properties": {
                "namespaceSelector": {"type": "object", "additionalProperties": False, "properties": {
                    "matchNames": {"type": "array", "items": {"type": "string"}}, "any": {"type": "boolean"}}},
                "selector": {"type": "object", "additionalProperties": False,
                             "properties": {"matchLabels": _STRING_MAP}},
                "endpoints": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "additionalProperties": False, "required": ["port"], "properties": {
                        "port": {"type": "string"}, "path": {"type": "string", "pattern": "^/"},
                        "interval": _DURATION, "scrapeTimeout": _DURATION}}}}}}},
    ("keda.sh/v1alpha1", "ScaledObject"): {
        "type": "object", "required": ["metadata", "spec"], "properties": {"metadata": _METADATA, "spec": {
            "type": "object", "additionalProperties": False, "required": ["scaleTargetRef", "triggers"], "properties": {
                "scaleTargetRef": _TARGET_REF,
                "minReplicaCount": {"type": "integer", "minimum": 0},
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "cooldownPeriod": {"type": "integer", "minimum": 0},
                "pollingInterval": {"type": "integer", "minimum": 1},
                "triggers": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "additionalProperties": False, "required": ["type", "metadata"], "properties": {
                        "type": {"type": "string"},
                        "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                        "metadata": _STRING_MAP}}}}}}},
}


@pytest.fixture(scope="module")
def cached_kubernetes_schemas():
    """kubernetes-validate re-reads a 1 MB definitions file on every call (two thirds of this
    module's time); the files do not change, so read each once."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kubernetes_validate.utils, "schema_contents",
                      functools.lru_cache(maxsize=None)(kubernetes_validate.utils.schema_contents))
        yield


@pytest.mark.parametrize("value_set", CHECKED_VALUE_SETS)
def test_every_manifest_validates_against_kubernetes_1_29_to_1_33(value_set, cached_kubernetes_schemas):
    errors = []
    for manifest in rendered(value_set):
        what = f"{manifest['kind']}/{manifest['metadata']['name']}"
        custom = CUSTOM_RESOURCE_SCHEMAS.get((manifest["apiVersion"], manifest["kind"]))
        if custom is not None:
            errors += [f"{what}: {e.json_path}: {e.message}"
                       for e in jsonschema.Draft202012Validator(custom).iter_errors(manifest)]
            continue
        for version in KUBERNETES_VERSIONS:
            try:
                used = kubernetes_validate.validate(manifest, version, strict=True)
            except kubernetes_validate.ValidationError as error:
                errors.append(f"{what} (Kubernetes {version}): {error.json_path}: {error.message}")
            else:
                assert used == version, f"kubernetes-validate validated {what} against {used}, not {version}"
    assert not errors, "\n".join(errors)


def test_optional_custom_resources_are_rendered_when_switched_on():
    """Guards the validation above against being vacuous for the custom resources."""
    optional = {"ServiceMonitor", "ScaledObject", "HorizontalPodAutoscaler"}
    assert optional <= {m["kind"] for m in rendered("everything")}
    assert not optional & {m["kind"] for m in rendered("default")}
    minimal = {f"{m['kind']}/{m['metadata']['name']}" for m in rendered("minimal")}
    assert minimal == {f"Deployment/{full_name('drafter')}", f"Deployment/{full_name('verifier')}",
                       f"Service/{full_name('drafter')}", f"Service/{full_name('verifier')}",
                       f"Service/{full_name('verifier')}-headless", f"ConfigMap/{full_name('drafter')}",
                       f"ConfigMap/{full_name('verifier')}", f"PodDisruptionBudget/{full_name('verifier')}"}


# ---------------------------------------------------------------------------- the services' own view
def _parse(role: str, manifests: list[dict], secrets: dict | None = None):
    spec = container(deployment(manifests, role))
    env = pod_env(manifests, deployment(manifests, role), secrets)
    started = launch(spec)
    assert started.module == f"services.{role}"
    try:
        return parse_config(ROLES[role], argv=started.argv, env=env)
    except SystemExit:
        pytest.fail(f"the {role}'s rendered flags {started.argv} and SPECD_* environment "
                    f"{ {k: v for k, v in env.items() if k.startswith('SPECD_')} } do not parse (see stderr)")


@pytest.mark.parametrize("value_set", list(VALUE_SETS))
def test_rendered_flags_and_environment_parse_with_the_services_configs(value_set):
    manifests = rendered(value_set)
    values = VALUE_SETS[value_set]
    secret = {"specd": {"auth-token": "tok", "redis-password": "pw"}, "specd-token": {"token": "tok"},
              "redis-credentials": {"redis-url": "redis://:pw@redis.example:6379/0"}}
    configs = {role: _parse(role, manifests, secret) for role in ROLES}
    for role, config in configs.items():
        service = find(manifests, "Service", full_name(role))
        grpc_port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc")
        assert (config.host, config.port) == ("0.0.0.0", grpc_port)
        assert config.auth_token == "tok"
        assert config.drain_seconds == 20
    assert configs["drafter"].redis_url == configs["trainer"].redis_url == configs["verifier"].redis_url
    assert configs["drafter"].redis_url.startswith("redis://:pw@")
    assert configs["drafter"].model == values.get("drafter", {}).get("model", "/models/d3d-qwen3-8b")
    assert configs["trainer"].drafter == configs["drafter"].model
    assert configs["verifier"].http_host == "0.0.0.0"


def test_whole_numbers_reach_the_services_as_integers():
    """Helm reads YAML numbers as floats (1000000 would print as 1e+06); the chart must not."""
    manifests = render({"trainer": {"config": {"claim_idle_ms": 3600000, "lr": 0.00002}},
                        "verifier": {"config": {"trace_maxlen": 10000000, "adaptive_block": False}}})
    trainer, verifier = _parse("trainer", manifests), _parse("verifier", manifests)
    assert (trainer.claim_idle_ms, trainer.lr, trainer.stop_token_ids) == (3600000, 0.00002, [151645, 151643])
    assert (verifier.trace_maxlen, verifier.engine.adaptive_block) == (10000000, False)


# Fields the chart sets itself (flags, Secrets), so `config` must not: each with its reason.
CHART_OWNED = {
    "common": {"host", "port", "metrics_port",  # 0.0.0.0 and the role's port values
               "auth_token",  # from the Secret
               "tls_cert", "tls_key", "tls_ca"},  # kubelet gRPC probes speak plaintext only
    "drafter": {"model", "trainer", "redis_url", "checkpoint_dir"},
    "verifier": {"model", "drafters", "http_host", "http_port", "redis_url"},
    # scoring is on the verifiers (target is the exclusive alternative); consumer is the pod name
    "trainer": {"redis_url", "drafter", "verifiers", "checkpoint_dir", "target", "consumer"},
}
JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list[int]: "array", list[str]: "array",
              int | None: "integer", float | None: "number"}  # None: the flag's own spelling (0 = full blocks)


def test_schema_config_blocks_are_the_service_config_fields():
    schema = json.loads((CHART / "values.schema.json").read_text())

    def check(block: dict, config_class: type, owned: set[str], where: str) -> None:
        hints = flag_types(config_class)  # the verifier's EngineConfig fields flattened, as its flags
        fields = set(hints)
        assert owned <= fields, f"{where}: the chart owns {owned - fields}, which {config_class.__name__} lacks"
        assert set(block["properties"]) == fields - owned, (
            f"{where} must list exactly {config_class.__name__}'s fields the chart does not set itself: "
            f"missing {sorted(fields - owned - set(block['properties']))}, "
            f"unknown {sorted(set(block['properties']) - fields)}; update values.schema.json")
        for name, rule in block["properties"].items():
            if "type" in rule:
                assert rule["type"] == JSON_TYPES[hints[name]], f"{where}.{name}: {rule['type']} vs {hints[name]}"
        assert block["additionalProperties"] is False

    check(schema["properties"]["config"], ServiceConfig, CHART_OWNED["common"], "config")
    for role, config_class in ROLES.items():
        # tensor_parallel / data_parallel: set from tensorParallel / dataParallel
        parallel = {PARALLEL_FIELDS[role][1]} if role in PARALLEL_FIELDS else set()
        check(schema["$defs"][f"{role}Config"], config_class, CHART_OWNED["common"] | CHART_OWNED[role] | parallel,
              f"{role}.config")


# ---------------------------------------------------------------------------- compute split
def test_replica_counts_are_the_drafter_to_verifier_split():
    manifests = render({"drafter": {"replicas": 6}, "verifier": {"replicas": 3}})
    drafters = deployment(manifests, "drafter")["spec"]["replicas"]
    verifiers = deployment(manifests, "verifier")["spec"]["replicas"]
    assert (drafters, verifiers, drafters / verifiers) == (6, 3, 2.0)
    assert deployment(manifests, "trainer")["spec"]["replicas"] == 1
    assert deployment(manifests, "trainer")["spec"]["strategy"] == {"type": "Recreate"}
    assert deployment(render({"drafter": {"replicas": 0}}), "drafter")["spec"]["replicas"] == 0


def test_autoscalers_own_the_replica_count_when_enabled():
    manifests = rendered("everything")
    for role in ("drafter", "verifier"):
        assert "replicas" not in deployment(manifests, role)["spec"], f"{role}: an autoscaler and replicas would fight"
    hpa = find(manifests, "HorizontalPodAutoscaler", full_name("verifier"))["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": full_name("verifier")}
    assert hpa["metrics"][0]["type"] == "Pods"
    assert hpa["metrics"][0]["pods"]["metric"]["name"] == "specd:num_requests_waiting"
    keda = find(manifests, "ScaledObject", full_name("drafter"))["spec"]
    assert keda["scaleTargetRef"]["name"] == full_name("drafter")
    assert f'service="{full_name("drafter")}"' in keda["triggers"][0]["metadata"]["query"]


# ---------------------------------------------------------------------------- probes
@pytest.mark.parametrize("ports", [{}, {"drafter": {"port": 6001}, "verifier": {"port": 6002, "httpPort": 8081},
                                        "trainer": {"port": 6003}}], ids=["default-ports", "custom-ports"])
def test_probes_are_grpc_health_on_the_grpc_port_and_liveness_is_tcp(ports):
    manifests = render(ports)
    defaults = {"drafter": 50052, "verifier": 50051, "trainer": 50060}
    for role, default in defaults.items():
        port = ports.get(role, {}).get("port", default)
        spec = container(deployment(manifests, role))
        assert {p["name"]: p["containerPort"] for p in spec["ports"]}["grpc"] == port
        for probe in ("startupProbe", "readinessProbe"):
            # no `service`: the overall status "" (NOT_SERVING while loading weights and draining)
            assert spec[probe]["grpc"] == {"port": port}, f"{role} {probe}: {spec[probe]}"
        assert spec["livenessProbe"]["tcpSocket"] == {"port": port}
        assert not {"grpc", "httpGet", "exec"} & set(spec["livenessProbe"]), "liveness must not ask health"
        assert flags(spec)["--port"] == str(port)


# ---------------------------------------------------------------------------- secrets
def test_token_comes_from_the_secret_and_never_from_a_configmap():
    token, password = "tok-" + "q7" * 20, "redispw" + "z" * 20
    manifests = render({"auth": {"token": token}, "redis": {"internal": {"password": password}}})
    secret = find(manifests, "Secret", RELEASE)
    assert base64.b64decode(secret["data"]["auth-token"]).decode() == token
    assert base64.b64decode(secret["data"]["redis-password"]).decode() == password
    for role in ROLES:
        env = {e["name"]: e for e in container(deployment(manifests, role))["env"]}
        assert env["SPECD_AUTH_TOKEN"] == {
            "name": "SPECD_AUTH_TOKEN", "valueFrom": {"secretKeyRef": {"name": RELEASE, "key": "auth-token"}}}
    for manifest in manifests:
        if manifest["kind"] != "Secret":
            text = yaml.safe_dump(manifest)
            assert token not in text and password not in text, f"a secret leaks into {manifest['metadata']['name']}"
    for config_map in of_kind(manifests, "ConfigMap"):
        assert not {"SPECD_AUTH_TOKEN", "SPECD_REDIS_URL"} & set(config_map["data"])


def test_an_existing_secret_is_used_as_is_and_a_missing_token_is_generated():
    manifests = rendered("everything")
    assert not of_kind(manifests, "Secret"), "an existing Secret for the token (and an external Redis) needs none"
    env = {e["name"]: e for e in container(deployment(manifests, "verifier"))["env"]}
    assert env["SPECD_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "specd-token", "key": "token"}
    assert env["SPECD_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "redis-credentials", "key": "redis-url"}
    generated = base64.b64decode(find(rendered("default"), "Secret", RELEASE)["data"]["auth-token"]).decode()
    assert len(generated) == 48 and generated.isalnum()
    plain = render({"auth": {"enabled": False}})
    assert all("SPECD_AUTH_TOKEN" not in pod_env(plain, deployment(plain, role)) for role in ROLES)


# ---------------------------------------------------------------------------- addressing
def test_every_verifier_reaches_every_drafter_through_a_headless_service(monkeypatch):
    manifests = rendered("default")
    service = find(manifests, "Service", full_name("drafter"))
    assert service["spec"]["clusterIP"] == "None"
    assert not service["spec"].get("publishNotReadyAddresses"), "DNS must list only ready drafters"
    drafter_labels = deployment(manifests, "drafter")["spec"]["template"]["metadata"]["labels"]
    verifier_labels = deployment(manifests, "verifier")["spec"]["template"]["metadata"]["labels"]
    selector = service["spec"]["selector"].items()
    assert selector <= drafter_labels.items() and not selector <= verifier_labels.items()
    port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc")
    host = f"{full_name('drafter')}.{NAMESPACE}.svc.cluster.local"
    address = flags(container(deployment(manifests, "verifier")))["--drafters"]
    assert address == f"dns:///{host}:{port}"

    # The verifier's pool turns that address into one replica per A record of the Service.
    def getaddrinfo(name, number, **kwargs):
        assert (name, number) == (host, port)
        return [(2, 1, 6, "", (ip, number)) for ip in ("10.0.0.7", "10.0.1.9")]

    monkeypatch.setattr(drafter_pool.socket, "getaddrinfo", getaddrinfo)
    assert drafter_pool.resolve(address) == [f"10.0.0.7:{port}", f"10.0.1.9:{port}"]


def test_trainer_scores_on_every_verifier_and_drafters_fetch_from_the_trainer():
    manifests = rendered("default")
    headless = find(manifests, "Service", f"{full_name('verifier')}-headless")
    assert headless["spec"]["clusterIP"] == "None" and [p["name"] for p in headless["spec"]["ports"]] == ["grpc"]
    verifiers = flags(container(deployment(manifests, "trainer")))["--verifiers"]
    assert verifiers == f"dns:///{full_name('verifier')}-headless.{NAMESPACE}.svc.cluster.local:50051"
    trainer_service = find(manifests, "Service", full_name("trainer"))
    assert flags(container(deployment(manifests, "drafter")))["--trainer"] == f"{full_name('trainer')}:50060"
    assert {p["name"]: p["port"] for p in trainer_service["spec"]["ports"]}["grpc"] == 50060


# ---------------------------------------------------------------------------- NetworkPolicy
SERVICE_PATHS = {  # (from, to, port): exactly the connections the services make
    ("verifier", "drafter", "grpc"),  # Speculate, Draft
    ("drafter", "trainer", "grpc"),  # GetCheckpoint
    ("trainer", "verifier", "grpc"),  # Score
    ("verifier", "redis", "redis"),  # trace stream
    ("trainer", "redis", "redis"),  # trace stream, live version key
    ("drafter", "redis", "redis"),  # live version key and its pub/sub hint (services/drafter/weights.py)
}


def _allowed(manifests: list[dict], sources: dict[str, Pod]) -> set[tuple[str, str, str]]:
    policies, pods = of_kind(manifests, "NetworkPolicy"), pods_of(manifests)
    return {(source, target, port) for source, pod in sources.items() for target, destination in pods.items()
            for port in destination.ports if ingress_allowed(policies, pod, destination, port)}


def test_network_policies_allow_exactly_the_paths_the_services_use():
    manifests = render({"networkPolicy": {"clients": [GATEWAY], "metrics": [MONITORING]}})
    pods = pods_of(manifests)
    assert set(pods) == {"drafter", "verifier", "trainer", "redis"}
    assert _allowed(manifests, pods) == SERVICE_PATHS
    outside = {"client": Pod("client", "gateway", {"app": "gateway"}, {}),
               "prometheus": Pod("prometheus", "monitoring", {"app": "prometheus"}, {}),
               "stranger": Pod("stranger", NAMESPACE, {"app": "other"}, {})}
    assert _allowed(manifests, outside) == {
        ("client", "verifier", "grpc"), ("client", "verifier", "http"),
        ("prometheus", "verifier", "http"), ("prometheus", "drafter", "metrics"), ("prometheus", "trainer", "metrics")}


def test_open_client_and_metrics_peers_keep_the_internal_ports_closed():
    manifests = rendered("default")  # clients: [] and metrics: [] mean any source
    pods = pods_of(manifests)
    stranger = Pod("stranger", NAMESPACE, {"app": "other"}, {})
    allowed = _allowed(manifests, {**pods, "stranger": stranger})
    # the verifiers' API and every metrics port are open; nothing else is
    opened = {("stranger", "verifier", "grpc"), ("stranger", "verifier", "http"), ("stranger", "drafter", "metrics")}
    assert opened <= allowed
    closed = {(s, t, p) for s, t, p in allowed if t != "verifier" and p != "metrics"}
    assert closed == {path for path in SERVICE_PATHS if path[1] != "verifier"}
    # Without a trainer, drafters use no Redis and nothing may reach a trainer.
    manifests = render({"trainer": {"enabled": False}})
    assert "trainer" not in pods_of(manifests)
    assert ("drafter", "redis", "redis") not in _allowed(manifests, pods_of(manifests))


# ---------------------------------------------------------------------------- pod hardening
@pytest.mark.parametrize("value_set", CHECKED_VALUE_SETS)
def test_pods_run_non_root_with_read_only_roots_and_no_capabilities(value_set):
    manifests = rendered(value_set)
    for item in of_kind(manifests, "Deployment"):
        pod = item["spec"]["template"]["spec"]
        name = item["metadata"]["name"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0, name
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert pod["automountServiceAccountToken"] is False, name
        volumes = {v["name"]: v for v in pod["volumes"]}
        for spec in pod["containers"] + pod.get("initContainers", []):
            security = spec["securityContext"]
            assert security["readOnlyRootFilesystem"] is True, f"{name}/{spec['name']}"
            assert security["allowPrivilegeEscalation"] is False, f"{name}/{spec['name']}"
            assert security["capabilities"] == {"drop": ["ALL"]}, f"{name}/{spec['name']}"
            assert not security.get("privileged"), f"{name}/{spec['name']}"
            for mount in spec.get("volumeMounts", []):  # writable places are volumes, never the image
                assert volumes[mount["name"]].keys() & {"emptyDir", "persistentVolumeClaim", "hostPath"}
        if name == full_name("redis"):
            continue
        main = container(item)
        mounts = {m["mountPath"]: m for m in main["volumeMounts"]}
        assert "emptyDir" in volumes[mounts["/tmp"]["name"]], f"{name}: /tmp must be writable"
        model_mounts = [m for m in main["volumeMounts"] if m["name"] == "models"]
        assert all(m.get("readOnly") for m in model_mounts), f"{name}: the models are mounted read-only"
        if "--checkpoint-dir" in flags(main):
            assert flags(main)["--checkpoint-dir"] in mounts, f"{name}: its checkpoint directory is not a volume"


@pytest.mark.parametrize("value_set", CHECKED_VALUE_SETS)
def test_termination_grace_outlasts_the_drain(value_set):
    manifests = rendered(value_set)
    for item in of_kind(manifests, "Deployment"):
        if item["metadata"]["name"] == full_name("redis"):
            continue
        drain = float(pod_env(manifests, item)["SPECD_DRAIN_SECONDS"])
        # Two phases of up to drain_seconds each: running requests, then in-flight calls.
        assert item["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > 2 * drain, item["metadata"]["name"]
        started = launch(container(item))
        if started.processes > 1:  # torchrun passes SIGTERM on, then kills the ranks after its own timeout
            assert started.shutdown_timeout > 2 * drain, f"{item['metadata']['name']}: torchrun cuts the drain short"


# ---------------------------------------------------------------------------- GPU and CPU values
def test_gpu_values_give_a_drafter_one_gpu_and_a_verifier_one_per_tensor_parallel_rank():
    manifests = rendered("gpu")
    gpus = {role: container(deployment(manifests, role))["resources"]["limits"]["nvidia.com/gpu"] for role in ROLES}
    assert gpus == {"drafter": 1, "verifier": 2, "trainer": 1}
    assert launch(container(deployment(manifests, "verifier"))).processes == 2
    assert pod_env(manifests, deployment(manifests, "drafter"))["SPECD_DEVICE"] == "cuda"
    assert flags(container(deployment(manifests, "verifier")))["--model"] == "/models/Qwen3-8B"


def test_cpu_values_run_the_zoo_baked_into_the_cpu_image_without_gpus():
    manifests = rendered("cpu")
    zoo = cpu_image_zoo()
    for item in of_kind(manifests, "Deployment"):
        for spec in item["spec"]["template"]["spec"]["containers"]:
            resources = json.dumps(spec.get("resources", {}))
            assert "nvidia.com/gpu" not in resources, f"{item['metadata']['name']} asks for a GPU"
        assert "models" not in {v["name"] for v in item["spec"]["template"]["spec"]["volumes"]}
    assert flags(container(deployment(manifests, "verifier")))["--model"] == f"{zoo}/qwen3-tiny"
    assert flags(container(deployment(manifests, "drafter")))["--model"] == f"{zoo}/d3d-qwen3-tiny"
    stop = _parse("trainer", manifests).stop_token_ids
    assert stop == [SPECIAL_TOKENS.index(IM_END), SPECIAL_TOKENS.index(ENDOFTEXT)], "the zoo's stop tokens"


def test_values_files_pass_yamllint():
    config = yamllint_config.YamlLintConfig(
        "{extends: default, rules: {line-length: {max: 120}, document-start: disable}}")
    for path in sorted(CHART.glob("*.yaml")):
        problems = list(linter.run(path.read_text(), config, str(path)))
        assert not problems, f"{path.name}: " + "; ".join(f"{p.line}:{p.column} {p.message}" for p in problems)


def test_service_monitor_scrapes_every_role():
    manifests = rendered("everything")
    monitor = find(manifests, "ServiceMonitor", RELEASE)["spec"]
    scraped = set()
    for service in of_kind(manifests, "Service"):
        if monitor["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items():
            names = {p["name"] for p in service["spec"]["ports"]}
            if names & {e["port"] for e in monitor["endpoints"]}:
                scraped.add(service["metadata"]["labels"]["app.kubernetes.io/component"])
    assert scraped == {"drafter", "verifier", "trainer"}


def test_model_populate_init_container_writes_the_volume_the_service_reads():
    manifests = rendered("everything")
    for role in ROLES:
        pod = deployment(manifests, role)["spec"]["template"]["spec"]
        init = pod["initContainers"][0]
        assert init["command"] == ["specd", "zoo", "build"]
        writable = [m for m in init["volumeMounts"] if m["name"] == "models"]
        assert writable == [{"name": "models", "mountPath": "/models"}], "populate writes the model volume"
        assert {v["name"]: v for v in pod["volumes"]}["models"]["emptyDir"]


# ---------------------------------------------------------------------------- refusing bad values
@pytest.mark.parametrize(("values", "expected"), [
    ({"drafter": {"replicas": -1}}, "/drafter/replicas"),
    ({"verifier": {"replicas": "3"}}, "/verifier/replicas"),
    ({"verifier": {"replicaCount": 3}}, "'replicaCount'"),
    ({"replicas": 3}, "'replicas'"),
    ({"trainer": {"replicas": 2}}, "/trainer/replicas"),
    ({"drafter": {"config": {"max_num_seq": 8}}}, "'max_num_seq'"),
    ({"drafter": {"config": {"model": "/elsewhere"}}}, "'model'"),
    ({"verifier": {"config": {"adaptive_block": "yes"}}}, "/verifier/config/adaptive_block"),
    ({"securityContext": {"runAsUser": 0}}, "/securityContext/runAsUser"),
    ({"redis": {"external": {"url": "http://redis:6379"}}}, "/redis/external/url"),
    ({"drafter": {"autoscaling": {"enabled": True, "minReplicas": 0}}}, "/drafter/autoscaling/minReplicas"),
    ({"models": {"storage": {"type": "s3"}}}, "/models/storage/type"),
    ({"verifier": {"resources": {"limits": {"memory": "lots"}}}}, "/verifier/resources/limits/memory"),
    ({"verifier": {"tensorParallel": 0}}, "/verifier/tensorParallel"),
    ({"verifier": {"tensorParallel": 3}}, "/verifier/tensorParallel"),  # not a power of two
    ({"verifier": {"tensorParallel": 1.5}}, "/verifier/tensorParallel"),
    ({"verifier": {"tensorParallel": "2"}}, "/verifier/tensorParallel"),
    ({"trainer": {"dataParallel": 0}}, "/trainer/dataParallel"),
    ({"trainer": {"dataParallel": 2.5}}, "/trainer/dataParallel"),
    ({"distributed": {"shmSize": "big"}}, "/distributed/shmSize"),
], ids=lambda v: json.dumps(v) if isinstance(v, dict) else None)
def test_schema_refuses_bad_values_naming_the_key(values, expected):
    with helm.Chart.load(CHART) as chart:
        with pytest.raises(helm.HelmValuesError) as error:
            chart.validate_schema(values)
        assert expected in str(error.value), str(error.value)
    with pytest.raises(helm.HelmValuesError):  # an install with them is refused too
        render(values)


@pytest.mark.parametrize(("values", "expected"), [
    ({"config": {"drain_seconds": 60}}, "terminationGracePeriodSeconds"),
    ({"redis": {"internal": {"enabled": False}}}, "no Redis is configured"),
    ({"verifier": {"autoscaling": {"enabled": True, "minReplicas": 4, "maxReplicas": 2}}}, "maxReplicas"),
    ({"models": {"storage": {"type": "image"}, "populate": {"enabled": True, "command": ["true"]}}}, "populate"),
    ({"verifier": {"tensorParallel": 2, "resources": {"limits": {"nvidia.com/gpu": 4}}}}, "verifier.tensorParallel"),
])
def test_render_refuses_inconsistent_values_saying_what_to_change(values, expected):
    with pytest.raises(helm.HelmError) as error:
        render(values)
    assert expected in str(error.value), str(error.value)


# ---------------------------------------------------------------------------- multi-process pods
def _shm(item: dict) -> dict | None:
    """The emptyDir mounted at /dev/shm of a Deployment's container, or None."""
    pod = item["spec"]["template"]["spec"]
    mount = next((m for m in container(item)["volumeMounts"] if m["mountPath"] == "/dev/shm"), None)
    return None if mount is None else {v["name"]: v for v in pod["volumes"]}[mount["name"]]["emptyDir"]


@pytest.mark.parametrize("processes", [1, 2, 4])
def test_a_tensor_parallel_verifier_is_one_pod_of_n_ranks_on_n_gpus(processes):
    manifests = render({"verifier": {"tensorParallel": processes}})
    item = deployment(manifests, "verifier")
    spec, env = container(item), pod_env(manifests, item)
    started = launch(spec)
    assert (started.module, started.processes) == ("services.verifier", processes)
    assert (spec["command"][0] == "torchrun") == (processes > 1)
    assert flags(spec).get("--tensor-parallel") == (str(processes) if processes > 1 else None)
    assert spec["resources"]["limits"]["nvidia.com/gpu"] == processes
    if processes > 1:
        assert _shm(item) == {"medium": "Memory", "sizeLimit": "8Gi"}
        assert started.shutdown_timeout == item["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert env["NCCL_DEBUG"] == "WARN"
    else:
        assert _shm(item) is None and "NCCL_DEBUG" not in env
    # Rank 0 serves: the probes and the Service's ports are those of a one-process verifier.
    assert spec["readinessProbe"]["grpc"] == spec["startupProbe"]["grpc"] == {"port": 50051}
    assert {p["name"]: p["containerPort"] for p in spec["ports"]} == {"grpc": 50051, "http": 8000}
    drafter = container(deployment(manifests, "drafter"))
    assert launch(drafter).processes == 1 and drafter["resources"]["limits"]["nvidia.com/gpu"] == 1


@pytest.mark.parametrize("gpus", [True, False], ids=["gpus", "no-gpus"])
def test_a_data_parallel_trainer_is_one_pod_of_n_ranks(gpus):
    # The default trainer has no GPU entry (it trains on CPUs); one in requests and limits says it uses GPUs.
    given = {"resources": {"requests": {"nvidia.com/gpu": 1}, "limits": {"nvidia.com/gpu": 1}}} if gpus else {}
    manifests = render({"trainer": {"dataParallel": 3, **given}})
    item = deployment(manifests, "trainer")
    spec, started = container(item), launch(container(item))
    assert (started.module, started.processes, flags(spec)["--data-parallel"]) == ("services.trainer", 3, "3")
    assert started.shutdown_timeout == item["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    resources = spec["resources"]
    # Kubernetes needs an extended resource's request equal to its limit.
    assert [resources[k].get("nvidia.com/gpu") for k in ("requests", "limits")] == ([3, 3] if gpus else [None, None])
    assert (resources["requests"]["cpu"], resources["limits"]["memory"]) == ("4", "32Gi")  # the rest as given
    assert _shm(item) == {"medium": "Memory", "sizeLimit": "8Gi"}
    assert "/checkpoints" in {m["mountPath"] for m in spec["volumeMounts"]}


def test_a_multi_process_pod_takes_the_roles_own_shm_size_and_environment_first():
    manifests = render({
        "verifier": {"tensorParallel": 2, "shmSize": "16Gi", "env": [{"name": "NCCL_DEBUG", "value": "INFO"}]},
        "distributed": {"env": {"TORCH_NCCL_ASYNC_ERROR_HANDLING": None, "NCCL_P2P_LEVEL": "NVL"}}})
    item = deployment(manifests, "verifier")
    names = [e["name"] for e in container(item)["env"]]
    assert len(names) == len(set(names)), f"one definition per variable: {names}"
    env = pod_env(manifests, item)
    assert (env["NCCL_DEBUG"], env["NCCL_P2P_LEVEL"]) == ("INFO", "NVL")
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in env  # null removes a default
    assert _shm(item) == {"medium": "Memory", "sizeLimit": "16Gi"}


@pytest.mark.parametrize("role", list(PARALLEL_FIELDS))
def test_a_multi_process_launch_parses_with_the_services_config(role):
    key, field = PARALLEL_FIELDS[role]
    config = _parse(role, render({role: {key: 4}}))
    assert getattr(config, field) == 4
