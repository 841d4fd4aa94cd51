"""The `aoti` tier against eager CPU: real AOTInductor compiles, shared per session (see conftest)."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from neuron_runtime.aten import _host
from neuron_runtime.compiler import CompileRefused
from neuron_runtime.compiler._aoti import AotiCompiler
from neuron_runtime.compiler._package import META_PATH, ArtifactMismatch, read_meta
from neuron_runtime.compiler._reference import build_call
from neuron_runtime.signatures import _ops, _shapes, _signature

from aoti_helpers import forged

pytestmark = pytest.mark.aoti
REPO = Path(__file__).resolve().parents[2]


def signature_of(qualname: str, *values: Any) -> tuple[_ops.OpInfo, dict[str, Any]]:
    info = _ops.classify(qualname)
    return info, _signature.build(info, values)


class Compiled:
    """One op compiled once per session: its signature, artifact and loaded executable."""

    def __init__(self, compiler: Any, qualname: str, *values: Any) -> None:
        self.info, self.signature = signature_of(qualname, *values)
        self.payload: bytes = compiler.compile(self.signature)
        self.exe = compiler.load(self.payload)


@pytest.fixture(scope="session")
def compiled(device_run: subprocess.Popen[str], aoti_compiler: AotiCompiler) -> Iterator[dict[str, Compiled]]:
    """add (float alpha, a transposed input), mm, a foreach op with a ScalarList, a reduction.

    Asks for `device_run` first so that process compiles while this one does."""
    a = torch.randn(8, 8)
    bt = torch.randn(8, 8).t()  # strides (1, 8): the executable must honour the signature's strides
    xs = [torch.randn(5), torch.randn(3, 4)]
    yield {
        "add": Compiled(aoti_compiler, "aten::add.Tensor", a, bt, 2.5),
        "mm": Compiled(aoti_compiler, "aten::mm", torch.randn(16, 8), torch.randn(8, 4)),
        "foreach": Compiled(aoti_compiler, "aten::_foreach_add.ScalarList", xs, [0.5, -2.0]),
        "sum": Compiled(aoti_compiler, "aten::sum.dim_IntList", torch.randn(6, 10), [1], False, None),
        # an int tensor times a Python float (a wrapped number: `i * 2.5`)
        "wrapped": Compiled(aoti_compiler, "aten::mul.Tensor", torch.arange(6), 2.5),
        # a fused group (neuron_runtime.aten._fusion): relu(x * 2) + alpha * y, one executable
        "graph": CompiledGraph(aoti_compiler, _graph_signature()),
        # a fused group of foreach ops (an optimizer's update): list elements wired one by one
        "foreach_graph": CompiledGraph(aoti_compiler, _foreach_graph_signature()),
        # a shape class (`_shapes`): mm for every [s0,s1] x [s1,s2], compiled from a 6x8 @ 8x5 example
        "mm_class": CompiledGraph(aoti_compiler, _shapes.shape_class(
            signature_of("aten::mm", torch.randn(6, 8), torch.randn(8, 5))[1])),
        # a flat class (the rank-collapse rule): add for every rank and dense layout, from a 4x6 example
        "add_flat": CompiledGraph(aoti_compiler, _shapes.shape_class(
            signature_of("aten::add.Tensor", torch.randn(4, 6), torch.randn(4, 6), 2.5)[1])),
        # a fused group's flat class: relu(x * 2) + alpha * y for every rank and dense layout
        "graph_flat": CompiledGraph(aoti_compiler, _shapes.shape_class(_graph_signature())),
    }


class CompiledGraph:
    def __init__(self, compiler: Any, signature: dict[str, Any]) -> None:
        self.signature = signature
        self.payload: bytes = compiler.compile(signature)
        self.exe = compiler.load(self.payload)


def _graph_signature() -> dict[str, Any]:
    x, y = torch.randn(4, 6), torch.randn(4, 6)
    _, mul = signature_of("aten::mul.Tensor", x, 2)
    _, relu = signature_of("aten::relu", x)
    _, add = signature_of("aten::add.Tensor", x, y, 0.5)
    # External inputs: e0 = x, e1 = the number 2 (a wrapped number), e2 = y; nodes read e* or earlier n*.
    return {"op": "fused:mul+relu+add",
            "graph": [{"sig": mul, "in": [["e", 0], ["e", 1]]}, {"sig": relu, "in": [["n", 0]]},
                      {"sig": add, "in": [["n", 1], ["e", 2]]}],
            "outputs": [2]}


def run_both(c: Compiled, *values: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(executable's outputs, eager outputs) for one call with `values` in schema order."""
    tensors, scalars = _host.flatten(c.info, values)
    got = list(c.exe(tensors, scalars))
    want = list(build_call(c.signature, c.info.op)(tensors, scalars))
    return got, want


