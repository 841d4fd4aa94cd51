"""Device-generic test files on neuron and on CPU (`python -m neuron_runtime.conformance.upstream`).

1. The runner must be able to fail: a test that kills the interpreter, one that hangs in Python and one
   that hangs where no signal reaches it, a neuron-only failure, a failure shared with CPU, a file that
   does not import, and the dtype sample, each classified as it is, the rest still reported.
2. The sampled run of `make test`: every wheel suite (op_db error inputs, module_db, optim_db) in float32,
   int64 and bfloat16 on both devices; a neuron-only failure that is not in `KNOWN` (with its cause) fails.
3. PyTorch's own files, when a checkout is given (TORCH_NEURONX_PYTORCH_TESTS): the first three, sampled.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from neuron_runtime.conformance.upstream import KNOWN, UPSTREAM, classify
from neuron_runtime.conformance.upstream._names import dtypes_of, key
from neuron_runtime.conformance.upstream._report import build

REPO = Path(__file__).resolve().parents[2]


def _run(args: list[str], out: Path, timeout: int = 900) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "neuron_runtime.conformance.upstream", *args, "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    print(proc.stderr[-3000:])
    data: dict[str, Any] = json.loads(out.read_text())
    return data


_FAULTS = '''
import os, signal, time, torch
from torch.testing._internal.common_utils import TestCase
from torch.testing._internal.common_device_type import instantiate_device_type_tests, dtypes

ON_NEURON = lambda device: torch.device(device).type != "cpu"

class TestFaults(TestCase):
    def test_crash(self, device):
        if ON_NEURON(device):
            os.abort()
    def test_hang_python(self, device):
        if ON_NEURON(device):
            time.sleep(1000)
    def test_hang_blocked(self, device):
        if ON_NEURON(device):
            signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])  # the worker's timer cannot fire
            time.sleep(1000)
    def test_neuron_only(self, device):
        self.assertEqual(torch.ones(2, device=device).sum().item(), 3 if ON_NEURON(device) else 2)
    def test_shared(self, device):
        raise RuntimeError("fails everywhere")
    @dtypes(torch.float32, torch.int16)
    def test_sampled(self, device, dtype):
        self.assertEqual((torch.ones(3, dtype=dtype, device=device) * 2).sum().item(), 6)
    def test_z_after(self, device):
        pass

instantiate_device_type_tests(TestFaults, globals())
'''


def test_runner_survives_crashes_hangs_and_import_errors(tmp_path: Path) -> None:
    (tmp_path / "dev_faults.py").write_text(textwrap.dedent(_FAULTS))
    (tmp_path / "dev_broken.py").write_text("import torch\nfrom torch.testing._internal import no_such_helper\n")
    rep = _run(["--files", "none", "--file", str(tmp_path / "dev_faults.py"), "--file", str(tmp_path / "dev_broken.py"),
                "--timeout", "3", "--grace", "3"], tmp_path / "faults.json")
    f = rep["files"]["dev_faults.py"]
    t = f["tests"]
    k = "TestFaults{dev}::test_%s_{dev}"
    assert t[k % "crash"]["class"] == "neuron_only" and t[k % "crash"]["neuron"] == "crashed"
    assert "died" in t[k % "crash"]["reason"]
    assert t[k % "hang_python"]["class"] == "neuron_only" and "Timeout" in t[k % "hang_python"]["reason"]
    assert t[k % "hang_blocked"]["neuron"] == "timeout" and "killed" in t[k % "hang_blocked"]["reason"]
    assert t[k % "neuron_only"]["class"] == "neuron_only"
    assert t[k % "shared"]["class"] == "shared" and "fails everywhere" in t[k % "shared"]["reason"]
    # The tests after the crash and the hangs still ran; int16 is not in the sample.
    assert f["counts"]["pass"] == 2, f["counts"]  # test_sampled float32 and test_z_after
    assert not any("int16" in n for n in t) and f["restarts"]["neuron"] >= 2
    assert f["counts"]["neuron_only"] == 4 and f["pass_rate"] == round(100 * 2 / 6, 3)
    b = rep["files"]["dev_broken.py"]
    assert b["status"] == "import_error" and "no_such_helper" in b["import_error"], b
    assert rep["summary"]["import_errors"] == ["dev_broken.py"]
    md = (tmp_path / "faults.md").read_text()
    assert "Files that failed to import" in md and "test_hang_blocked" in md


def test_names_and_classes() -> None:
    assert key("x/test_a.py::TestFooPRIVATEUSE1::test_bar_neuron_float32") == "TestFoo{dev}::test_bar_{dev}_float32"
    assert key("test_a.py::TestFooCPU::test_to_cpu_x_cpu_float8_e4m3fn") == "TestFoo{dev}::test_to_cpu_x_{dev}_float8_e4m3fn"
    assert dtypes_of("test_bar_{dev}_float32_int64") == ["float32", "int64"] and dtypes_of("test_cpu_stuff_cpu") == []
    p, f, s = {"outcome": "passed"}, {"outcome": "failed"}, {"outcome": "skipped"}
    assert [classify(p, p), classify(f, p), classify(f, f), classify(p, f), classify(s, p), classify(s, s),
            classify(None, p)] == ["pass", "neuron_only", "shared", "neuron_better", "skipped_neuron", "skipped",
                                   "one_device"]


@pytest.fixture(scope="module")
def sampled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("upstream") / "sampled.json"
    return _run(["--files", "device_*", "--dtypes", "sample", "--jobs", "2"], out)


def test_sampled_wheel_suites(sampled: dict[str, Any]) -> None:
    s = sampled["summary"]
    assert not s["import_errors"] and s["files"] == 3, s
    unknown = {k: e["reason"] for f in sampled["files"].values() for k, e in f["tests"].items()
               if e["class"] == "neuron_only" and "known" not in e}
    assert not unknown, unknown
    # Our own suites pass on CPU: a CPU failure is a bug in the suite, not something to discount.
    shared = {k: e["reason"] for f in sampled["files"].values() for k, e in f["tests"].items() if e["class"] == "shared"}
    assert not shared, shared
    for name, f in sampled["files"].items():
        assert f["counts"]["pass"] >= {"device_op_errors.py": 200, "device_modules.py": 130,
                                       "device_optims.py": 12}[name], (name, f["counts"])
    assert s["pass_rate"] >= 98.0, s["counts"]
    assert {"float32", "bfloat16", "none"} <= set(s["families"]), s["families"]


def test_known_failures_name_real_tests(sampled: dict[str, Any]) -> None:
    import fnmatch

    ran = [k for f in sampled["files"].values() for k in f["tests"]]
    for pat, why in KNOWN.items():
        assert why.strip()
        if not any(fnmatch.fnmatchcase(k, pat) for k in ran):
            print(f"KNOWN entry no longer failing (delete it): {pat}")


@pytest.mark.skipif(not os.environ.get("TORCH_NEURONX_PYTORCH_TESTS"),
                    reason="PyTorch's own test files need a checkout (TORCH_NEURONX_PYTORCH_TESTS=<pytorch>/test at "
                           "torch.version.git_version); the wheel ships none and this repository vendors none")
def test_sampled_upstream_files(tmp_path: Path) -> None:
    first = list(UPSTREAM)[:3]
    rep = _run(["--files", ",".join(first), "--dtypes", "sample", "--jobs", "2"], tmp_path / "up.json", timeout=1800)
    assert not rep["summary"]["import_errors"], rep["summary"]
    unknown = {k: e["reason"] for f in rep["files"].values() for k, e in f["tests"].items()
               if e["class"] == "neuron_only" and "known" not in e}
    assert not unknown, unknown


def test_report_counts_an_import_error_as_no_pass() -> None:
    from neuron_runtime.conformance.upstream._runner import Task

    n, c = Task(Path("x.py"), "neuron"), Task(Path("x.py"), "cpu")
    n.collect_errors.append("ImportError: x")
    rep = build({"x.py": {"path": "x.py", "kind": "other", "neuron": n, "cpu": c}}, {}, {})
    assert rep["files"]["x.py"]["status"] == "import_error" and rep["summary"]["counts"]["pass"] == 0
    assert rep["summary"]["pass_rate"] is None
