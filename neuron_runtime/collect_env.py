"""`python -m neuron_runtime.collect_env`: what to paste into a bug report.

Versions, the device's registration state, the compiler fingerprint and the cache configuration."""

from __future__ import annotations

import json
import os
import platform
import sys
from typing import Any


def collect() -> dict[str, Any]:
    import torch

    import neuron_runtime
    from neuron_runtime import _config, _native
    from neuron_runtime.aten import runtime
    from neuron_runtime.device import DEVICE

    cfg = _config.get()
    info: dict[str, Any] = {
        "neuron_runtime": neuron_runtime.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "torch_git": getattr(torch.version, "git_version", None),
        "device": {
            "privateuse1_backend": torch._C._get_privateuse1_backend_name(),
            "registered": hasattr(torch, DEVICE),
            "available": bool(getattr(torch, DEVICE).is_available()) if hasattr(torch, DEVICE) else False,
            "accelerator": str(torch.accelerator.current_accelerator()),
            "autoload": os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "1"),
            "native_hit_path": _native.status(),
        },
        "config": {k: ("<set>" if k == "signing_key" and v else v) for k, v in vars(cfg).items()
                   if k not in ("cache_token",)},
        "environment": {k: ("<set>" if "KEY" in k or "TOKEN" in k else v)
                        for k, v in sorted(os.environ.items()) if k.startswith("TORCH_NEURONX_")},
    }
    try:
        info["compiler"] = runtime().fingerprint
    except Exception as e:  # noqa: BLE001 - report, don't fail: this is for bug reports
        info["compiler"] = f"unavailable: {type(e).__name__}: {e}"
    return info


def main() -> int:
    from neuron_runtime import _config

    info = collect()
    if "--json" in sys.argv:
        print(json.dumps(info, indent=2, default=str))
        return 0
    for key, value in info.items():
        if isinstance(value, dict):
            print(f"{key}:")
            for k, v in value.items():
                print(f"  {k}: {v}")
        else:
            print(f"{key}: {value}")
    print("environment variables read (see README):")
    for name in _config._VARS:
        print(f"  {name}={os.environ.get(name, '')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
