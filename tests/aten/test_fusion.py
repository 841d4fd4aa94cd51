"""Experimental fusion (TORCH_NEURONX_ENABLE_CONCATENATION=1), each scenario in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CHILD = Path(__file__).with_name("fusion_child.py")


def run(scenario: str, tmp_path: Path, fusion: bool = True, **env: str) -> dict:  # type: ignore[type-arg]
    full = dict(os.environ, TORCH_NEURONX_COMPILER="reference", TORCH_NEURONX_FUSION_MIN_SEEN="2",
                TORCH_NEURONX_FUSION_MIN_NUMEL="0",  # the tests' tensors are small: queue them anyway
                TORCH_NEURONX_ENABLE_CONCATENATION="1" if fusion else "0",
                TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR=str(tmp_path / "cache"))
    full.update(env)
    r = subprocess.run([sys.executable, str(CHILD), scenario], capture_output=True, text=True, env=full,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_fused_training_matches_unfused_step_by_step(tmp_path: Path) -> None:
    fused = run("train", tmp_path / "on")
    plain = run("train", tmp_path / "off", fusion=False)
    assert fused["losses"] == pytest.approx(plain["losses"], rel=1e-6)
    for a, b in zip(fused["params"], plain["params"]):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-7)
    f = fused["stats"]["fusion"]
    assert f["fused_executions"] > 0 and f["ops_fused"] > f["fused_executions"]
    assert "fusion" not in plain["stats"]


def test_every_flush_trigger(tmp_path: Path) -> None:
    out = run("triggers", tmp_path)
    r = out["reasons"]
    assert out["ok"]
    assert r["item"] == "op:aten::_local_scalar_dense"  # the reduction joins the region; the host read ends it
    assert r["cpu"] == "op:aten::_to_copy"
    assert r["print"].startswith("op:")
    assert r["bool"].startswith("op:")
    assert r["view"] == "none"  # views of queued results and their reads join the region
    assert r["inplace"] == "none"
    assert r["matmul"] == "none"
    assert r["non_fusible"] == "op:aten::nonzero"
    assert r["grad_mode"] == "grad_or_autocast"
    assert r["reads_pending"] == "reads_pending_memory"
    assert r["synchronize"] == "synchronize"
    assert r["clone"] == "op:aten::clone"


@pytest.mark.parametrize("native", ["1", "0"], ids=["native_queue", "python_queue"])
def test_in_place_ops_are_queued_in_stream_order(tmp_path: Path, native: str) -> None:
    out = run("inplace", tmp_path, TORCH_NEURONX_NATIVE=native)
    f = out["stats"]["fusion"]
    assert out["ok"], out["steps_ok"]
    assert f["fused_executions"] >= 2 and f["groups_fused"] >= 1
    if native == "1" and out["native"] is not None:  # the native queue queued and ran the fused group
        assert out["native"]["ops_buffered"] > 0 and out["native"]["fused_executions"] >= 1
    # the updates of `a`, `w`, `y` and `s` were queued, not flushes
    assert not any(k.startswith("op:aten::mul_") or k.startswith("op:aten::_foreach") for k in f["flushes"]), f


@pytest.mark.parametrize("native", ["1", "0"], ids=["native_queue", "python_queue"])
def test_queued_op_reads_its_inputs_as_they_were_when_queued(tmp_path: Path, native: str) -> None:
    out = run("data_swap", tmp_path, TORCH_NEURONX_NATIVE=native)
    assert out["ok"], out["steps_ok"]
    assert out["stats"]["fusion"]["ops_buffered"] > 0


@pytest.mark.parametrize("native", ["1", "0"], ids=["native_queue", "python_queue"])
def test_fused_group_writes_in_place_results_into_its_inputs(tmp_path: Path, native: str) -> None:
    out = run("into", tmp_path, TORCH_NEURONX_NATIVE=native)
    assert out["ok"], out["steps_ok"]
    [group] = out["groups"]
    # a (input 0) is written in place by the executable; u shares base's memory, which the group also
    # reads: its result is returned and copied, never written into an input that aliases another
    assert [e for _, e in group["into"]] == [0], group
    assert group["op"].split("+")[-1] == "mul_.Tensor", group  # the update of u: the group's last op
    assert group["op"].count("+") in group["outputs"], group
    if native == "1" and out["native"] is not None:  # the native queue ran it itself, by the same rule
        assert out["native"]["fused_executions"] >= 2, out["native"]


def test_views_of_other_memory_do_not_flush(tmp_path: Path) -> None:
    out = run("views_elsewhere", tmp_path)
    if out["native"] is None:
        pytest.skip("the native layer is not loaded: views flush (it tracks what queued ops write)")
    f = out["stats"]["fusion"]
    assert out["ok"]
    assert not any(k.startswith("op:aten::t") or k.startswith("op:aten::as_strided") or
                   k.startswith("op:aten::view") for k in f["flushes"]), f["flushes"]
    assert f["fused_executions"] >= 1


def test_a_region_holds_matmuls_reductions_and_views_of_its_results(tmp_path: Path) -> None:
    out = run("region", tmp_path)
    if out["native"] is None:
        pytest.skip("the native layer is not loaded: views flush (it tracks what queued ops write)")
    f = out["stats"]["fusion"]
    assert out["ok"], out["steps_ok"]
    # only the host reads (`.cpu()`, as `_to_copy`) end the region: its 6 ops (mul, mm, softmax, sum, mean,
    # add; views are metadata) ran fused once hot
    assert set(f["flushes"]) == {"op:aten::_to_copy"}, f["flushes"]
    assert f["fused_executions"] >= 2 and f["ops_fused"] == 6 * f["fused_executions"], f


def test_a_group_slower_fused_than_op_by_op_runs_op_by_op() -> None:
    """The measured decision (`Fusion._decide`): after its timed trial runs, a group stays fused only if
    its fastest warm fused run (the first is its cold start) is not over 10 % slower than its fastest
    op-by-op run; an op whose every group runs op by op is no longer queued."""
    from neuron_runtime import _config
    from neuron_runtime.aten import _fusion

    class Runtime:
        cfg = _config.Config()

    f = _fusion.Fusion(Runtime())
    mul, add, sub = ("aten::mul.Tensor", 1), ("aten::add.Tensor", 2), ("aten::sub.Tensor", 3)
    fast, slow = (mul + ((),), sub + ((),)), (mul + ((),), add + ((),))  # (op, key, wiring) per node
    f.groups_of = {mul: {fast, slow}, add: {slow}, sub: {fast}}
    f.each_s = {fast: [1.5, 1.0, 1.2], slow: [1.5, 1.0, 1.2]}
    exe = object()
    # the cold first run is not compared; 1.05 is within the margin of the fastest op-by-op run (1.0)
    assert [f._decide(fast, exe, s) for s in (9.0, 1.3, 1.05)] == [None, None, exe]
    assert f._decide(fast, exe, 5.0) is exe  # decided: later runs are not timed
    assert [f._decide(slow, exe, s) for s in (0.5, 1.3, 1.2)] == [None, None, None]
    assert f.fused[slow] is _fusion.UNFUSIBLE and f.stats["groups_slower_fused"] == 1
    # add was only ever in the slow group: no longer queued; mul still fuses in the fast one
    assert f.solo == {add} and f.stats["ops_unqueued"] == 1


def test_a_group_decided_op_by_op_runs_op_by_op_in_the_native_queue(tmp_path: Path) -> None:
    """A group measured slower fused (here: every group) is run op by op from then on; with the native
    layer its queue runs it so itself (`run_each`: no Python call per group), reading queued results,
    views of them and in-place updates as in stream order."""
    out = run("demoted", tmp_path)
    assert out["ok"], out["steps_ok"]
    f = out["stats"]["fusion"]
    assert f["groups_slower_fused"] >= 2, f
    if out["native"] is not None:
        assert out["native"]["ops_run_each"] > 0 and out["native"]["fused_executions"] == 0, out["native"]


def test_the_ops_of_groups_decided_op_by_op_are_no_longer_queued(tmp_path: Path) -> None:
    """Once every group an op was in runs op by op for good, the op runs as it would without fusion (a
    queued op costs about its launch, and a group run op by op would pay both); results stay CPU's."""
    out = run("unqueued", tmp_path)
    assert out["ok"], out["steps_ok"]
    assert out["stats"]["fusion"]["ops_unqueued"] > 0, out["stats"]["fusion"]
    assert out["buffered_after"] == 0, out