def assert_same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert isinstance(got, list) and len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
        assert g.stride() == w.stride()


def test_ops_match_eager(compiled: dict[str, Compiled]) -> None:
    assert_same(*run_both(compiled["add"], torch.randn(8, 8), torch.randn(8, 8).t(), 2.5))
    assert_same(*run_both(compiled["mm"], torch.randn(16, 8), torch.randn(8, 4)))
    assert_same(*run_both(compiled["sum"], torch.randn(6, 10), [1], False, None))
    got, want = run_both(compiled["foreach"], [torch.randn(5), torch.randn(3, 4)], [0.5, -2.0])
    assert [t.shape for t in got] == [torch.Size([5]), torch.Size([3, 4])]  # a Tensor[] comes back flat
    assert_same(got, want)


def test_fused_group_compiles_to_one_executable(compiled: dict[str, Any]) -> None:
    """A graph signature (what fusion hands the compiler) runs as one call; its scalars stay run-time."""
    g = compiled["graph"]
    x, y = torch.randn(4, 6), torch.randn(4, 6)
    for k, alpha in ((2, 0.5), (3, -1.5)):
        (got,) = g.exe([x, k, y], [alpha])
        torch.testing.assert_close(got, torch.relu(x * k) + alpha * y)
    assert read_meta(g.payload)["n_tensors"] == 3


def _foreach_graph_signature() -> dict[str, Any]:
    xs, ys, zs = ([torch.randn(5), torch.randn(3, 4)] for _ in range(3))
    _, mul = signature_of("aten::_foreach_mul.Scalar", xs, 0.9)
    _, addcdiv = signature_of("aten::_foreach_addcdiv.ScalarList", ys, xs, zs, [0.1, 0.2])
    return {"op": "fused:_foreach_mul+_foreach_addcdiv",
            "graph": [{"sig": mul, "in": [["e", 0], ["e", 1]]},
                      {"sig": addcdiv, "in": [["e", 2], ["e", 3], ["n", 0], ["n", 0, 1], ["e", 4], ["e", 5]]}],
            "outputs": [1, [1, 1]], "into": [[0, 0]]}  # x[0] * s is written into input 0 (x[0])


def test_fused_foreach_group_wires_list_elements(compiled: dict[str, Any]) -> None:
    """`_foreach_` nodes (list outputs, element-wise wiring, ScalarList inputs) compile to one call, which
    writes the results listed in `into` into its inputs (after every read of their old values)."""
    g = compiled["foreach_graph"]
    x, y, z = ([torch.randn(5), torch.randn(3, 4)] for _ in range(3))
    z = [t.abs() + 0.5 for t in z]
    for s, cs in ((0.9, [0.1, 0.2]), (-2.0, [3.0, -0.5])):
        x0, x1 = x[0].clone(), x[1].clone()
        got = g.exe([x[0], x[1], y[0], y[1], z[0], z[1]], [s, *cs])
        want = [y[0] + cs[0] * (x0 * s) / z[0], y[1] + cs[1] * (x1 * s) / z[1]]
        assert len(got) == 2
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)
        torch.testing.assert_close(x[0], x0 * s)  # written in place
        torch.testing.assert_close(x[1], x1)  # only read


def test_a_shape_class_compiles_once_for_all_its_shapes(compiled: dict[str, Any]) -> None:
    c = compiled["mm_class"]
    assert read_meta(c.payload)["signature"]["shapes"] == _shapes.CLASS_VERSION
    for m, k, n in ((6, 8, 5), (3, 7, 11), (40, 2, 9), (2, 33, 2)):
        a, b = torch.randn(m, k), torch.randn(k, n)
        (got,) = c.exe([a, b], [])
        torch.testing.assert_close(got, a @ b)


