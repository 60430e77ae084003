"""Scaling out, checked offline: the Compose profile ``router`` and the Kubernetes manifests.

The core kinds are validated by kubernetes-validate (the Kubernetes OpenAPI schemas, strict: an
unknown field is an error), the InferencePool by the published CRD's schema kept in
deploy/kubernetes/crds, made strict the same way. Each validator is also shown a broken object.
"""

import copy
import json
import re
from pathlib import Path

import cel
import jsonschema
import kubernetes_validate
import pytest
import yaml

from load_tests.replicas import ROUTER_FLAGS
from tests.test_docker_config import compose, run_compose  # noqa: F401 (fixture)

ROOT = Path(__file__).resolve().parents[1]
KUBE = ROOT / "deploy" / "kubernetes"
CRD = next((KUBE / "crds").glob("inferencepools.inference.networking.k8s.io-*.yaml"))
KUBERNETES_VERSION = "1.33.0"       # the oldest release these manifests must work on (preStop sleep: 1.30)
SHUTDOWN_TIMEOUT = 30.0


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def manifests() -> dict[tuple[str, str], dict]:
    out = {}
    for path in sorted(KUBE.glob("*.yaml")):
        for doc in documents(path):
            out[(doc["kind"], doc["metadata"]["name"])] = doc
    return out


# ----------------------------------------------------------------------------- compose


def router_profile(compose, env=None) -> dict:
    proc = run_compose(compose, "-f", str(ROOT / "docker-compose.yml"), "--profile", "router",
                       "config", "--format", "json", env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)