@pytest.mark.aoti
def test_a_hot_group_runs_op_by_op_natively_while_its_executable_compiles(tmp_path: Path) -> None:
    """Background compiles: a group hot enough to fuse whose executable is still compiling runs op by op
    in the native queue (not through Python's flush), which hands it back to Python every 50 ms
    until the executable is there; then it runs fused."""
    out = run("compiling", tmp_path, TORCH_NEURONX_COMPILER="aoti", TORCH_NEURONX_COMPILE_MODE="background")
    assert out["ok"], out["steps_ok"]
    if out["native"] is None:
        pytest.skip("the native layer is not loaded")
    assert out["while_compiling"]["ops_run_each"] > 0, out
    assert out["end"]["fused_executions"] > 0, out


def test_an_op_that_always_flushes_alone_stops_being_queued(tmp_path: Path) -> None:
    out = run("solo", tmp_path)
    f = out["stats"]["fusion"]
    assert out["ok"]
    assert f["ops_not_queued"] == 1 and f["fused_executions"] == 0
    # relu was queued until it had flushed alone TORCH_NEURONX_FUSION_MIN_SEEN (2) times, then ran as is
    assert 2 <= f["ops_buffered"] < 8


def test_outputs_below_the_size_threshold_are_not_queued(tmp_path: Path) -> None:
    # (`_foreach_` ops are queued at any size: the for-loop optimizer keeps them out of this run)
    out = run("train_single_tensor", tmp_path, TORCH_NEURONX_FUSION_MIN_NUMEL="1000000")
    plain = run("train_single_tensor", tmp_path / "off", fusion=False)
    f = out["stats"]["fusion"]
    assert f["ops_buffered"] == 0 and f["fused_executions"] == 0 and f["ops_not_queued"] > 0
    assert out["losses"] == pytest.approx(plain["losses"], rel=1e-6)