def test_a_flat_class_serves_every_rank_and_dense_layout(compiled: dict[str, Any]) -> None:
    c = compiled["add_flat"]
    assert read_meta(c.payload)["signature"]["flat"] == _shapes.FLAT_VERSION
    for x in (torch.randn(24), torch.randn(4, 6), torch.randn(3, 5, 7), torch.randn(6, 4).t(),
              torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)):
        y = torch.randn_like(x)  # the same strides
        (got,) = c.exe([x, y], [-1.5])
        want = torch.add(x, y, alpha=-1.5)
        torch.testing.assert_close(got, want)
        assert got.shape == want.shape and got.stride() == want.stride()


def test_a_fused_group_s_flat_class_serves_every_rank_and_dense_layout(compiled: dict[str, Any]) -> None:
    c = compiled["graph_flat"]
    assert read_meta(c.payload)["signature"]["flat"] == _shapes.FLAT_VERSION
    for x in (torch.randn(24), torch.randn(3, 5, 7), torch.randn(6, 4).t()):
        y = torch.randn_like(x)
        (got,) = c.exe([x, 2, y], [0.25])
        want = torch.relu(x * 2) + 0.25 * y
        torch.testing.assert_close(got, want)
        assert got.shape == want.shape and got.stride() == want.stride()


def test_a_class_export_cannot_keep_generic_is_refused_with_its_reason(aoti_compiler: AotiCompiler) -> None:
    # view_as_complex needs a last dim of 2. Its class keeps it (the op's meta rejects any other size),
    # but a class that made it symbolic (as the rule of equal sizes did) is refused: export will not narrow it
    cls = _shapes.shape_class(signature_of("aten::view_as_complex", torch.randn(4, 2))[1])
    assert cls is not None and _shapes.describe(cls) == "[s0,2]"
    desc = cls["args"][0][2]
    desc["sizes"], desc["strides"] = ["s0", "s1"], ["s1", 1]
    with pytest.raises(CompileRefused, match="export with dynamic dims failed"):
        aoti_compiler.compile(cls)


def test_a_generic_kernel_that_disagrees_on_a_second_shape_is_refused(aoti_compiler: AotiCompiler,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A class whose kernel came out specialised on its example's sizes (here: exported with no dynamic
    dims, as if Inductor had baked them in) fails the self-check's second shape and is never cached."""
    from neuron_runtime.compiler import _examples

    monkeypatch.setattr(_examples, "dynamic_dims", lambda cls: None)
    cls = _shapes.shape_class(signature_of("aten::neg", torch.randn(3, 5))[1])
    assert cls is not None
    with pytest.raises(CompileRefused, match="output 0 is|fails to run|differs from eager"):
        aoti_compiler.compile(cls)


def test_scalars_are_run_time_inputs(compiled: dict[str, Compiled]) -> None:
    """One executable, new alpha / learning-rate values: no recompile, right answers."""
    a, b = torch.randn(8, 8), torch.randn(8, 8).t()
    for alpha in (2.5, -7.25, 1e-3):
        got, _ = run_both(compiled["add"], a, b, alpha)
        torch.testing.assert_close(got[0], a + alpha * b)
    xs = [torch.randn(5), torch.randn(3, 4)]
    for lrs in ([0.5, -2.0], [1e-4, 3.0]):
        got, _ = run_both(compiled["foreach"], xs, lrs)
        for g, x, lr in zip(got, xs, lrs):
            torch.testing.assert_close(g, x + lr)


def test_wrapped_numbers_keep_eager_type_promotion(compiled: dict[str, Compiled]) -> None:
    """`int_tensor * 2.5` is float32 in eager (not float64), and the number is a run-time input."""
    i = torch.arange(6)
    for v in (2.5, -0.125):
        got, want = run_both(compiled["wrapped"], i, v)
        assert got[0].dtype == want[0].dtype == torch.float32
        torch.testing.assert_close(got[0], i * v)


