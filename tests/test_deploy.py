"""The deployment files against the server they deploy: the Dockerfile lints clean and
installs with the project's own script (the one CI runs); the manifests parse and name only
probes, ports, environment variables and metrics the server really has."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rope_plugins.native import MARCH_ENV
from server.config import ServerConfig, env_name
from server.provision import CACHE_ENV

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
DOCKERFILE = (ROOT / "Dockerfile").read_text()
KNOWN_ENV = {env_name(name) for name in ServerConfig.model_fields} | {CACHE_ENV, MARCH_ENV}


def load_all(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def manifests() -> dict[str, dict]:
    return {doc["kind"]: doc for path in sorted((DEPLOY / "k8s").glob("*.yaml")) for doc in load_all(path)}


def server_routes() -> set[str]:
    from server.app import create_app

    return {route.path for route in create_app(ServerConfig(), model="unused").routes}


def test_hadolint_passes():
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    result = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    # every ignored rule carries its reason in a comment just above
    for match in re.finditer(r"((?:^#.*\n)*)# hadolint ignore=(\S+)", DOCKERFILE, re.M):
        assert match.group(1).strip(), f"hadolint ignore={match.group(2)} has no explanation"


def test_image_installs_with_the_script_ci_runs():
    assert "RUN ./scripts/install.sh" in DOCKERFILE
    ci = (ROOT / ".ci" / "run").read_text()
    makefile = (ROOT / "Makefile").read_text()
    assert "make test" in ci and re.search(r"^test: install$", makefile, re.M)
    assert re.search(r"^install:\n\t@?\./scripts/install\.sh$", makefile, re.M)


def test_image_shape():
    stages = re.findall(r"^FROM .* AS (\w+)$", DOCKERFILE, re.M)
    assert stages == ["build", "runtime"]
    assert re.search(r"^ARG BASE_IMAGE=", DOCKERFILE, re.M) and "VLLM_FLAVOUR" in DOCKERFILE
    assert re.search(r"^USER 10001$", DOCKERFILE, re.M) and "useradd" in DOCKERFILE
    assert "EXPOSE 8000" in DOCKERFILE and 'VOLUME ["/models"]' in DOCKERFILE
    assert re.search(r"HEALTHCHECK .*\n.*127\.0\.0\.1:8000/health", DOCKERFILE)
    assert "/health" in server_routes() and ServerConfig().port == 8000


def test_every_environment_variable_is_a_real_setting():
    named = set(re.findall(r"\bROPE_EXTEND_[A-Z_]+\b", DOCKERFILE))
    named |= set(re.findall(r"\bROPE_EXTEND_[A-Z_]+\b", (DEPLOY / "compose.yaml").read_text()))
    for path in (DEPLOY / "k8s").glob("*.yaml"):
        named |= set(re.findall(r"\bROPE_EXTEND_[A-Z_]+\b", path.read_text()))
    assert named and named <= KNOWN_ENV, f"not server settings: {sorted(named - KNOWN_ENV)}"
    # and their values are valid for the server
    container = manifests()["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    values = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    from server.config import parse_config

    parse_config([], environ=values)


def test_compose_serves_with_a_model_volume_and_optional_prometheus():
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    server = compose["services"]["server"]
    assert "8000:8000" in server["ports"] and any(v.endswith(":/models") for v in server["volumes"])
    assert "/health" in " ".join(server["healthcheck"]["test"])
    grace = int(server["stop_grace_period"].rstrip("s"))
    assert grace > float(server["environment"]["ROPE_EXTEND_SHUTDOWN_TIMEOUT"])
    assert compose["services"]["prometheus"]["profiles"] == ["monitoring"]
    scrape = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())["scrape_configs"][0]
    assert scrape["metrics_path"] == "/metrics" and "/metrics" in server_routes()
    assert scrape["static_configs"][0]["targets"] == ["server:8000"]


def test_kubernetes_probes_ports_grace_and_secret():
    docs = manifests()
    assert set(docs) == {"Deployment", "Service", "HorizontalPodAutoscaler", "Secret"}
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    port = container["ports"][0]["containerPort"]
    assert port == int(env["ROPE_EXTEND_PORT"]["value"]) == docs["Service"]["spec"]["ports"][0]["port"]
    routes = server_routes()
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] in routes
    assert pod["terminationGracePeriodSeconds"] > float(env["ROPE_EXTEND_SHUTDOWN_TIMEOUT"]["value"])
    secret_ref = env["ROPE_EXTEND_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert secret_ref["name"] == docs["Secret"]["metadata"]["name"] and secret_ref["key"] in docs["Secret"]["stringData"]
    assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"]
    assert pod["securityContext"]["runAsUser"] == 10001


def test_autoscaler_metric_is_one_the_server_exports():
    from server.metrics import Metrics

    metric = manifests()["HorizontalPodAutoscaler"]["spec"]["metrics"][0]["pods"]["metric"]["name"]
    exported = {m.name for m in Metrics().registry.collect()}
    assert metric in exported


@pytest.mark.parametrize("flag", ["--tensor-parallel-size", "--pipeline-parallel-size", "--distributed-executor-backend"])
def test_scaling_flags_documented_in_deploy_readme(flag):
    assert flag in (DEPLOY / "README.md").read_text()