def test_buffer_limit_flushes(tmp_path: Path) -> None:
    out = run("limit", tmp_path, TORCH_NEURONX_CONCATENATION_BUFFER_SIZE_LIMIT="3")
    assert out["ok"] and out["stats"]["fusion"]["flushes"].get("buffer_limit", 0) >= 2


def test_group_that_cannot_compile_runs_op_by_op_and_is_remembered(tmp_path: Path) -> None:
    out = run("refuse_graphs", tmp_path)
    assert out["ok"]
    # remembered as not fusible after one refused resolve: its flat class's compile (a chain of elementwise
    # ops), its ranked class's, then its exact shape's
    assert out["attempts"] == 3
    assert out["stats"]["fusion"]["fused_executions"] == 0


def test_dead_intermediates_are_not_materialised(tmp_path: Path) -> None:
    out = run("dead_intermediates", tmp_path)
    f = out["stats"]["fusion"]
    assert f["outputs_not_materialised"] >= 3 * 4 and f["fused_executions"] >= 1


def test_flag_off_is_exactly_the_per_op_path(tmp_path: Path) -> None:
    out = run("off", tmp_path, fusion=False)
    assert out["hooks_in_kernel"] is False and "fusion" not in out["stats"]


def test_a_fused_group_of_another_rank_reuses_its_flat_class(tmp_path: Path) -> None:
    """sigmoid, add, an in-place mul at rank 1, then on 8x8 and 4x4x4 views: one flat class for the group
    and for each op (docs/dispatch.md, the rank-collapse rule), so the later ranks compile nothing."""
    out = run("compiled_group_ranks", tmp_path)
    assert out["ok"], out["steps_ok"]
    assert out["compiles"][0] > 0 and out["compiles"][1:] == [0, 0], out["compiles"]
    assert out["stats"]["fusion"]["fused_executions"] >= 9
