"""`neuron-cache service [status|stop]`: the host's compile services of this user (docs/background.md)."""

from __future__ import annotations

import argparse
import os
import signal
import time
from typing import Any

from neuron_runtime.cli import _common


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("service", help="show or stop this host's background compile services",
                       description="Each configuration (tier, cache tiers, signing key, ...) has its own compile "
                                   "service, started on demand by the runtime and gone after its idle timeout. "
                                   "`status` lists them with their queues; `stop` sends each SIGTERM (running "
                                   "compiles get 30 s, queued ones are dropped).")
    p.add_argument("action", nargs="?", choices=["status", "stop"], default="status")
    _common.add_json_option(p)
    p.set_defaults(func=cmd_service)


def services() -> list[dict[str, Any]]:
    from neuron_runtime.executables import ask, service_dir

    d = service_dir()
    out = []
    for name in d.names():
        if not name.endswith(".sock"):
            continue
        try:
            hello, status = ask(d.at(name), [{"op": "hello", "pid": os.getpid()}, {"op": "status"}])
        except (OSError, ValueError):
            continue  # a socket left by a service that is gone
        status.pop("op", None)
        # This very connection is one of its clients.
        out.append({"socket": os.path.join(d.path, name), "pid": hello.get("pid"), **status,
                    "clients": status.get("clients", 1) - 1})
    return out


def cmd_service(args: argparse.Namespace) -> int:
    found = services()
    if args.action == "stop":
        for s in found:
            try:
                os.kill(int(s["pid"]), signal.SIGTERM)
                s["stopping"] = True
            except (OSError, TypeError, ValueError):
                s["stopping"] = False
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and any(_alive(s["pid"]) for s in found):
            time.sleep(0.2)
        for s in found:
            s["stopped"] = not _alive(s["pid"])
    if args.json:
        _common.print_json({"services": found})
        return 0
    if not found:
        print("no compile service is running for this user")
    for s in found:
        c = s.get("counts", {})
        state = "" if args.action == "status" else ("  stopped" if s.get("stopped") else "  still running")
        print(f"pid {s['pid']}: {s['workers']} worker(s), {s['queued']} queued, {s['running']} running, "
              f"{s['clients']} client(s); compiled {c.get('compiled', 0)}, present {c.get('present', 0)}, "
              f"refused {c.get('refused', 0)}, failed {c.get('failed', 0)}{state}  ({s['socket']})")
    return 0


def _alive(pid: Any) -> bool:
    try:
        os.kill(int(pid), 0)
        return True
    except (OSError, TypeError, ValueError):
        return False
