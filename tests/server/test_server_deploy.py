"""deploy/ agrees with the CLI: ports, flags, env twins, probe service name, volume path; and the container's
exact command line starts a working server."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from cache_server.__main__ import FLAGS, _build_parser
from cache_server._keys import HEALTH_SERVICE
from tests.conftest import REPO, free_port
from tests.server.conftest import ServerProc, key_of

pytestmark = pytest.mark.timeout(120)

DEPLOY = REPO / "deploy"
TWINS = {f.env for f in FLAGS}


def dockerfile() -> dict[str, Any]:
    text = (DEPLOY / "Dockerfile").read_text()
    logical = re.sub(r"\\\n", " ", text)
    out: dict[str, Any] = {"FROM": [], "text": text}
    for line in logical.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instr, _, rest = line.partition(" ")
        instr = instr.upper()
        if instr == "FROM":
            out["FROM"].append(rest)
        elif instr in ("ENTRYPOINT", "CMD", "VOLUME"):
            out[instr] = json.loads(rest)
        elif instr == "HEALTHCHECK":
            out[instr] = json.loads(rest[rest.index("CMD") + 3:].strip())
        elif instr in ("EXPOSE", "USER"):
            out[instr] = rest.split()
    return out


def argv_flags(argv: list[str]) -> Any:
    """Parse a command line's flags with the server's own parser (fails on any unknown flag)."""
    return _build_parser({}).parse_args(argv)


def port_of(hostport: str) -> int:
    return int(hostport.rpartition(":")[2])


def k8s_docs() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for p in sorted((DEPLOY / "k8s").glob("*.yaml")):
        if p.name == "kustomization.yaml":
            continue
        docs += [d for d in yaml.safe_load_all(p.read_text()) if d]
    return docs


def test_dockerfile_agrees_with_the_cli() -> None:
    d = dockerfile()
    assert len(d["FROM"]) >= 2, "multi-stage"
    assert d["ENTRYPOINT"] == ["python", "-m", "cache_server"]
    ns = argv_flags(d["CMD"])
    assert port_of(ns.listen) == int(d["EXPOSE"][0])
    assert port_of(ns.metrics_listen) == int(d["EXPOSE"][1])
    assert d["VOLUME"] == [ns.storage]
    assert d["USER"][0].split(":")[0] not in ("0", "root")
    assert d["HEALTHCHECK"][:3] == ["python", "-m", "cache_server.probe"]
    assert port_of(d["HEALTHCHECK"][3]) == port_of(ns.listen)
    # No torch in the image: not installed, not copied (only cache_server/ is).
    reqs = (DEPLOY / "requirements-server.txt").read_text()
    def code(text: str) -> str:
        return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#")).lower()

    assert "torch" not in code(reqs) and "torch" not in code(d["text"])
    assert re.findall(r"^COPY (?!--from)(\S+)", d["text"], re.M) == ["deploy/requirements-server.txt", "cache_server"]
    names = {line.split("==")[0] for line in reqs.splitlines() if line and not line.startswith("#")}
    assert {"grpcio", "grpcio-health-checking", "protobuf", "s3fs"} <= names


def test_compose_agrees_with_the_image() -> None:
    d = dockerfile()
    ns = argv_flags(d["CMD"])
    c = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    svc = c["services"]["neff-cache"]
    assert svc["build"]["dockerfile"] == "deploy/Dockerfile"
    published = {int(p.split(":")[1]) for p in svc["ports"]}
    assert published == {port_of(ns.listen), port_of(ns.metrics_listen)}
    assert set(svc["environment"]) <= TWINS
    volume, target = svc["volumes"][0].split(":")
    assert target == ns.storage and volume in c["volumes"]
    assert svc["environment"]["NEURON_CACHE_SERVER_TOKENS_FILE"] == f"/run/secrets/{svc['secrets'][0]}"
    assert svc["healthcheck"]["test"] == ["CMD", *d["HEALTHCHECK"]]
    assert svc["stop_signal"] == "SIGTERM"
    assert int(svc["stop_grace_period"].rstrip("s")) > float(ns.grace)


def test_k8s_agrees_with_the_cli() -> None:
    docs = k8s_docs()
    kinds = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    sts = kinds[("StatefulSet", "neff-cache")]
    pod = sts["spec"]["template"]["spec"]
    (ctr,) = pod["containers"]
    ns = argv_flags(ctr["args"])
    assert set(e["name"] for e in ctr["env"]) <= TWINS
    ports = {p["name"]: p["containerPort"] for p in ctr["ports"]}
    assert ports == {"grpc": port_of(ns.listen), "metrics": port_of(ns.metrics_listen)}
    for probe in ("readinessProbe", "livenessProbe"):
        assert ctr[probe]["grpc"] == {"port": ports["grpc"], "service": HEALTH_SERVICE}
    mounts = {m["name"]: m["mountPath"] for m in ctr["volumeMounts"]}
    assert mounts["data"] == ns.storage == dockerfile()["VOLUME"][0]
    assert [t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]] == ["data"]
    # Tokens: the env twin points into the mounted Secret, at a key the Secret has.
    tokens_path = next(e["value"] for e in ctr["env"] if e["name"] == "NEURON_CACHE_SERVER_TOKENS_FILE")
    assert os.path.dirname(tokens_path) == mounts["tokens"]
    secret_name = next(v["secret"]["secretName"] for v in pod["volumes"] if v["name"] == "tokens")
    secret = kinds[("Secret", secret_name)]
    assert os.path.basename(tokens_path) in secret["stringData"]
    from cache_server.auth import parse_tokens

    parse_tokens(secret["stringData"]["tokens"].splitlines())
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert pod["terminationGracePeriodSeconds"] > float(ns.grace)
    assert sts["spec"]["serviceName"] in {n for k, n in kinds if k == "Service"}
    svc = kinds[("Service", "neff-cache")]
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= set(ports)
    assert {p["port"] for p in svc["spec"]["ports"]} == set(ports.values())
    sel = svc["spec"]["selector"]
    assert sel.items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    kust = yaml.safe_load((DEPLOY / "k8s/kustomization.yaml").read_text())
    assert sorted(kust["resources"]) == sorted(p.name for p in (DEPLOY / "k8s").glob("*.yaml")
                                               if p.name != "kustomization.yaml")


def systemd_unit() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in (DEPLOY / "systemd/neuron-cache-server.service").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", "[")):
            k, _, v = line.partition("=")
            out.setdefault(k, []).append(v)
    return out


def test_systemd_unit_agrees_with_the_cli() -> None:
    u = systemd_unit()
    argv = shlex.split(u["ExecStart"][0])
    assert argv[1:3] == ["-m", "cache_server"]
    ns = argv_flags([a.replace("${CREDENTIALS_DIRECTORY}", "/run/credentials/x") for a in argv[3:]])
    assert ns.storage == "/var/lib/" + u["StateDirectory"][0]
    cred_name = u["LoadCredential"][0].split(":")[0]
    assert ns.tokens_file == f"/run/credentials/x/{cred_name}"
    assert u["DynamicUser"] == ["yes"]
    assert u["KillSignal"] == ["SIGTERM"] and float(u["TimeoutStopSec"][0]) > float(ns.grace)
    assert port_of(ns.listen) == port_of(argv_flags(dockerfile()["CMD"]).listen)


def test_the_container_command_line_runs(tmp_path: Path) -> None:
    """ENTRYPOINT + CMD exactly, with the compose environment, in the image's layout (only cache_server on
    PYTHONPATH). Substituted: the interpreter, and the container's own addresses and volume path (bound to a
    free port and a temp dir here, as the container runtime would map them)."""
    d = dockerfile()
    app = tmp_path / "opt/app"
    shutil.copytree(REPO / "cache_server", app / "cache_server", ignore=shutil.ignore_patterns("__pycache__"))
    store = tmp_path / "volume"
    port, mport = free_port(), free_port()
    cmd = list(d["ENTRYPOINT"] + d["CMD"])
    ns = argv_flags(d["CMD"])
    swap = {ns.listen: f"127.0.0.1:{port}", ns.metrics_listen: f"127.0.0.1:{mport}", ns.storage: str(store),
            "python": sys.executable}
    cmd = [swap.get(a, a) for a in cmd]
    assert [a for a in cmd if a not in swap.values()] == [a for a in d["ENTRYPOINT"] + d["CMD"] if a not in swap]
    svc = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]["neff-cache"]
    tokens = tmp_path / "tokens"
    tokens.write_text("ctr-write write\n")
    env = {k: str(v) for k, v in svc["environment"].items()}
    env["NEURON_CACHE_SERVER_TOKENS_FILE"] = str(tokens)
    base_env = {k: v for k, v in os.environ.items() if not k.startswith(("NEURON_CACHE_SERVER_", "PYTHONPATH"))}
    s = ServerProc(store, port=port, argv=cmd, env={**base_env, **env, "PYTHONPATH": str(app)},
                   log=tmp_path / "ctr.log")
    s.env["PYTHONPATH"] = str(app)  # the image's layout, not the repository
    s.start()
    try:
        c = s.client(token="ctr-write")
        assert c.put(key_of("ctr"), b"hello") and c.get(key_of("ctr")) == b"hello"
        assert c.stats()["max_bytes"] == 50 * 1024**3  # from the compose env twin
        hc = [swap.get(a, a) for a in d["HEALTHCHECK"]]
        hc[-1] = f"127.0.0.1:{port}"
        r = subprocess.run(hc, env={**base_env, "PYTHONPATH": str(app)}, cwd=tmp_path, capture_output=True,
                           text=True, timeout=30)
        assert r.returncode == 0 and r.stdout.strip() == "SERVING", r.stderr
        assert s.terminate() == 0
    finally:
        s.kill()