def test_misaligned_offset_inputs(compiled: dict[str, Compiled]) -> None:
    """Views at odd storage offsets (data pointers not 64-byte aligned) with the signature's strides."""
    buf = torch.randn(200)
    a = buf[1:65].view(8, 8)
    b = buf[67:131].view(8, 8).t()
    assert a.data_ptr() % 64 and b.data_ptr() % 64 and b.stride() == (1, 8)
    assert_same(*run_both(compiled["add"], a, b, 0.75))
    m = torch.randn(300)
    assert_same(*run_both(compiled["mm"], m[3:131].view(16, 8), m[133:165].view(8, 4)))


def test_artifact_is_a_clean_pt2(compiled: dict[str, Compiled], aoti_compiler: AotiCompiler) -> None:
    """A .pt2 zip holding the .so and JSON only: no pickled data, no sources; our metadata inside."""
    with zipfile.ZipFile(io.BytesIO(compiled["add"].payload)) as z:
        names = z.namelist()
    assert any(n.endswith(".so") for n in names)
    assert all(n.endswith((".so", ".json")) or "/." in n or n.rsplit("/", 1)[-1] in
               ("archive_format", "archive_version", "byteorder") for n in names), names
    assert any(n.endswith("/" + META_PATH) for n in names)
    meta = read_meta(compiled["add"].payload)
    assert meta["fingerprint"] == aoti_compiler.fingerprint()
    assert meta["signature"] == compiled["add"].signature and meta["scalar_types"] == ["float"]


def test_fingerprint_pins_the_target(aoti_compiler: AotiCompiler) -> None:
    fp = aoti_compiler.fingerprint()
    assert aoti_compiler.fingerprint() is fp  # computed once per process
    assert fp["tier"] == "aoti" and fp["target"] == {"march": "x86-64-v3", "simdlen": 256, "vec_isa": "avx2"}
    assert fp["pins"]["cpp.march"] == "x86-64-v3" and "native" not in json.dumps(fp)
    assert fp["torch"] == torch.__version__ and fp["torch_git"] and fp["cxx"]["version"]
    for key in ("inductor_config", "machine", "libc", "python"):
        assert fp[key]


def test_fingerprint_mismatch_refuses_to_load(compiled: dict[str, Compiled], aoti_root: Path) -> None:
    payload = compiled["add"].payload
    other_isa = AotiCompiler(march="x86-64-v2", local_cache_dir=str(aoti_root / "neff"))
    with pytest.raises(ArtifactMismatch, match="target"):
        other_isa.load(payload)
    # Same ISA, but the artifact claims another torch build.
    other_torch = forged(payload, lambda meta: meta["fingerprint"].update(torch="2.0.0"))
    mine = AotiCompiler(local_cache_dir=str(aoti_root / "neff"))
    with pytest.raises(ArtifactMismatch, match="torch"):
        mine.load(other_torch)
    with pytest.raises(ArtifactMismatch):
        mine.load(b"not a zip at all")


def test_refuses_what_it_cannot_compile(aoti_compiler: AotiCompiler) -> None:
    _, sig = signature_of("aten::nonzero", torch.randn(4, 4))
    with pytest.raises(CompileRefused, match="depends on the data"):
        aoti_compiler.compile(sig)
    _, sig = signature_of("aten::add.Tensor", torch.randn(4), torch.randn(4), 1j)
    with pytest.raises(CompileRefused, match="complex"):
        aoti_compiler.compile(sig)
    # eps is a schema `float`, not a `Scalar`: the signature keys it by value. Were it keyed by type, it
    # could be neither a run-time input (export rejects a symbolic float there) nor baked in: refused.
    _, sig = signature_of("aten::native_layer_norm", torch.randn(4, 8), [8], torch.randn(8), torch.randn(8), 1e-5)
    assert [a for a in sig["args"] if a[0] == "eps"] == [["eps", "value", 1e-5]]
    sig["args"] = [["eps", "scalar", "float"] if a[0] == "eps" else a for a in sig["args"]]
    with pytest.raises(CompileRefused, match="eps"):
        aoti_compiler.compile(sig)


