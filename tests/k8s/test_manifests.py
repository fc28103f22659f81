"""The Kubernetes manifests of k8s/: `kubectl kustomize k8s/` renders them (offline), `kubernetes-validate --strict`
accepts every rendered resource against the pinned Kubernetes version (no unknown kind slips through as a warning),
and they say what docs/DEPLOYMENT.md promises: probes, resources, a locked-down securityContext, a
PodDisruptionBudget, Redis as an LRU cache, and autoscaling on CPU and on vlserve_queue_depth through
prometheus-adapter, whose rule is checked against the adapter's discovery-rule schema."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
KUBERNETES_VERSION = "1.31.0"  # the oldest Kubernetes the manifests are for (docs/DEPLOYMENT.md)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> tuple[Path, list[dict]]:
    """(file, resources) of `kubectl kustomize k8s/`."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl is not installed; `make install` provides it (Debian's kubernetes-client)")
    out = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    path = tmp_path_factory.mktemp("k8s") / "rendered.yaml"
    path.write_text(out.stdout)
    return path, [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def by_kind(resources: list[dict], kind: str, name: str) -> dict:
    (found,) = [r for r in resources if r["kind"] == kind and r["metadata"]["name"] == name]
    return found


def test_every_rendered_resource_passes_strict_validation(rendered):
    path, resources = rendered
    out = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "-k", KUBERNETES_VERSION, str(path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert not [line for line in lines if not line.startswith("INFO")], out.stdout  # a WARN: a kind it has no schema of
    assert len([line for line in lines if " passed " in line]) == len(resources) >= 6, out.stdout


def test_the_kustomization_renders_every_manifest_file(rendered):
    """Every YAML file in k8s/ (the Helm values of prometheus-adapter/ aside) is a resource of the kustomization."""
    _, resources = rendered
    sources = [doc for f in sorted(K8S.glob("*.yaml")) if f.name != "kustomization.yaml"
               for doc in yaml.safe_load_all(f.read_text()) if doc]
    assert sorted((d["kind"], d["metadata"]["name"]) for d in sources) == \
        sorted((r["kind"], r["metadata"]["name"]) for r in resources)


def test_strict_validation_refuses_a_misspelt_field(rendered):
    """The validator is not vacuous: a field Kubernetes does not know fails strict validation."""
    import kubernetes_validate

    deployment = by_kind(rendered[1], "Deployment", "vlserve-api")
    kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)
    broken = yaml.safe_load(yaml.safe_dump(deployment))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def env_of(container: dict) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def test_the_api_deployment(rendered):
    deployment = by_kind(rendered[1], "Deployment", "vlserve-api")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["startupProbe"]["httpGet"]["path"] == "/healthz"
    resources = container["resources"]
    assert {"cpu", "memory"} <= set(resources["requests"]) and "memory" in resources["limits"]
    env = env_of(container)
    assert {"VLSERVE_REDIS_URL", "VLSERVE_SHUTDOWN_DRAIN_S", "VLSERVE_SHUTDOWN_TIMEOUT_S",
            "VLSERVE_DECODE_MAX_PIXELS_IN_FLIGHT", "VLSERVE_API_KEYS"} <= set(env)
    # the drain and the graceful shutdown both fit in the grace period before SIGKILL
    drain, timeout = float(env["VLSERVE_SHUTDOWN_DRAIN_S"]), float(env["VLSERVE_SHUTDOWN_TIMEOUT_S"])
    assert pod["terminationGracePeriodSeconds"] >= drain + timeout + 2  # the process ends within ~1.5 s of the sum
    # the images being decoded at once fit well inside the memory limit (~4 bytes a pixel)
    limit_gib = float(re.fullmatch(r"(\d+)Gi", resources["limits"]["memory"]).group(1))
    assert int(env["VLSERVE_DECODE_MAX_PIXELS_IN_FLIGHT"]) * 4 < limit_gib * 2**30 / 4
    assert pod["enableServiceLinks"] is False  # else a Service named vlserve* would inject VLSERVE_PORT=tcp://...
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"


@pytest.mark.parametrize("name", ["vlserve-api", "vlserve-redis"])
def test_every_container_runs_locked_down(rendered, name):
    pod = by_kind(rendered[1], "Deployment", name)["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    for container in pod["containers"]:
        context = container["securityContext"]
        assert context["readOnlyRootFilesystem"] is True
        assert context["allowPrivilegeEscalation"] is False
        assert context["privileged"] is False and context["capabilities"] == {"drop": ["ALL"]}
        # what must be writable is an emptyDir
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for mount in container.get("volumeMounts", []):
            assert mount.get("readOnly") or "emptyDir" in volumes[mount["name"]], mount


def test_a_disruption_budget_keeps_a_replica_serving(rendered):
    _, resources = rendered
    pdb = by_kind(resources, "PodDisruptionBudget", "vlserve-api")
    labels = by_kind(resources, "Deployment", "vlserve-api")["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    hpa = by_kind(resources, "HorizontalPodAutoscaler", "vlserve-api")
    assert pdb["spec"]["maxUnavailable"] < hpa["spec"]["minReplicas"]


def test_redis_is_an_lru_cache_without_persistence(rendered):
    (container,) = by_kind(rendered[1], "Deployment", "vlserve-redis")["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert args[args.index("--maxmemory-policy") + 1] == "allkeys-lru"
    assert args[args.index("--maxmemory") + 1] and args[args.index("--appendonly") + 1] == "no"


# The discovery rule of prometheus-adapter's configuration (its docs/config.md: seriesQuery, seriesFilters,
# resources, name, metricsQuery), every other key refused.
ADAPTER_RULE = {
    "type": "object", "additionalProperties": False, "required": ["seriesQuery", "metricsQuery"],
    "properties": {
        "seriesQuery": {"type": "string", "minLength": 1},
        "seriesFilters": {"type": "array", "items": {
            "type": "object", "additionalProperties": False,
            "properties": {"is": {"type": "string"}, "isNot": {"type": "string"}}}},
        "resources": {"type": "object", "additionalProperties": False, "properties": {
            "template": {"type": "string"},
            "overrides": {"type": "object", "additionalProperties": {
                "type": "object", "additionalProperties": False, "required": ["resource"],
                "properties": {"group": {"type": "string"}, "resource": {"type": "string"}}}}}},
        "name": {"type": "object", "additionalProperties": False, "required": ["matches"],
                 "properties": {"matches": {"type": "string"}, "as": {"type": "string"}}},
        "metricsQuery": {"type": "string", "minLength": 1},
    },
}
ADAPTER_VALUES = {  # the chart's values this deployment sets
    "type": "object", "additionalProperties": False, "required": ["prometheus", "rules"],
    "properties": {
        "prometheus": {"type": "object", "additionalProperties": False, "required": ["url"],
                       "properties": {"url": {"type": "string", "pattern": "^https?://"}, "port": {"type": "integer"},
                                      "path": {"type": "string"}}},
        "rules": {"type": "object", "additionalProperties": False, "required": ["custom"],
                  "properties": {"default": {"type": "boolean"}, "custom": {"type": "array", "minItems": 1,
                                                                            "items": ADAPTER_RULE}}},
    },
}


def test_autoscaling_on_cpu_queue_depth_and_refusals_through_prometheus_adapter(rendered):
    hpa = by_kind(rendered[1], "HorizontalPodAutoscaler", "vlserve-api")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "vlserve-api"}
    resources = [m["resource"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Resource"]
    assert resources == ["cpu"]
    wanted = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"}
    assert wanted == {"vlserve_queue_depth", "vlserve_refused_per_second"}
    exported = (ROOT / "service" / "metrics.py").read_text()
    assert '"vlserve_queue_depth"' in exported and '"vlserve_requests"' in exported  # the series the rules read

    values = yaml.safe_load((K8S / "prometheus-adapter" / "values.yaml").read_text())
    jsonschema.Draft202012Validator(ADAPTER_VALUES).validate(values)
    exposed = []
    for rule in values["rules"]["custom"]:
        series = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)", rule["seriesQuery"]).group(1)
        template = re.sub(r"\$(\d)", r"\\g<\1>", rule["name"].get("as", "$0"))  # the adapter's $1 is re's \g<1>
        name = re.sub(rule["name"]["matches"], template, series) if re.search(rule["name"]["matches"], series) else None
        exposed.append(name)
        if name in wanted:  # a per-pod metric: the series map to their namespace and pod
            overrides = rule["resources"]["overrides"]
            assert overrides["namespace"]["resource"] == "namespace" and overrides["pod"]["resource"] == "pod"
            for placeholder in ("<<.Series>>", "<<.LabelMatchers>>", "<<.GroupBy>>"):
                assert placeholder in rule["metricsQuery"]
    assert wanted <= set(exposed), exposed
    # the Prometheus counter is exported as <name>_total; the refusals are its 429s
    refused = next(r for r in values["rules"]["custom"] if r["name"].get("as") == "vlserve_refused_per_second")
    assert refused["seriesQuery"].startswith("vlserve_requests_total{") and 'status="429"' in refused["metricsQuery"]


def test_the_deployment_docs_name_the_pinned_version_and_the_adapter():
    docs = (ROOT / "docs" / "DEPLOYMENT.md").read_text()
    section = docs[docs.index("## Kubernetes"):]
    assert f"kubernetes-validate --strict -k {KUBERNETES_VERSION}" in section
    assert "prometheus-adapter" in section and "kubectl apply -k" in section


def test_the_autoscaler_alone_sets_the_replica_count(rendered):
    """`kubectl apply` of a Deployment with `replicas` would undo the HPA's scaling at every deploy."""
    assert "replicas" not in by_kind(rendered[1], "Deployment", "vlserve-api")["spec"]
    assert by_kind(rendered[1], "HorizontalPodAutoscaler", "vlserve-api")["spec"]["minReplicas"] >= 2
