"""Many hosts, one store: real OS processes ("hosts", each with its own local tier) against a shared
path and against S3 (moto's server). Compiles are counted from files the compile function writes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _cachetest import (  # type: ignore[import-not-found]
    REPO,
    collect,
    compiles_in,
    key_of,
    release,
    start_workers,
    wait_until,
    worker_env,
)


@pytest.fixture(params=["path", "s3", "redis"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "path":
        return str(tmp_path / "fleet")
    if request.param == "redis":
        return str(request.getfixturevalue("redis_server").url(prefix=f"{tmp_path.name}:"))
    return str(request.getfixturevalue("s3_url"))


def run_hosts(n: int, store: str, keys: list[str], tmp: Path, **spec: Any) -> list[dict[str, Any]]:
    base: dict[str, Any] = {"store": store, "keys": keys, "count_dir": str(tmp / "compiles"), "compile_s": 0.3}
    base.update(spec)
    procs = start_workers(n, base, tmp)
    release(tmp)
    return collect(procs)


def test_hosts_compile_each_key_once_then_a_new_host_compiles_nothing(store: str, tmp_path: Path) -> None:
    keys = [key_of(f"op{i}") for i in range(4)]
    # 6 hosts on a path, 4 on S3 (each S3 host spends ~2 s of CPU building its boto client).
    results = run_hosts(6 if store.startswith("/") else 4, store, keys, tmp_path / "run1")
    assert compiles_in(tmp_path / "run1" / "compiles") == {k: 1 for k in keys}
    assert sum(r["stats"]["compiles"] for r in results) == len(keys)
    assert all(r["stats"]["corrupt"] == 0 and r["stats"]["fleet_errors"] == 0 for r in results)
    assert len({tuple(sorted(r["digests"].items())) for r in results}) == 1
    # The others loaded what one host compiled.
    sources = [s for r in results for s in r["sources"].values()]
    assert sources.count("compiled") == len(keys) and set(sources) <= {"compiled", "fleet"}

    late = run_hosts(1, store, keys, tmp_path / "run2")
    assert compiles_in(tmp_path / "run2" / "compiles") == {}
    assert all(set(r["sources"].values()) == {"fleet"} for r in late)


@pytest.mark.parametrize("server", ["ours", "nginx"])
def test_http_hosts_without_leases_each_end_with_every_entry(server: str, tmp_path: Path,
                                                             request: pytest.FixtureRequest) -> None:
    """The HTTP API has no conditional create, so no fleet lease: hosts racing on cold keys may each
    compile them (never more than once per host), and every host ends with every entry; a late host
    compiles nothing."""
    if server == "ours":
        port = request.getfixturevalue("http_cache").port
        url = f"http://ci:ci-pw@127.0.0.1:{port}/{tmp_path.name}"
    else:
        url = request.getfixturevalue("nginx_dav").url(tmp_path.name)
    keys = [key_of(f"op{i}") for i in range(4)]
    hosts = 4
    results = run_hosts(hosts, url, keys, tmp_path / "run1")
    counts = compiles_in(tmp_path / "run1" / "compiles")
    assert set(counts) == set(keys) and all(1 <= n <= hosts for n in counts.values()), counts
    assert all(r["stats"]["corrupt"] == 0 and r["stats"]["fleet_errors"] == 0 for r in results)
    assert all(set(r["sources"]) == set(keys) for r in results)
    late = run_hosts(1, url, keys, tmp_path / "run2")
    assert compiles_in(tmp_path / "run2" / "compiles") == {}
    assert all(set(r["sources"].values()) == {"fleet"} for r in late)


def test_racing_writers_leave_one_readable_entry(store: str, tmp_path: Path) -> None:
    key = key_of("contested")
    results = run_hosts(3, store, [key], tmp_path, single_flight=False, compile_s=0.0)
    assert sum(compiles_in(tmp_path / "compiles").values()) >= 1
    digests = {r["digests"][key] for r in results}
    assert len(digests) == 1, "hosts see different entries for one key"


def test_sigkilled_lease_holder_is_taken_over_after_the_ttl(store: str, tmp_path: Path) -> None:
    key = key_of("orphan")
    count_dir = tmp_path / "compiles"
    spec = {"store": store, "keys": [key], "count_dir": str(count_dir), "compile_s": 0.2, "lease_ttl_s": 6.0}
    holder = start_workers(1, dict(spec, hang_on=key), tmp_path / "holder")[0]
    release(tmp_path / "holder")
    wait_until(lambda: (count_dir / f"{key}-host0-started").exists())
    holder.send_signal(signal.SIGKILL)  # dies holding the fleet lease, without writing anything
    holder.wait()
    assert holder.returncode == -signal.SIGKILL

    results = run_hosts(3, store, [key], tmp_path / "survivors", compile_s=0.2, lease_ttl_s=6.0,
                        count_dir=str(count_dir))
    started = [f for f in os.listdir(count_dir) if f.endswith("-started")]
    compiled = [f for f in os.listdir(count_dir) if not f.endswith("-started")]
    assert len(started) == 1 and len(compiled) == 1, compiled
    assert sorted(s for r in results for s in r["sources"].values()) == ["compiled", "fleet", "fleet"]


def test_processes_on_one_host_compile_each_key_once(tmp_path: Path) -> None:
    """No fleet store: 4 processes sharing one local tier serialise on the per-key host lock."""
    keys = [key_of(f"h{i}") for i in range(3)]
    results = run_hosts(4, "", keys, tmp_path, same_host=True)
    assert compiles_in(tmp_path / "compiles") == {k: 1 for k in keys}
    sources = [s for r in results for s in r["sources"].values()]
    assert sources.count("compiled") == len(keys) and set(sources) <= {"compiled", "local"}


def test_a_sigkilled_host_lock_holder_blocks_nobody(tmp_path: Path) -> None:
    key = key_of("hostlock")
    count_dir = tmp_path / "compiles"
    spec = {"store": "", "keys": [key], "count_dir": str(count_dir), "compile_s": 0.2, "same_host": True,
            "lock_timeout_s": 600.0}
    holder = start_workers(1, dict(spec, hang_on=key), tmp_path)[0]
    release(tmp_path)
    wait_until(lambda: (count_dir / f"{key}-host0-started").exists())
    holder.send_signal(signal.SIGKILL)  # dies holding the flock; the kernel drops it
    holder.wait()
    results = collect(start_workers(3, spec, tmp_path))  # the start barrier is already open
    compiled = [f for f in os.listdir(count_dir) if not f.endswith("-started")]
    assert len(compiled) == 1
    assert sorted(s for r in results for s in r["sources"].values()) == ["compiled", "local", "local"]


def test_the_cache_layer_is_torch_free() -> None:
    code = (
        "import sys, types; p = types.ModuleType('neuron_runtime'); p.__path__ = ['neuron_runtime'];"
        "sys.modules['neuron_runtime'] = p;"
        "import neuron_runtime.cache.envelope, neuron_runtime.cache, neuron_runtime.cache._tiered;"
        "import neuron_runtime.cache._registry, neuron_runtime.cache._pathstore, neuron_runtime.cache._s3, neuron_runtime.cache._local;"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(REPO), env=worker_env())


_WRITER = """
import sys, types
p = types.ModuleType('neuron_runtime'); p.__path__ = ['neuron_runtime']; sys.modules['neuron_runtime'] = p
from neuron_runtime.cache import envelope
from neuron_runtime.cache import LocalCache, SharedPathStore
kind, where, key = sys.argv[1:4]
store = SharedPathStore(where) if kind == 'path' else LocalCache(where, 1 << 34)
entry = envelope.pack(key, {'signature': {}, 'fingerprint': {}}, b'x' * (96 << 20), None)
print('ready', flush=True)
store.put(key, entry)
print('done', flush=True)
"""


@pytest.mark.parametrize("kind", ["path", "local"])
def test_a_writer_killed_mid_write_leaves_nothing_that_loads(kind: str, tmp_path: Path) -> None:
    from neuron_runtime.cache import envelope
    from neuron_runtime.cache import LocalCache, SharedPathStore

    where = str(tmp_path / kind)
    key = key_of("big")
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, kind, where, key], cwd=str(REPO), env=worker_env(),
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"

    def writing() -> bool:  # some bytes of the entry are on disk, under a temp or value-file name
        return any(f.stat().st_size > 0 for f in Path(where).rglob("*") if f.is_file() and not f.name.startswith("cache.db"))

    wait_until(writing, timeout=60)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    store = SharedPathStore(where) if kind == "path" else LocalCache(where, 1 << 34)
    data = store.get(key)
    # Killed before publishing: no entry. (If the write won the race, the entry it published is whole.)
    if data is not None:
        envelope.unpack(data, expected_key=key, signing_key=None)
    assert [e.key for e in store.entries()] == ([key] if data is not None else [])