def test_loads_in_another_process_without_compiling(compiled: dict[str, Compiled], tmp_path: Path,
                                                    aoti_root: Path) -> None:
    """Another process on a host that never compiled (an empty scratch: no shared runtime, no compiler
    needed) loads the bytes and runs them: a unit's .so (the shared runtime linked in) and a library call."""
    (tmp_path / "add.pt2").write_bytes(compiled["add"].payload)
    (tmp_path / "mm.pt2").write_bytes(compiled["mm"].payload)
    other = tmp_path / "other-host"
    script = textwrap.dedent(f"""
        import json, statistics, sys, time
        import torch
        from neuron_runtime.compiler._aoti import AotiCompiler

        def no_compile(self, signatures):
            raise AssertionError("load must never compile")
        AotiCompiler.compile_many = no_compile
        c = AotiCompiler(local_cache_dir={str(other / "neff")!r}, runtime_dir={str(other / "runtime")!r})
        c.fingerprint()
        add = open({str(tmp_path / "add.pt2")!r}, "rb").read()
        mm = open({str(tmp_path / "mm.pt2")!r}, "rb").read()
        times, exes = [], []
        for _ in range(8):
            t0 = time.perf_counter()
            exes.append(c.load(add))
            times.append(time.perf_counter() - t0)
        a, b = torch.randn(8, 8), torch.randn(8, 8).t()
        (out,) = exes[-1]([a, b], [2.5])
        torch.testing.assert_close(out, a + 2.5 * b)
        x, y = torch.randn(16, 8), torch.randn(8, 4)
        (out,) = c.load(mm)([x, y], [])
        torch.testing.assert_close(out, x @ y)
        print(json.dumps({{"load_ms_p50": statistics.median(times) * 1e3}}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["load_ms_p50"] < 1000
    assert not (other / "runtime").exists()  # nothing of the compile path was built there


def test_device_end_to_end(device_run: subprocess.Popen[str]) -> None:
    """TORCH_NEURONX_COMPILER=aoti: an op on `neuron` compiles through this tier and matches CPU."""
    out, err = device_run.communicate(timeout=600)
    assert device_run.returncode == 0, err[-3000:]
    stats = json.loads(out.strip().splitlines()[-1])
    assert stats["compiler"] == "aoti"
    assert stats["compiles"] >= 1 and not stats["fallback_ops"], stats


def test_in_place_foreach_kernel_writes_the_tensors_and_never_runs_on_overlapping_ones(
        device_run: subprocess.Popen[str]) -> None:
    """`_foreach_mul_` on `aoti`: one in-place kernel (no results to copy back), served natively after its
    first call; the same tensor twice, a written tensor read as the other argument, and overlapping views
    of one buffer all equal CPU exactly (those calls run the in-place op on the host)."""
    out, err = device_run.communicate(timeout=600)
    assert device_run.returncode == 0, err[-3000:]
    stats = json.loads(out.strip().splitlines()[-1])
    ip = stats["in_place"]
    assert ip["compiles"] == 1, ip  # the aliasing calls' values are checked in the process itself
    assert not stats["fallback_ops"], stats["fallback_ops"]
    from neuron_runtime._native import _hostmem
    if _hostmem.NATIVE is not None:
        assert ip["native"] >= 2, ip  # calls 3 and 4 (the second one teaches the native table)


def test_writes_overlap_finds_every_shared_byte() -> None:
    """The rule `_inplace.InPlace` and the native layer apply before an in-place kernel runs."""
    from neuron_runtime.compiler._inplace import writes_overlap

    buf = torch.arange(32.0)
    a, b = torch.zeros(4), torch.zeros(4)
    assert not writes_overlap([a, b], [0])
    assert not writes_overlap([a, b, b], [0])              # read twice, written once: fine
    assert writes_overlap([a, a], [0])                      # written and read
    assert writes_overlap([a, b, a], [0, 2])                # written twice
    assert not writes_overlap([buf[:8], buf[8:16]], [0, 1])  # disjoint views of one buffer
    assert writes_overlap([buf[:9], buf[8:16]], [0])        # one shared element
    assert writes_overlap([buf.view(4, 8)[:, 0], buf[9:10]], [1])  # a strided span covers it
    assert not writes_overlap([buf.view(4, 8)[:, 0], torch.zeros(0)], [0, 1])  # empty
    assert not writes_overlap([2.5, a], [1])                # numbers are not memory


def _aoti_child(args: list[str], cache: Path, **env: str) -> tuple[dict[str, Any], str]:
    """A fresh Python process (`args`) on `aoti` with sync compiles over the local cache `cache`, with no
    other TORCH_NEURONX_ setting than `env`: its last stdout line as JSON, and its stderr."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_NEURONX_")}
    full.update(TORCH_NEURONX_COMPILER="aoti", TORCH_NEURONX_COMPILE_MODE="sync",
                TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR=str(cache), **env)
    r = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=full, timeout=900, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


