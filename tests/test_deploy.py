"""deploy/: the Containerfile is linted, every Kustomize overlay is rendered and
every object validated (Kubernetes' schemas of a pinned version, the vendored
KServe and Prometheus-operator CRDs), and the manifests agree with the server:
probe routes answer on a real aserve started from the ConfigMap's config, the
HPA's metric is one it exports, the grace period outlasts the drain.

Nothing here runs a container or a cluster: neither can run on these machines.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import ServerProcess, start_server, write_config
from deploy_helpers import (
    CRDS,
    DEPLOY,
    ROOT,
    SCHEMAS,
    git_blob_sha,
    hadolint,
    instructions,
    load_yaml,
    one,
    render,
    served_config,
    validate,
)

from aserve.config import parse_config

CONTAINERFILE = DEPLOY / "Containerfile"
BASE = DEPLOY / "k8s" / "base"
OVERLAYS = sorted(p.parent for p in (DEPLOY / "k8s" / "overlays").glob("*/kustomization.yaml"))
GRPC_READINESS = DEPLOY / "k8s" / "components" / "grpc-readiness"
KSERVE = DEPLOY / "kserve"
ADAPTER = DEPLOY / "k8s" / "prometheus-adapter" / "values.yaml"
DRAIN_GRACE_DEFAULT_S = 5.0  # drain_grace_s when a config does not set it


def test_overlays_are_cpu_and_gpu() -> None:
    assert [p.name for p in OVERLAYS] == ["cpu", "gpu"]


def with_grpc_readiness(overlay: Path, tmp: Path) -> Path:
    """A kustomization: ``overlay`` plus the grpc-readiness component."""
    folder = tmp / f"{overlay.name}-grpc"
    folder.mkdir()
    (folder / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources: [{os.path.relpath(overlay, folder)}]\n"
        f"components: [{os.path.relpath(GRPC_READINESS, folder)}]\n"
    )
    return folder


def _overlay_id(param: Path | tuple[str, Path]) -> str:
    return f"{param[1].name}+grpc-readiness" if isinstance(param, tuple) else param.name


@pytest.fixture(params=[*OVERLAYS, *[("grpc", o) for o in OVERLAYS]], ids=_overlay_id)
def rendered(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[dict[str, Any], ...]:
    """Each overlay, and each with the grpc-readiness component, rendered."""
    if isinstance(request.param, tuple):
        return render(with_grpc_readiness(request.param[1], tmp_path))
    return render(request.param)


# --- the Containerfile --------------------------------------------------------------


def test_containerfile_passes_hadolint() -> None:
    proc = subprocess.run(
        [hadolint(), "--no-color", str(CONTAINERFILE)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_fails_a_shell_form_entrypoint(tmp_path: Path) -> None:
    """The lint can fail: a shell-form ENTRYPOINT (a shell as PID 1 that does not
    pass SIGTERM on) is flagged."""
    text = CONTAINERFILE.read_text()
    bad = re.sub(r"^ENTRYPOINT .*$", "ENTRYPOINT aserve", text, flags=re.M)
    assert bad != text
    (tmp_path / "Containerfile").write_text(bad)
    proc = subprocess.run(
        [hadolint(), "--no-color", str(tmp_path / "Containerfile")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0 and "DL3025" in proc.stdout, proc.stdout


def test_containerfile_shape() -> None:
    ins = instructions(CONTAINERFILE.read_text())
    args = {rest.split("=")[0]: rest for word, rest in ins if word == "ARG"}
    # The builder names the base image and the torch index: no registry by default.
    assert args["BASE_IMAGE"] == "BASE_IMAGE" and args["TORCH_INDEX_URL"] == "TORCH_INDEX_URL"
    froms = [rest for word, rest in ins if word == "FROM"]
    assert len(froms) == 2 and all(f.startswith("${BASE_IMAGE}") for f in froms), froms
    assert "--from=wheel" in " ".join(rest for word, rest in ins if word == "COPY")
    (user,) = [rest for word, rest in ins if word == "USER"]
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "a numeric non-root user (runAsNonRoot checks it)"
    (entrypoint,) = [rest for word, rest in ins if word == "ENTRYPOINT"]
    assert isinstance(json.loads(entrypoint), list), "exec form"
    env = " ".join(rest for word, rest in ins if word == "ENV")
    assert "ASERVE_CACHE_DIR=/cache" in env
    (volume,) = [rest for word, rest in ins if word == "VOLUME"]
    assert "/cache" in json.loads(volume)
    for word, rest in ins:  # every file copied from the checkout exists
        if word == "COPY" and "--from" not in rest:
            for src in rest.split()[:-1]:
                assert (ROOT / src).exists(), f"COPY {src}: not in the checkout"


def test_container_config_listens_outside_the_container() -> None:
    config = parse_config(json.loads((DEPLOY / "container-config.json").read_text()))
    assert config.http.host == "0.0.0.0" and config.http.port == 8000
    assert config.grpc is not None and config.grpc.host == "0.0.0.0" and config.grpc.port == 8001
    text = CONTAINERFILE.read_text()
    assert "ASERVE_CONFIG=/etc/aserve/config.json" in text
    assert "COPY deploy/container-config.json /etc/aserve/config.json" in text
    assert "EXPOSE 8000 8001" in text


def healthcheck_argv() -> list[str]:
    (hc,) = [
        rest for word, rest in instructions(CONTAINERFILE.read_text()) if word == "HEALTHCHECK"
    ]
    argv = json.loads(hc.split(" CMD ", 1)[1])
    assert argv[0] == "python"
    return [sys.executable, *argv[1:]]


@pytest.mark.parametrize("aserve_config", ["/config/config.json", ""])
def test_entrypoint_execs_aserve(tmp_path: Path, aserve_config: str) -> None:
    """The entrypoint becomes aserve (same PID: it gets the signals) and passes
    --config from ASERVE_CONFIG before the container's arguments."""
    entrypoint = DEPLOY / "entrypoint.sh"
    assert os.access(entrypoint, os.X_OK), "executable in git: the Containerfile COPYs it as is"
    fake = tmp_path / "aserve"
    fake.write_text('#!/bin/sh\necho "$$"; for a in "$@"; do echo "$a"; done\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "ASERVE_CONFIG": aserve_config}
    proc = subprocess.Popen(
        [str(entrypoint), "--port", "9000"], stdout=subprocess.PIPE, text=True, env=env
    )
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    pid, *argv = out.splitlines()
    assert int(pid) == proc.pid, "the entrypoint must exec aserve, not run it as a child"
    want = ["--config", aserve_config] if aserve_config else []
    assert argv == [*want, "--port", "9000"]


# --- a real server with the ConfigMap's config ---------------------------------------


@pytest.fixture(scope="module")
def k8s_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """aserve started from the base's ConfigMap config (deploy/k8s/base/config.json),
    on loopback and free ports instead of 0.0.0.0:8000/8001."""
    config = json.loads((BASE / "config.json").read_text())
    config["http"] = {"host": "127.0.0.1", "port": 0}
    config["grpc"] = {"host": "127.0.0.1", "port": 0}
    folder = tmp_path_factory.mktemp("k8s-config")
    srv = start_server(
        write_config(folder, config), extra_env={"ASERVE_CACHE_DIR": str(folder / "cache")}
    )
    yield srv
    srv.stop()


def test_healthcheck_passes_on_a_ready_server(k8s_server: ServerProcess) -> None:
    env = {**os.environ, "ASERVE_HTTP_PORT": str(k8s_server.port)}
    proc = subprocess.run(healthcheck_argv(), env=env, capture_output=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


def test_healthcheck_fails_where_nothing_serves(unused_port: int) -> None:
    env = {**os.environ, "ASERVE_HTTP_PORT": str(unused_port)}
    proc = subprocess.run(healthcheck_argv(), env=env, capture_output=True, timeout=30)
    assert proc.returncode != 0


@pytest.fixture
def unused_port() -> int:
    import socket

    with socket.socket() as s:  # bound, never listening: a connect is refused
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_probes(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        kind: probe["httpGet"]
        for kind in ("startupProbe", "readinessProbe", "livenessProbe")
        if "httpGet" in (probe := container.get(kind, {}))
    }


def test_probe_routes_answer_on_the_server(k8s_server: ServerProcess, tmp_path: Path) -> None:
    """Every HTTP probe of every manifest (Deployment, ServingRuntimes) gets 200
    from a ready server, and the gRPC readiness probe's service answers SERVING."""
    containers = [one(load_yaml(BASE / "deployment.yaml"), "Deployment")]
    containers = [containers[0]["spec"]["template"]["spec"]["containers"][0]]
    for path in sorted(KSERVE.glob("servingruntime*.yaml")):
        containers += one(load_yaml(path), "ServingRuntime")["spec"]["containers"]
    paths = {g["path"] for c in containers for g in http_probes(c).values()}
    assert paths == {"/v2/health/live", "/v2/health/ready"}
    for path in sorted(paths):
        with urllib.request.urlopen(k8s_server.base + path, timeout=10) as r:
            assert r.status == 200, path

    (patch,) = yaml.safe_load((GRPC_READINESS / "kustomization.yaml").read_text())["patches"]
    (op,) = yaml.safe_load(patch["patch"])
    assert op["path"].endswith("/readinessProbe")
    service = op["value"]["grpc"]["service"]
    assert asyncio.run(grpc_health(k8s_server.grpc_url, service)) == "SERVING"


async def grpc_health(target: str, service: str) -> str:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with grpc.aio.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def test_hpa_metric_is_an_exported_gauge(k8s_server: ServerProcess) -> None:
    """The HPA's metric is what the adapter rule serves, and the rule reads a gauge
    aserve exports, with the model label the HPA selects on."""
    hpa = one(load_yaml(BASE / "hpa.yaml"), "HorizontalPodAutoscaler")
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["target"]["type"] == "AverageValue"
    name = metric["pods"]["metric"]["name"]
    selector = metric["pods"]["metric"]["selector"]["matchLabels"]

    (rule,) = yaml.safe_load(ADAPTER.read_text())["rules"]["custom"]
    assert rule["name"]["as"] == name
    series = re.match(r"^(\w+)\{", rule["seriesQuery"]).group(1)
    assert re.fullmatch(rule["name"]["matches"], series)
    assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}

    with urllib.request.urlopen(k8s_server.base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    assert f"# TYPE {series} gauge" in text, f"{series} is not a gauge aserve exports"
    labels = ",".join(f'{k}="{v}"' for k, v in selector.items())
    assert re.search(rf"^{series}\{{[^}}]*{labels}", text, re.M), f"no {series}{{{labels}}}"


# --- Kubernetes manifests -----------------------------------------------------------------


def test_every_object_validates(rendered: tuple[dict[str, Any], ...]) -> None:
    kinds = sorted(o["kind"] for o in rendered)
    assert kinds == [
        "ConfigMap", "Deployment", "HorizontalPodAutoscaler", "PodDisruptionBudget",
        "Service", "ServiceMonitor",
    ]  # fmt: skip
    problems = {f"{o['kind']}/{o['metadata']['name']}": validate(o) for o in rendered}
    assert not any(problems.values()), problems


def with_base_labels(obj: dict[str, Any]) -> dict[str, Any]:
    """A hand-written base object with the labels and selectors the base's
    kustomization adds (``labels: includeSelectors``), as kustomize would."""
    obj = json.loads(json.dumps(obj))
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    (entry,) = kustomization["labels"]
    assert entry["includeSelectors"]
    pairs = entry["pairs"]
    obj.setdefault("metadata", {}).setdefault("labels", {}).update(pairs)
    spec = obj.get("spec", {})
    if obj["kind"] == "Service":
        spec.setdefault("selector", {}).update(pairs)
    if obj["kind"] in ("Deployment", "PodDisruptionBudget", "ServiceMonitor"):
        spec.setdefault("selector", {}).setdefault("matchLabels", {}).update(pairs)
    if obj["kind"] == "Deployment":
        spec["template"].setdefault("metadata", {}).setdefault("labels", {}).update(pairs)
    return obj


def test_base_files_validate_without_kubectl() -> None:
    """The hand-written YAML is validated even where kubectl is missing."""
    files = sorted(set(BASE.glob("*.yaml")) - {BASE / "kustomization.yaml"})
    assert [f.name for f in files] == sorted(
        yaml.safe_load((BASE / "kustomization.yaml").read_text())["resources"]
    )
    objects = [with_base_labels(o) for f in files for o in load_yaml(f)]
    problems = {f"{o['kind']}/{o['metadata']['name']}": validate(o) for o in objects}
    assert not any(problems.values()), problems


def test_kserve_objects_validate() -> None:
    objects = [o for p in sorted(KSERVE.glob("*.yaml")) for o in load_yaml(p)]
    assert sorted(o["kind"] for o in objects) == [
        "InferenceService", "ServingRuntime", "ServingRuntime"
    ]  # fmt: skip
    problems = {f"{o['kind']}/{o['metadata']['name']}": validate(o) for o in objects}
    assert not any(problems.values()), problems


@pytest.mark.parametrize(
    "kind, mutate",
    [
        ("Deployment", lambda o: o["spec"]["template"]["spec"].update(terminationGracePeriod=45)),
        ("Service", lambda o: o["spec"]["ports"][0].update(port="http")),
        ("ServiceMonitor", lambda o: o["spec"].update(endpoint=o["spec"].pop("endpoints"))),
        ("ServiceMonitor", lambda o: o["spec"]["endpoints"][0].update(interval="15 seconds")),
    ],
)
def test_validation_catches_mistakes(kind: str, mutate: Any) -> None:
    """The validation can fail: a misspelt field or a wrong type is reported."""
    obj = json.loads(json.dumps(one(render(OVERLAYS[0]), kind)))
    mutate(obj)
    assert validate(obj)


def test_kserve_validation_catches_mistakes() -> None:
    runtime = one(load_yaml(KSERVE / "servingruntime.yaml"), "ServingRuntime")
    runtime["spec"]["supportedModelFormat"] = runtime["spec"].pop("supportedModelFormats")
    assert validate(runtime)
    isvc = one(load_yaml(KSERVE / "inferenceservice.yaml"), "InferenceService")
    isvc["spec"]["predictor"]["model"]["storageURI"] = "pvc://x"
    assert validate(isvc)


def test_vendored_crds_are_upstream_files() -> None:
    readme = (SCHEMAS / "README.md").read_text()
    for name, (repo, tag, path, blob) in CRDS.items():
        assert git_blob_sha((SCHEMAS / name).read_bytes()) == blob, f"{name} was modified"
        assert all(s in readme for s in (name, repo, tag, path, blob)), name


def test_probes_and_ports_match_the_config(rendered: tuple[dict[str, Any], ...]) -> None:
    data, mount = served_config(rendered)
    config = parse_config(data)
    assert config.grpc is not None, "the Service and the probes expect a gRPC frontend"
    for host in (config.http.host, config.grpc.host):
        assert not ipaddress.ip_address(host).is_loopback, f"{host}: probes could not reach it"
    pod = one(rendered, "Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": config.http.port, "grpc": config.grpc.port}

    def port_of(ref: int | str) -> int:
        return ports[ref] if isinstance(ref, str) else ref

    for kind, get in http_probes(container).items():
        assert port_of(get["port"]) == config.http.port, kind
    if "grpc" in container["readinessProbe"]:
        assert port_of(container["readinessProbe"]["grpc"]["port"]) == config.grpc.port
    service = one(rendered, "Service")
    targets = {p["name"]: port_of(p["targetPort"]) for p in service["spec"]["ports"]}
    assert targets == {"http": config.http.port, "grpc": config.grpc.port}
    endpoints = one(rendered, "ServiceMonitor")["spec"]["endpoints"]
    assert [(e["port"], e["path"]) for e in endpoints] == [("http", "/metrics")]
    # The config is a directory mount: a subPath mount never sees a ConfigMap update.
    (cfg_mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == mount]
    assert "subPath" not in cfg_mount
    # The HPA scales on a model this config serves.
    selector = one(rendered, "HorizontalPodAutoscaler")["spec"]["metrics"][0]["pods"]["metric"]
    assert selector["selector"]["matchLabels"]["model"] in {m.name for m in config.models}


def drain_s(config: Any) -> float:
    grace = getattr(config, "drain_grace_s", DRAIN_GRACE_DEFAULT_S)
    return grace + config.drain_timeout_s


def test_grace_period_outlasts_the_drain(rendered: tuple[dict[str, Any], ...]) -> None:
    config = parse_config(served_config(rendered)[0])
    grace = one(rendered, "Deployment")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > drain_s(config), f"{grace} s <= drain_grace_s + drain_timeout_s"


def test_gpu_overlay_asks_for_a_gpu() -> None:
    objects = render(DEPLOY / "k8s" / "overlays" / "gpu")
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    resources = pod["containers"][0]["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == "1"
    config = parse_config(served_config(objects)[0])
    assert all(m.device.startswith("cuda") for m in config.models)
    cpu = parse_config(served_config(render(DEPLOY / "k8s" / "overlays" / "cpu"))[0])
    assert all(m.device == "cpu" for m in cpu.models)


# --- KServe -----------------------------------------------------------------------------


def test_kserve_runtime_matches_its_model_config() -> None:
    config = parse_config(json.loads((KSERVE / "model-config.json").read_text()))
    assert config.grpc is not None
    raw = one(load_yaml(KSERVE / "servingruntime.yaml"), "ServingRuntime")["spec"]
    serverless = one(load_yaml(KSERVE / "servingruntime-serverless.yaml"), "ServingRuntime")["spec"]
    isvc = one(load_yaml(KSERVE / "inferenceservice.yaml"), "InferenceService")
    (c_raw,) = raw["containers"]
    (c_sl,) = serverless["containers"]
    # KServe sends HTTP to the first port; RawDeployment exposes the second (gRPC).
    assert [(p["name"], p["containerPort"]) for p in c_raw["ports"]] == [
        ("http1", config.http.port), ("grpc", config.grpc.port)
    ]  # fmt: skip
    assert (config.http.port, config.grpc.port) == (8080, 8081)
    assert [p["containerPort"] for p in c_sl["ports"]] == [8080], "Knative routes one port"
    assert raw["protocolVersions"] == ["v2", "grpc-v2"] and serverless["protocolVersions"] == ["v2"]
    for c in (c_raw, c_sl):
        assert c["args"] == ["--config", "/mnt/models/config.json"]
        for get in http_probes(c).values():
            assert get["port"] == config.http.port
    for m in config.models:  # relative paths: they resolve against /mnt/models
        assert not m.path.startswith("/"), m.path
    formats = {f["name"] for f in raw["supportedModelFormats"]}
    assert {"pytorch", "onnx", "tensorrt"} <= formats
    assert formats == {f["name"] for f in serverless["supportedModelFormats"]}
    model = isvc["spec"]["predictor"]["model"]
    assert (
        model["runtime"]
        == one(load_yaml(KSERVE / "servingruntime.yaml"), "ServingRuntime")["metadata"]["name"]
    )
    assert model["modelFormat"]["name"] in formats
    assert model["protocolVersion"] in raw["protocolVersions"]
    annotations = isvc["metadata"]["annotations"]
    assert annotations["serving.kserve.io/deploymentMode"] in ("RawDeployment", "Standard")
    assert isvc["spec"]["predictor"]["terminationGracePeriodSeconds"] > drain_s(config)
