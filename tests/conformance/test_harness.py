"""The sweep's checker must be able to fail: a wrong value, a result left on the host, an error raised only
on neuron, a fallback, and an in-place variant that does not mutate are each reported, not matched."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from neuron_runtime.aten import _runtime
from neuron_runtime.compiler import CompileRefused
from neuron_runtime.compiler._reference import ReferenceCompiler
from neuron_runtime.conformance import _runner
from neuron_runtime.conformance._check import check_cuda_dtype, check_op, op_key
from neuron_runtime.conformance._runner import coverage_map, markdown, select
from neuron_runtime.signatures import _shapes


@pytest.fixture(scope="module")
def add_op() -> Any:
    return next(op for op in _runner.load_op_db() if op_key(op) == "add")


def _patched(op: Any, fn: Callable[..., Any], inplace: Callable[..., Any] | None = None) -> Any:
    o = copy.copy(op)
    o.op = fn
    o.inplace_variant = inplace
    o.supports_out = False
    return o


def test_real_op_matches(add_op: Any) -> None:
    r = check_op(add_op, k=2)
    assert r.status == "compiled", r
    assert {"forward", "backward", "inplace", "out"} <= set(r.checks)
    assert r.executions > 0


def test_wrong_value_is_a_mismatch(add_op: Any) -> None:
    def wrong(x: torch.Tensor, y: Any, **kw: Any) -> torch.Tensor:
        out = torch.add(x, y, **kw)
        return out + 1e-2 if out.device.type == "neuron" else out

    r = check_op(_patched(add_op, wrong), k=1)
    assert r.status == "mismatch" and "forward" in r.reason


def test_result_on_the_host_is_a_mismatch(add_op: Any) -> None:
    r = check_op(_patched(add_op, lambda x, y, **kw: torch.add(x, y, **kw).cpu()), k=1)
    assert r.status == "mismatch" and "on cpu" in r.reason


def test_error_only_on_neuron_is_an_error(add_op: Any) -> None:
    def fails(x: torch.Tensor, y: Any, **kw: Any) -> torch.Tensor:
        if x.device.type == "neuron":
            raise RuntimeError("boom")
        return torch.add(x, y, **kw)

    r = check_op(_patched(add_op, fails), k=1)
    assert r.status == "error" and "boom" in r.reason


def test_host_run_is_a_fallback(add_op: Any) -> None:
    r = check_op(_patched(add_op, lambda x, y, **kw: torch.add(x, y, **kw) + torch.nonzero(x).sum() * 0), k=1)
    assert r.status == "fallback" and "aten::nonzero" in r.reason


def test_inplace_that_does_not_mutate_is_a_mismatch(add_op: Any) -> None:
    def lazy(x: torch.Tensor, y: Any, **kw: Any) -> torch.Tensor:
        return x.add_(y, **kw) if x.device.type == "cpu" else x

    r = check_op(_patched(add_op, torch.add, inplace=lazy), k=1)
    assert r.status == "mismatch" and "in-place" in r.reason


def test_select_and_markdown() -> None:
    assert select(["add", "addmm", "mul", "fft.fft"], ["add*", "fft.*"]) == ["add", "addmm", "fft.fft"]
    assert select(["a", "b"], None) == ["a", "b"]
    cov = coverage_map("reference", {"add": {"status": "compiled"}, "x": {"status": "mismatch", "reason": "a|b"}},
                       ["y"], 1, 1.0)
    s = cov["summary"]
    assert (s["ops"], s["compiled"], s["mismatch"], s["partial"], s["matched_pct"]) == (2, 1, 1, True, 50.0)
    md = markdown(cov)
    assert "**Partial:**" in md and "a\\|b" in md and "`y`" in md


@pytest.fixture(scope="module")
def histc_op() -> Any:
    return next(op for op in _runner.load_op_db() if op_key(op) == "histc")


def test_cuda_only_dtype_matches_and_can_fail(histc_op: Any) -> None:
    # histc on int32: CUDA's kernel takes it, CPU's does not; the reference is CPU computed wider.
    assert check_cuda_dtype(histc_op, torch.int32, k=1).status == "compiled"

    def off_by_one(x: torch.Tensor, *a: Any, **kw: Any) -> torch.Tensor:
        out = torch.histc(x, *a, **kw)
        return out + 1 if out.device.type == "neuron" else out

    r = check_cuda_dtype(_patched(histc_op, off_by_one), torch.int32, k=1)
    assert r.status == "mismatch" and "int32" in r.reason

    def wrong_dtype(x: torch.Tensor, *a: Any, **kw: Any) -> torch.Tensor:
        out = torch.histc(x, *a, **kw)
        return out.long() if out.device.type == "neuron" else out

    assert check_cuda_dtype(_patched(histc_op, wrong_dtype), torch.int32, k=1).status == "mismatch"


def test_dtype_summary_counts_families() -> None:
    ops = {"a": {"status": "compiled", "dtype": "float32",
                 "dtypes": {"int32": {"status": "compiled"}, "float16": {"status": "mismatch"},
                            "complex32": {"status": "compiled", "cuda_only": True}}},
           "b": {"status": "fallback", "dtype": "int64", "dtypes": {"bool": {"status": "error", "cuda_only": True}}}}
    cov = coverage_map("reference", ops, [], 1, 1.0)
    s = cov["summary"]
    assert s["cuda_only"]["checks"] == 2 and s["cuda_only"]["matched"] == 1
    f = s["families"]
    assert f["integer"]["checks"] == 2 and f["integer"]["matched"] == 2
    assert f["half (float16, bfloat16)"]["mismatch"] == 1 and f["bool"]["error"] == 1
    md = markdown(cov)
    assert "## Per dtype" in md and "## CUDA-only dtypes" in md and "| `b` | bool | error |" in md


class _NoClasses(ReferenceCompiler):
    """The reference tier, refusing every shape class (as `aoti` refuses a class export cannot keep generic)."""

    def fingerprint(self) -> dict[str, Any]:
        return {**super().fingerprint(), "test": "no classes"}

    def compile(self, signature: dict[str, Any]) -> bytes:
        if _shapes.is_class(signature):
            raise CompileRefused(f"{signature['op']}: export with dynamic dims failed (a test refusal)")
        return super().compile(signature)


def test_ops_compiled_per_shape_are_listed_with_the_reason(add_op: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_NEURONX_SHAPES", "generic")
    rt = _runtime.reset_runtime()
    try:
        rt.set_compiler(_NoClasses())
        r = check_op(add_op, k=2, forward_only=True)  # (its first sample is 0-d: no sizes to make symbolic)
        assert r.status == "compiled", r  # per shape, still through executables
        assert r.per_shape == {"aten::add.Tensor": "export with dynamic dims failed (a test refusal)"}
        again = check_op(add_op, k=2, forward_only=True)  # refused classes are remembered: listed once per op
        assert again.status == "compiled" and again.per_shape == {}
    finally:
        monkeypatch.undo()
        _runtime.reset_runtime()
    cov = coverage_map("aoti", {"add": r.as_json(), "mul": {"status": "compiled"}}, [], 1, 1.0)
    assert cov["summary"]["per_shape"] == 1
    md = markdown(cov)
    assert "## Compiled per shape" in md and "| `add` | `aten::add.Tensor` | export with dynamic dims" in md


def test_half_results_that_round_otherwise_are_judged_against_float64_and_wrong_ones_still_fail(
        add_op: Any) -> None:
    """A bfloat16 result that differs from CPU's by more than the direct comparison allows (a compiled
    kernel rounds once where eager rounds between steps) matches when its error from the op computed in
    float64 is at most twice CPU's; a wrong one is still a mismatch, and so is a float32 one."""
    from neuron_runtime.conformance._check import Mismatch, _half_within_fp64_reference, compare

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(1000, generator=g).bfloat16(), torch.randn(1000, generator=g).bfloat16()
    sample = (x, (y,), {})
    expected = torch.add(x, y)
    rounded_otherwise = expected.clone()
    k = int((expected.float().abs() - 0.1).abs().argmin())
    v = float(expected[k])
    ulp = 2.0 ** (math.floor(math.log2(abs(v))) - 7)  # bfloat16 keeps 8 significant bits
    rounded_otherwise[k] = v + 5 * ulp  # one element 5 ulps away: beyond assert_close's bf16 tolerance
    actual = rounded_otherwise.to("neuron")
    with pytest.raises(Mismatch):
        compare(actual, expected, "sample 0 forward")
    assert _half_within_fp64_reference(add_op, sample, 0, actual, expected)
    assert not _half_within_fp64_reference(add_op, sample, 0, (expected * 1.05).to("neuron"), expected)
    xf, yf = x.float(), y.float()
    assert not _half_within_fp64_reference(add_op, (xf, (yf,), {}), 0, (torch.add(xf, yf) + 1e-3).to("neuron"),
                                           torch.add(xf, yf))


def test_update_merges_a_rerun_into_a_sweep(tmp_path: Any) -> None:
    """`--update`: the ops a rerun checked replace theirs in the sweep's file; the summary is recomputed."""
    import json

    old = coverage_map("aoti", {"a": {"status": "mismatch", "reason": "x"}, "b": {"status": "compiled"}},
                       ["c"], 1, 10.0)
    old["summary"]["only_dtypes"] = ["float16"]
    path = tmp_path / "cov.json"
    path.write_text(json.dumps(old))
    rerun = coverage_map("aoti", {"a": {"status": "compiled"}, "c": {"status": "fallback"}}, [], 1, 2.0)
    merged = _runner.merge(str(path), rerun)
    assert {n: r["status"] for n, r in merged["ops"].items()} == {"a": "compiled", "b": "compiled", "c": "fallback"}
    s = merged["summary"]
    assert (s["compiled"], s["fallback"], s["mismatch"], s["partial"]) == (2, 1, 0, False)
    assert s["updated_ops"] == ["a", "c"] and s["only_dtypes"] == ["float16"] and s["seconds"] == 12.0
    with pytest.raises(SystemExit):
        _runner.merge(str(path), coverage_map("reference", {}, [], 1, 1.0))