def _fusion_child(case: str, cache: Path) -> dict[str, Any]:
    """tests/aten/fusion_child.py's `case` with fusion on, on `aoti` (sync compiles, groups fused from
    their second sighting, any size), over the local cache `cache`: its JSON report."""
    return _aoti_child([str(REPO / "tests" / "aten" / "fusion_child.py"), case], cache,
                       TORCH_NEURONX_ENABLE_CONCATENATION="1", TORCH_NEURONX_FUSION_MIN_SEEN="2",
                       TORCH_NEURONX_FUSION_MIN_NUMEL="0")[0]


def test_fused_group_runs_natively_end_to_end(aoti_root: Path) -> None:
    """Fusion on `aoti`: a group with a run-time Scalar and an in-place op compiles into one executable,
    which the native queue then runs itself (AOTInductor's runner, the Scalar as a 0-d tensor)."""
    out = _fusion_child("compiled_group", aoti_root / "neff-fusion")
    f = out["stats"]["fusion"]
    assert out["ok"], out["steps_ok"]
    assert f["groups_fused"] == 1 and f["fused_executions"] >= 3, f
    if out["native"] is not None:
        assert out["native"]["fused_executions"] >= 2, out["native"]


def test_a_fused_group_of_another_rank_runs_its_flat_kernel_natively(aoti_root: Path) -> None:
    """The group of `test_fused_group_runs_natively_end_to_end` on 8x8 and 4x4x4 views of the same
    memory: the same flat class (no compile), its in-place result written through the flat views."""
    out = _fusion_child("compiled_group_ranks", aoti_root / "neff-fusion-ranks")
    assert out["ok"], out["steps_ok"]
    assert out["compiles"][1:] == [0, 0], out["compiles"]
    assert out["stats"]["fusion"]["fused_executions"] >= 9, out["stats"]["fusion"]
    if out["native"] is not None:
        assert out["native"]["fused_executions"] >= 6, out["native"]


def test_native_runner_passes_scalars_after_tensors(aoti_root: Path) -> None:
    """`pow.Scalar(Scalar self, Tensor exponent)`: the schema puts a run-time Scalar before the tensor,
    the artifact takes tensors first. The native hit path must call it in the artifact's order (it once
    passed them in schema order: AOTInductor failed on every call and the Python kernel took over)."""
    script = textwrap.dedent("""
        import json, torch, neuron_runtime
        from neuron_runtime._native import _hostmem
        x = torch.rand(8)
        got = [torch.pow(1.5, x.to("neuron")).cpu() for _ in range(4)]
        print(json.dumps({"ok": all(torch.allclose(g, torch.pow(1.5, x)) for g in got),
                          "native": None if _hostmem.NATIVE is None else _hostmem.NATIVE.executions()}))
    """)
    out, err = _aoti_child(["-c", script], aoti_root / "neff-pow")
    assert out["ok"]
    assert "API call failed" not in err, err[-2000:]
    if out["native"] is not None:
        assert out["native"] >= 2  # hits after the first call ran natively


