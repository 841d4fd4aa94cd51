"""The `aoti` tier's compile path: per-op units linked with the runtime every op shares
(compiler/_units.py, compiler/_aoti_runtime.py), batches, library calls, and the faults of the shared
files (real g++ builds)."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from neuron_runtime.compiler import CompileRefused, _aoti_runtime, _toolchain, _units
from neuron_runtime.compiler._aoti import LIBRARY_OPS, AotiCompiler, _Job
from neuron_runtime.compiler._package import ArtifactMismatch, read_meta
from neuron_runtime.signatures import _ops, _signature

from aoti_helpers import forged

pytestmark = pytest.mark.aoti


def sig_of(qualname: str, *values: Any) -> dict[str, Any]:
    return _signature.build(_ops.classify(qualname), values)


def test_a_batch_compiles_in_one_unit_and_a_bad_signature_costs_only_itself(aoti_compiler: AotiCompiler) -> None:
    """Five signatures of different kinds in one call: the refused one is refused alone, the library call
    needs no C++, the others are units of one translation unit, each loaded and equal to eager."""
    a, b = torch.randn(6, 8), torch.randn(8)
    xs = [torch.randn(5), torch.randn(3, 4)]
    sigs = [sig_of("aten::mul.Tensor", a, b), sig_of("aten::nonzero", torch.randn(4, 4)),
            sig_of("aten::_softmax", a, 1, False), sig_of("aten::mm", a, torch.randn(8, 3)),
            sig_of("aten::_foreach_add.ScalarList", xs, [0.5, -2.0])]
    results = aoti_compiler.compile_many(sigs)
    assert isinstance(results[1].error, CompileRefused) and "depends on the data" in str(results[1].error)
    assert all(r.error is None for i, r in enumerate(results) if i != 1), [r.error for r in results]
    assert read_meta(results[3].unwrap()).get("kind") == "library" and "cxx" not in results[3].phases
    for i in (0, 2, 4):  # units: compiled by the batch's one g++ run, then linked one by one
        assert {"export", "lowering", "cxx", "link", "self_check"} <= set(results[i].phases), results[i].phases
    mul, softmax, mm, foreach = (aoti_compiler.load(results[i].unwrap()) for i in (0, 2, 3, 4))
    torch.testing.assert_close(mul([a, b], [])[0], a * b)
    torch.testing.assert_close(softmax([a], [])[0], torch.softmax(a, 1))
    m = torch.randn(8, 3)
    torch.testing.assert_close(mm([a, m], [])[0], a @ m)
    got = foreach(xs, [0.5, -2.0])
    torch.testing.assert_close(got[1], xs[1] - 2.0)


def test_a_unit_that_does_not_compile_is_refused_alone(aoti_compiler: AotiCompiler, tmp_path: Path) -> None:
    """The batch's translation unit fails on one unit's code: the compiler's error lines name it, the
    others are compiled again without it and run."""
    jobs = [_Job(sig_of("aten::relu", torch.randn(4, 5))), _Job(sig_of("aten::neg", torch.randn(7))),
            _Job(sig_of("aten::exp", torch.randn(3, 3)))]
    for j in jobs:
        aoti_compiler._lower(j)
        assert j.unit is not None
    jobs[1].unit.body += "\n    this_is_not_cpp;\n"  # type: ignore[union-attr]
    host = aoti_compiler.host_runtime()
    results = host.build([j.unit for j in jobs], tmp_path)  # type: ignore[misc]
    assert isinstance(results[1], _aoti_runtime.BuildError) and "this_is_not_cpp" in str(results[1])
    assert isinstance(results[0], bytes) and isinstance(results[2], bytes)
    so = tmp_path / "relu.so"
    so.write_bytes(results[0])
    runner = torch._C._aoti.AOTIModelContainerRunnerCpu(str(so), 1)
    x = torch.randn(4, 5)
    torch.testing.assert_close(runner.run([x])[0], torch.relu(x))


def test_library_ops_are_what_inductor_lowers_to_a_library_call(aoti_compiler: AotiCompiler) -> None:
    """Each op of LIBRARY_OPS, lowered by Inductor as a lone op, calls a library kernel: its generated
    code holds no loop of its own but layout copies (the table's reason says which)."""
    a = torch.randn(6, 8)
    for qualname, values in [("aten::mm", (a, torch.randn(8, 3))),
                             ("aten::addmm", (torch.randn(3), a, torch.randn(8, 3), 1, 1)),
                             ("aten::bmm", (torch.randn(2, 6, 8), torch.randn(2, 8, 3)))]:
        assert qualname in LIBRARY_OPS
        job = _Job(sig_of(qualname, *values))
        library = LIBRARY_OPS.pop(qualname)
        try:
            aoti_compiler._lower(job)  # lowered as any other op
        finally:
            LIBRARY_OPS[qualname] = library
        assert job.unit is not None and "cpp_fused" not in job.unit.kernels, qualname
        assert "aoti_torch_cpu_" in job.unit.body and "_out(" in job.unit.body, qualname


def test_two_processes_build_the_shared_runtime_once_and_a_bad_file_is_rebuilt(tmp_path: Path) -> None:
    """Two processes start on an empty host at once: one builds the shared files, both use them. Then the
    runtime object is cut in half (a build killed mid-write): the next compile finds it bad by its digest,
    rebuilds that file alone, and what it links is a working executable."""
    runtime = tmp_path / "runtime"  # an empty host: no shared runtime yet
    script = textwrap.dedent(f"""
        import json, sys
        from neuron_runtime.compiler._aoti import AotiCompiler
        c = AotiCompiler(local_cache_dir={str(tmp_path / 'neff')!r}, runtime_dir={str(runtime)!r})
        host = c.host_runtime()
        host.ensure()
        print(json.dumps({{"builds": host.builds, "dir": str(host.dir)}}))
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=900) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-2000:] for _, e in outs]
    answers = [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]
    assert sorted(a["builds"] for a in answers) == [0, 1] and answers[0]["dir"] == answers[1]["dir"]
    shared = Path(answers[0]["dir"])
    record = json.loads((shared / "manifest.json").read_text())  # the build record (its on-disk name)
    assert set(record["rebuilt"]) == set(_aoti_runtime.FILES)

    obj = shared / "runtime.o"
    data = obj.read_bytes()
    obj.write_bytes(data[: len(data) // 2])
    compiler = AotiCompiler(local_cache_dir=str(tmp_path / "neff"), runtime_dir=str(runtime))
    x = torch.randn(9)
    exe = compiler.load(compiler.compile(sig_of("aten::neg", x)))
    torch.testing.assert_close(exe([x], [])[0], -x)
    assert compiler.host_runtime().builds == 1
    assert json.loads((shared / "manifest.json").read_text())["rebuilt"] == ["runtime.o"]
    assert obj.read_bytes() != data[: len(data) // 2] and _aoti_runtime._sha256(obj) == \
        json.loads((shared / "manifest.json").read_text())["sha256"]["runtime.o"]


def test_another_compiler_gets_its_own_shared_files_and_keys(aoti_compiler: AotiCompiler, tmp_path: Path) -> None:
    """A host whose C++ compiler differs: its shared runtime lives in another directory (never this
    compiler's header or object), its fingerprint, hence every key, differs, and an artifact claiming
    the other compiler (or another torch, or format 1) is refused at load."""
    wrapper = tmp_path / "bin" / "g++"
    wrapper.parent.mkdir()
    wrapper.write_text('#!/bin/sh\nexec g++ "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    mine = aoti_compiler.host_runtime()
    pinned = _toolchain.pins(aoti_compiler.march, aoti_compiler.simdlen)
    theirs = _aoti_runtime.HostRuntime(mine.dir.parent, aoti_compiler.scratch().tmp,
                                       {**pinned, "cpp.cxx": (None, str(wrapper))})  # what CXX sets at import
    assert theirs.cxx == str(wrapper) and theirs.dir != mine.dir

    # Another compiler, another torch build, an artifact of format 1: another key (a miss), and the
    # artifact itself, offered anyway (a manifest, a Mega-Cache bundle), is refused naming the field.
    sig = sig_of("aten::neg", torch.randn(5))
    fp = aoti_compiler.fingerprint()
    payload = aoti_compiler.compile(sig)
    for field, value in (("cxx", {"path": str(wrapper), "version": fp["cxx"]["version"]}),
                         ("torch_git", "0" * 40), ("format", 1)):
        other = {**json.loads(json.dumps(fp)), field: value}
        assert _signature.cache_key(sig, other) != _signature.cache_key(sig, fp), field
        with pytest.raises(ArtifactMismatch, match=field):
            aoti_compiler.load(forged(payload, lambda meta: meta.update(fingerprint=other)))  # noqa: B023
    x = torch.randn(5)
    torch.testing.assert_close(aoti_compiler.load(payload)([x], [])[0], -x)  # this host's own still loads


def test_the_rewrite_refuses_generated_code_it_does_not_know() -> None:
    """Generated code of another shape is not guessed at: the op is built by AOTInductor whole."""
    good_wrapper = "#include <torch/csrc/inductor/aoti_include/cpu.h>\n" + _units.interface_text()
    for wrapper, n_constants, why in [("int main() {}", 0, "runtime is not spliced"),
                                      (good_wrapper, 2, "constant"),
                                      (good_wrapper + "\nsome_global_thing;\nnamespace torch::aot_inductor {\n", 0, "top-level line"),
                                      (good_wrapper + "\nnamespace torch::aot_inductor {\n", 0, "constructor")]:
        with pytest.raises(_units.Unsupported, match=why):
            _units.unit(_units.Generated(wrapper, "", None, n_constants))
    with pytest.raises(_units.Unsupported, match="proxy executor"):
        _units.unit(_units.Generated(good_wrapper, "", '{"nodes": []}', 0))