def test_compose_router_profile(compose):
    services = router_profile(compose)["services"]
    replicas = [services["replica-0"], services["replica-1"]]
    gpus = [r["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] for r in replicas]
    assert gpus == [["0"], ["1"]]
    for r in replicas:
        assert r["profiles"] == ["router"] and r["environment"]["DEVICE"] == "cuda"
        assert "ports" not in r, "replicas are reached through the router"
        assert r["healthcheck"]["test"][0] == "CMD" and any("/health" in part for part in r["healthcheck"]["test"])
    router = services["router"]
    assert router["profiles"] == ["router"]
    assert {name: dep["condition"] for name, dep in router["depends_on"].items()} == {
        "replica-0": "service_healthy", "replica-1": "service_healthy"}
    command = router["command"]
    assert command[:2] == ["sglang-router", "launch"]
    urls = command[command.index("--worker-urls") + 1:command.index("--prometheus-host")]
    assert urls == ["http://replica-0:8000", "http://replica-1:8000"]
    assert command[command.index("--policy") + 1] == "cache_aware"
    joined = " ".join(command)
    assert " ".join(ROUTER_FLAGS) in joined, "the router's flags differ from load_tests.replicas.ROUTER_FLAGS"
    (port,) = router["ports"]
    assert (port["target"], port["published"], port["host_ip"]) == (30000, "30000", "127.0.0.1")
    assert "sglang-router==0.3.2" in router["build"]["dockerfile_inline"]


def test_compose_router_follows_the_environment(compose):
    cfg = router_profile(compose, env={"GPU_ID_0": "2", "GPU_ID_1": "5", "ROUTER_POLICY": "round_robin", "ROUTER_PORT": "31000"})
    services = cfg["services"]
    assert services["replica-0"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == ["2"]
    assert services["replica-1"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == ["5"]
    command = services["router"]["command"]
    assert command[command.index("--policy") + 1] == "round_robin"
    assert services["router"]["ports"][0]["published"] == "31000"


def test_compose_router_profile_is_valid_and_off_by_default(compose):
    proc = run_compose(compose, "-f", str(ROOT / "docker-compose.yml"), "--profile", "router", "config", "--quiet")
    assert proc.returncode == 0, proc.stderr
    proc = run_compose(compose, "-f", str(ROOT / "docker-compose.yml"), "config", "--services")
    assert proc.returncode == 0 and "router" not in proc.stdout.split()


# ----------------------------------------------------------------------------- kubernetes: schemas


@pytest.mark.parametrize("key", [k for k, d in manifests().items() if d["kind"] != "InferencePool"],
                         ids=lambda k: "/".join(k))
def test_core_manifests_are_valid(key):
    kubernetes_validate.validate(manifests()[key], KUBERNETES_VERSION, strict=True)


def test_kubernetes_validate_catches_a_broken_deployment():
    deployment = copy.deepcopy(manifests()[("Deployment", "flashdecode")])
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["pathh"] = "/health"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)
    deployment = copy.deepcopy(manifests()[("Deployment", "flashdecode")])
    deployment["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def strict(schema):
    """The schema with unknown fields refused wherever it lists the known ones (as the API server
    does with strict field validation) and the CRD's own vendor keys dropped."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items() if not k.startswith("x-kubernetes-")}
        if "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


def crd_schema(kind: str, api_version: str) -> dict:
    (crd,) = documents(CRD)
    group, version = api_version.split("/")
    assert crd["spec"]["names"]["kind"] == kind and crd["spec"]["group"] == group
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version and v["served"]]
    return served["schema"]["openAPIV3Schema"]


def check_cel_rules(schema: dict, value, path: str = "") -> None:
    """The schema's x-kubernetes-validations (CEL) rules, evaluated as the API server does: on each
    node, after its defaults are filled in (``value`` is changed in place)."""
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                check_cel_rules(sub, value[name], f"{path}.{name}")
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for name, item in value.items():
                if name not in schema.get("properties", {}):
                    check_cel_rules(extra, item, f"{path}.{name}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            check_cel_rules(schema["items"], item, f"{path}[{i}]")
    for rule in schema.get("x-kubernetes-validations", []):
        if "oldSelf" not in rule["rule"] and cel.evaluate(rule["rule"], {"self": value}) is not True:
            raise jsonschema.ValidationError(f"{path or '.'}: {rule.get('message', rule['rule'])}")


def validate_pool(pool: dict) -> None:
    schema = crd_schema(pool["kind"], pool["apiVersion"])
    jsonschema.validate(pool, strict(schema), cls=jsonschema.Draft7Validator)
    check_cel_rules(schema, copy.deepcopy(pool))


def test_the_crd_has_the_cel_rules_checked_here():
    rules = []

    def collect(node):
        if isinstance(node, dict):
            rules.extend(r["rule"] for r in node.get("x-kubernetes-validations", []))
            for v in node.values():
                collect(v)
        elif isinstance(node, list):
            for v in node:
                collect(v)
    collect(crd_schema("InferencePool", "inference.networking.k8s.io/v1"))
    assert len(rules) >= 2 and not any("oldSelf" in r for r in rules), rules


def test_inference_pool_matches_the_published_crd():
    validate_pool(manifests()[("InferencePool", "flashdecode")])


@pytest.mark.parametrize("breakage", [
    lambda p: p["spec"].pop("selector"),
    lambda p: p["spec"].update(targetPorts=[{"number": 70000}]),
    lambda p: p["spec"].update(targetPorts=[{"number": 8000}, {"number": 8000}]),
    lambda p: p["spec"]["endpointPickerRef"].pop("port"),
    lambda p: p["spec"]["endpointPickerRef"].update(failureMode="Maybe"),
    lambda p: p["spec"].update(modelServers={"matchLabels": {"a": "b"}}),      # an old (v1alpha2) field
])
def test_the_crd_schema_catches_a_broken_pool(breakage):
    pool = copy.deepcopy(manifests()[("InferencePool", "flashdecode")])
    breakage(pool)
    with pytest.raises(jsonschema.ValidationError):
        validate_pool(pool)


# ----------------------------------------------------------------------------- kubernetes: promises


def test_replicas_get_a_gpu_probes_on_health_and_time_to_drain():
    found = manifests()
    deployment = found[("Deployment", "flashdecode")]
    pod = deployment["spec"]["template"]["spec"]
    (server,) = pod["containers"]
    assert server["resources"]["limits"]["nvidia.com/gpu"] == 1
    args = server["args"]
    assert args[args.index("--port") + 1] == "8000" and args[args.index("--host") + 1] == "0.0.0.0"
    timeout = float(args[args.index("--shutdown-timeout") + 1])
    assert timeout == SHUTDOWN_TIMEOUT
    # /health answers 503 while loading, draining or failed: every probe reads it.
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert server[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    startup = server["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, "loading may take minutes"
    readiness = server["readinessProbe"]
    assert readiness["periodSeconds"] * readiness["failureThreshold"] <= 5, "a draining pod must leave quickly"
    liveness = server["livenessProbe"]
    pre_stop = server["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] > pre_stop + timeout, \
        "liveness must not kill a draining replica"
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + timeout + 5
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    labels = pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    service = found[("Service", "flashdecode")]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == server["ports"][0]["name"]
    pool = found[("InferencePool", "flashdecode")]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [server["ports"][0]["containerPort"]]


def test_router_manifest_finds_the_replicas_with_the_tested_flags():
    found = manifests()
    router = found[("Deployment", "flashdecode-router")]
    (container,) = router["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert " ".join(ROUTER_FLAGS) in " ".join(args)
    selector = args[args.index("--selector") + 1:args.index("--service-discovery-port")]
    replica_labels = found[("Deployment", "flashdecode")]["spec"]["template"]["metadata"]["labels"]
    assert dict(s.split("=", 1) for s in selector).items() <= replica_labels.items()
    assert args[args.index("--service-discovery-port") + 1] == "8000"
    # It may watch the pods of its namespace, and nothing else.
    (rule,) = found[("Role", "flashdecode-router")]["rules"]
    assert rule["resources"] == ["pods"] and set(rule["verbs"]) == {"get", "list", "watch"}
    binding = found[("RoleBinding", "flashdecode-router")]
    assert binding["subjects"][0]["name"] == router["spec"]["template"]["spec"]["serviceAccountName"]
    assert re.fullmatch(r"flashdecode-router:\d+\.\d+\.\d+", container["image"])