def test_one_executable_runs_from_many_threads_at_once(compiled: dict[str, Compiled], aoti_root: Path) -> None:
    """An executable is entered one thread at a time (fastpath.cpp's `RunLock`, the container's single-
    threaded entry): Python threads calling it at once, and threads whose neuron ops hit it natively while
    others wait, each get their own call's result, and none is left waiting."""
    c = compiled["mm"]
    results: list[bool] = []

    def calls(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for _ in range(200):
            a, b = torch.randn(16, 8, generator=g), torch.randn(8, 4, generator=g)
            results.append(torch.equal(c.exe([a, b], [])[0], torch.mm(a, b)))

    threads = [threading.Thread(target=calls, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and len(results) == 800 and all(results)

    script = textwrap.dedent("""
        import json, threading, torch, neuron_runtime
        from neuron_runtime._native import _hostmem
        w = torch.randn(64, 64)
        wn = w.to("neuron")
        torch.mm(torch.randn(32, 64).to("neuron"), wn).cpu()  # compiled here, once
        ok = []
        def calls(seed):
            g = torch.Generator().manual_seed(seed)
            for _ in range(300):
                x = torch.randn(32, 64, generator=g)
                ok.append(torch.allclose(torch.mm(x.to("neuron"), wn).cpu(), x @ w, atol=1e-5))
        ts = [threading.Thread(target=calls, args=(i,)) for i in range(4)]
        for t in ts: t.start()
        for t in ts: t.join(timeout=300)
        print(json.dumps({"ok": len(ok) == 1200 and all(ok), "alive": any(t.is_alive() for t in ts),
                          "native": None if _hostmem.NATIVE is None else _hostmem.NATIVE.executions()}))
    """)
    out, _ = _aoti_child(["-c", script], aoti_root / "neff-threads")
    assert out["ok"] and not out["alive"], out
    if out["native"] is not None:
        assert out["native"] >= 1000, out  # the threads' hits ran natively, entering the lock together


def test_a_prefill_against_static_caches_of_any_length_runs_one_packed_kernel(aoti_root: Path) -> None:
    """A static KV cache's prefill: attention with a transposed query and the key and value as the first
    rows of a cache `[1, 2, L, 16]`, whose row stride is 16 L. The packed class describes the slices
    contiguous and keeps the query as it is, so every cache length runs one kernel (issue 43). The runners
    copy only the slices: `add` of a transposed tensor and a slice shows it (Inductor's kernel reads the
    transposed input with the strides it was compiled for; attention's kernel is ATen's, which reads any)."""
    shutil.rmtree(aoti_root / "neff-prefill", ignore_errors=True)
    script = textwrap.dedent("""
        import json, torch, neuron_runtime
        from neuron_runtime._native import _hostmem
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        torch.manual_seed(0)
        ok, compiles = [], []

        def call(f, *args):
            c0 = neuron_runtime.stats()["compiles"]
            got = f(*[a.to("neuron") if i == 0 else a for i, a in enumerate(args)])
            compiles.append(neuron_runtime.stats()["compiles"] - c0)
            want = f(*args)
            got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
            ok.append(all(torch.allclose(g.cpu(), w, atol=1e-5) for g, w in zip(got, want)))

        for n in (15, 23, 40, 23):  # a repeated stride runs natively (a new one is a miss of the native key)
            q = torch.randn(1, 8, 4, 16).transpose(1, 2)  # [1, 4, 8, 16], strides [512, 16, 64, 1]
            cache = torch.randn(2, 1, 2, n, 16)
            call(lambda c, q: op(q.to(c.device), c[0, :, :, :8], c[1, :, :, :8], is_causal=True, scale=0.25),
                 cache, q)
        for n in (20, 27, 27):
            a, b = torch.randn(8, 4).t(), torch.randn(4, n)
            call(lambda b, a: torch.add(a.to(b.device), b[:, :8]), b, a)
        print(json.dumps({"ok": ok, "compiles": compiles,
                          "native": None if _hostmem.NATIVE is None else _hostmem.NATIVE.executions()}))
    """)
    out, _ = _aoti_child(["-c", script], aoti_root / "neff-prefill")
    assert all(out["ok"]), out
    assert out["compiles"] == [1, 0, 0, 0, 1, 0, 0], out
    if out["native"] is not None:
        assert out["native"] >= 2, out


def test_packed_slices_are_copied_natively_equal_to_cpu_for_every_element_size(aoti_root: Path) -> None:
    """The native runner copies a packed class's slices itself (`packed_copy`, element by element by size:
    `contiguous()` through the dispatcher cost a decode token ~10 us): rotary's halves and 3-D slices with
    a step, of 1-, 2-, 4- and 8-byte dtypes, equal CPU's on native hits."""
    shutil.rmtree(aoti_root / "neff-packed-copy", ignore_errors=True)
    script = textwrap.dedent("""
        import json, torch, neuron_runtime
        from neuron_runtime._native import _hostmem
        torch.manual_seed(0)
        halves = lambda t: torch.cat((t[..., 8:], t[..., :8]), dim=-1)
        steps = lambda t: torch.cat((t[:, 1:4, 0:6:2], t[:, 0:2, 1::2]), dim=1)
        ok, e0 = [], _hostmem.NATIVE.executions() if _hostmem.NATIVE is not None else None
        for dtype in (torch.bool, torch.float16, torch.float32, torch.int64):
            for f, shape in ((halves, (1, 4, 1, 16)), (steps, (3, 5, 7))):
                x = (torch.randn(shape) * 10).to(dtype)
                n = x.to("neuron")
                ok += [torch.equal(f(n).cpu(), f(x)) for _ in range(3)]
        print(json.dumps({"ok": ok, "native": None if e0 is None else _hostmem.NATIVE.executions() - e0}))
    """)
    out, _ = _aoti_child(["-c", script], aoti_root / "neff-packed-copy")
    assert all(out["ok"]) and len(out["ok"]) == 24, out
    if out["native"] is not None:
        assert out["native"] >= 8, out  # the second and third call of each case ran natively


def test_flat_kernels_run_natively_on_views_of_every_rank_and_dense_layout(aoti_root: Path) -> None:
    """A flat class's kernel is called natively on 1-D views of its inputs and its outputs viewed back
    (CPU's `as_strided` kernel called directly, `AotiCall::flat`): results, sizes and strides equal CPU's
    for ranks 2-4, contiguous and permuted."""
    shutil.rmtree(aoti_root / "neff-flat-views", ignore_errors=True)
    script = textwrap.dedent("""
        import json, torch, neuron_runtime
        from neuron_runtime._native import _hostmem
        torch.manual_seed(0)
        ok, e0 = [], _hostmem.NATIVE.executions() if _hostmem.NATIVE is not None else None
        for shape, perm in (((2, 3, 4), None), ((2, 3, 4), (2, 0, 1)), ((1, 4, 1, 16), None), ((5, 7), (1, 0))):
            x, y = torch.randn(shape), torch.randn(shape)
            if perm:
                x, y = x.permute(perm), y.permute(perm)
            nx, ny = x.to("neuron"), y.to("neuron")
            for _ in range(3):
                for f in (lambda a, b: a * b + 1, lambda a, b: torch.sigmoid(a) - b):
                    got, want = f(nx, ny), f(x, y)
                    ok.append(torch.allclose(got.cpu(), want) and got.stride() == want.stride())
        print(json.dumps({"ok": ok, "native": None if e0 is None else _hostmem.NATIVE.executions() - e0}))
    """)
    out, _ = _aoti_child(["-c", script], aoti_root / "neff-flat-views")
    assert all(out["ok"]) and len(out["ok"]) == 24, out
    if out["native"] is not None:
        assert out["native"] >= 16, out


def test_a_caller_that_makes_warnings_errors_still_compiles(aoti_root: Path) -> None:
    """Inductor warns (FutureWarning, DeprecationWarning) while it lowers: a program that turns those into
    errors got a refusal instead of an executable, and the cache kept it. The compile records them whatever
    the caller's filters say."""
    shutil.rmtree(aoti_root / "neff-werror", ignore_errors=True)
    script = textwrap.dedent("""
        import json, warnings, torch, neuron_runtime
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        x = torch.rand(8, 3)
        ok = torch.allclose((x.to("neuron") * 3 + 1).cpu(), x * 3 + 1)
        print(json.dumps({"ok": ok, "fallback_ops": neuron_runtime.stats()["fallback_ops"]}))
    """)
    out, _ = _aoti_child(["-c", script], aoti_root / "neff-werror")
    assert out == {"ok": True, "fallback_ops": []}, out
