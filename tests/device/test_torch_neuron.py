"""`torch.neuron` as Transformers and Accelerate call it: memory counters, RNG state, device selection,
and the `torch_neuronx` import name with its conflict check."""

from __future__ import annotations

import gc
import importlib.util
import os
from typing import Any

import pytest
import torch

from neuron_runtime._native import _hostmem

from rt_helpers import DEV, run_python

native = pytest.mark.skipif(_hostmem.NATIVE is None, reason="memory counters live in the native layer")


# -- memory -----------------------------------------------------------------------------------------
@native
def test_memory_counters_are_bytes_of_live_neuron_storage() -> None:
    gc.collect()
    n = torch.neuron
    base = n.memory_allocated()
    assert torch.accelerator.memory_allocated() == base
    x = torch.empty(1000, dtype=torch.float32, device=DEV)
    assert n.memory_allocated() - base == 4000
    views = (x.view(10, 100), x[:10], x.unsqueeze(0))  # no new memory
    assert n.memory_allocated() - base == 4000
    y = x + 1  # a fresh output
    assert n.memory_allocated() - base == 8000
    cpu = y.cpu()  # a CPU copy is not neuron memory
    assert n.memory_allocated() - base == 8000
    n.reset_peak_memory_stats()
    del x, views
    gc.collect()
    assert n.memory_allocated() - base == 4000, "a freed neuron tensor's bytes must be subtracted"
    assert n.max_memory_allocated() - base == 8000, "the peak since the reset"
    n.reset_peak_memory_stats()
    assert n.max_memory_allocated() == n.memory_allocated()
    del y
    gc.collect()
    assert n.memory_allocated() == base
    # torch.accelerator's functions ask the allocator the runtime registers: same numbers
    m = torch.nn.Linear(100, 100).to(DEV)
    assert n.memory_allocated() - base == (100 * 100 + 100) * 4
    assert torch.accelerator.memory_allocated() == n.memory_allocated() == n.memory_reserved()
    assert torch.accelerator.max_memory_allocated() == n.max_memory_allocated()
    assert torch.accelerator.memory_stats()["allocated_bytes.all.current"] == n.memory_allocated()
    torch.accelerator.reset_peak_memory_stats()
    assert n.max_memory_allocated() == n.memory_allocated()
    n.empty_cache()
    torch.accelerator.empty_cache()
    del m, cpu


@native
def test_outputs_of_the_native_hit_path_are_counted_and_uncounted() -> None:
    # Repeated calls run on the native hit path, whose fresh outputs count their bytes without the root map.
    gc.collect()
    n = torch.neuron
    x = torch.ones(64, 32, device=DEV)
    base = n.memory_allocated()
    for _ in range(3):  # the first call may take the Python path; the later ones are native hits
        y = x * 2
        values, indices = torch.max(x, dim=1)  # two outputs, two buffers
        assert n.memory_allocated() - base == 64 * 32 * 4 + 64 * 4 + 64 * 8
        del y, values, indices
        gc.collect()
        assert n.memory_allocated() == base, "every output's bytes are subtracted when it dies"
    assert _hostmem.NATIVE.executions() > 0
    with torch.no_grad():  # in place: no new memory
        x.mul_(2)
        x.add_(1)
    assert n.memory_allocated() == base


@native
def test_memory_of_a_cpu_view_of_neuron_memory_is_counted_once() -> None:
    from neuron_runtime._native._hostmem import to_cpu, to_neuron

    gc.collect()
    base = torch.neuron.memory_allocated()
    x = torch.ones(256, device=DEV)
    again = to_neuron(to_cpu(x))  # the same memory under a second neuron storage
    assert torch.neuron.memory_allocated() - base == 1024
    del x
    gc.collect()
    assert torch.neuron.memory_allocated() - base == 1024, "still held by `again`"
    del again
    gc.collect()
    assert torch.neuron.memory_allocated() == base


# -- random numbers ---------------------------------------------------------------------------------
def test_rng_state_round_trips_dropout_masks() -> None:
    torch.neuron.manual_seed_all(7)
    state = torch.neuron.get_rng_state()
    assert state.dtype == torch.uint8 and state.device.type == "cpu"
    x = torch.ones(64, 64, device=DEV)
    first = torch.nn.functional.dropout(x, 0.5).cpu()
    torch.neuron.set_rng_state(state)
    assert torch.equal(first, torch.nn.functional.dropout(x, 0.5).cpu())
    (all_state,) = torch.neuron.get_rng_state_all()
    second = torch.nn.functional.dropout(x, 0.5).cpu()
    torch.neuron.set_rng_state_all([all_state])
    assert torch.equal(second, torch.nn.functional.dropout(x, 0.5).cpu())
    assert not torch.equal(first, second)
    torch.neuron.manual_seed_all(7)
    assert torch.equal(torch.neuron.get_rng_state(), state), "manual_seed_all seeds the generator ops use"


@pytest.mark.parametrize(("bad", "error", "match"), [
    (lambda s: s[:100], ValueError, "5056 bytes"),
    (lambda s: s.float(), TypeError, "torch.uint8"),
    (lambda s: s.tolist(), TypeError, "got list"),
])
def test_a_wrong_rng_state_is_a_clear_error(bad, error, match) -> None:  # type: ignore[no-untyped-def]
    state = torch.neuron.get_rng_state()
    with pytest.raises(error, match=match):
        torch.neuron.set_rng_state(bad(state))
    assert torch.equal(torch.neuron.get_rng_state(), state), "a refused state changes nothing"
    with pytest.raises(ValueError, match="list of one state"):
        torch.neuron.set_rng_state_all([state, state])


@native
def test_mem_get_info_is_capacity_less_the_counted_bytes() -> None:
    gc.collect()
    n = torch.neuron
    free, total = n.mem_get_info()
    assert torch.accelerator.get_memory_info() == (free, total) == n.mem_get_info("neuron:0")
    assert total == n.get_device_properties(0).total_memory > 0
    assert free == total - n.memory_allocated()
    x = torch.empty(1 << 20, dtype=torch.uint8, device=DEV)
    assert n.mem_get_info() == (free - (1 << 20), total)
    stats = n.memory_stats()
    assert stats == torch.accelerator.memory_stats() and stats["allocated_bytes.all.current"] == n.memory_allocated()
    assert {"num_ooms", "reserved_bytes.all.peak", "allocation.all.current"} <= set(stats), "torch.cuda's keys"
    summary = n.memory_summary()
    assert "Allocated memory" in summary and f"{n.memory_allocated() / 2**20:.2f} MiB" in summary
    assert "capacity" in summary and "Reserved memory" not in n.memory_summary(abbreviated=True)
    n.reset_peak_memory_stats()
    assert n.max_memory_allocated() == n.memory_allocated()
    del x
    gc.collect()
    assert n.mem_get_info() == (free, total)


@native
def test_capacity_comes_from_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    from neuron_runtime.device import _torch_neuron

    gc.collect()
    try:
        monkeypatch.setenv("TORCH_NEURONX_DEVICE_MEMORY", "96GiB")  # a Trainium2 chip's HBM
        _torch_neuron.set_capacity()
        used = torch.neuron.memory_allocated()
        assert torch.accelerator.get_memory_info() == (96 * 2**30 - used, 96 * 2**30)
        assert torch.neuron.get_device_properties().total_memory == 96 * 2**30
        monkeypatch.setenv("TORCH_NEURONX_DEVICE_MEMORY", "lots")
        _torch_neuron.set_capacity()
        for query in (torch.neuron.mem_get_info, torch.accelerator.get_memory_info):
            with pytest.raises(RuntimeError, match=r"TORCH_NEURONX_DEVICE_MEMORY='lots': not a size"):
                query()
        assert torch.neuron.memory_allocated() == used, "the counters do not depend on the setting"
    finally:
        monkeypatch.delenv("TORCH_NEURONX_DEVICE_MEMORY", raising=False)
        _torch_neuron.set_capacity()
    assert torch.neuron.mem_get_info()[1] == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@native
@pytest.mark.parametrize("query", [
    lambda i: torch.neuron.mem_get_info(i), lambda i: torch.neuron.memory_stats(i),
    lambda i: torch.neuron.memory_allocated(i), lambda i: torch.neuron.max_memory_allocated(i),
    lambda i: torch.neuron.reset_peak_memory_stats(i), lambda i: torch.neuron.memory_summary(i),
    lambda i: torch.accelerator.get_memory_info(i), lambda i: torch.accelerator.memory_stats(i),
    lambda i: torch.accelerator.memory_allocated(i), lambda i: torch.accelerator.reset_peak_memory_stats(i),
    lambda i: torch.accelerator.reset_accumulated_memory_stats(i)])
def test_an_invalid_device_index_is_cudas_error(query: Any) -> None:
    for bad in (1, 7, torch.device(DEV, 1)):
        i = bad.index if isinstance(bad, torch.device) else bad
        with pytest.raises(RuntimeError, match=rf"^Invalid device argument {i}: did you call init\?"):
            query(bad)


# -- the rest of what the libraries call -------------------------------------------------------------
def test_device_functions_the_libraries_call() -> None:
    n = torch.neuron
    assert n.device_count() == 1 and n.current_device() == 0 and n.is_bf16_supported()
    n.set_device(0)
    n.set_device("neuron:0")
    assert "neuron" in n.get_device_name() and n.get_device_properties(0).total_memory > 0
    with pytest.raises(RuntimeError, match=r"neuron:1 does not exist: this host has one neuron device, neuron:0"):
        n.set_device(torch.device("neuron:1"))


def test_torch_neuronx_loads_the_runtime_and_counters_need_the_native_layer() -> None:
    assert importlib.util.find_spec("torch_neuronx") is not None
    # One fresh process for both (each costs an `import torch`): `import torch_neuronx` first, and the
    # memory counters' error when the native layer is off.
    r = run_python("import torch_neuronx, sys, torch\n"
                   "print(torch_neuronx.__neuron_runtime__, 'neuron_runtime' in sys.modules, torch.neuron.is_available())\n"
                   "torch.neuron.memory_allocated()\n", env={"TORCH_NEURONX_NATIVE": "0"})
    assert r.stdout.split() == ["True", "True", "True"], r.stderr
    assert r.returncode != 0 and "MemoryStatsUnavailable" in r.stderr
    assert "native layer" in r.stderr and "TORCH_NEURONX_NATIVE" in r.stderr


def test_aws_torch_neuronx_installed_beside_it_is_a_clear_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # What pip leaves for AWS's package: a dist-info directory on sys.path.
    info = tmp_path / "torch_neuronx-2.9.0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch-neuronx\nVersion: 2.9.0.1.0\n")
    r = run_python("import torch", env={"PYTHONPATH": str(tmp_path)})
    assert r.returncode != 0
    assert "torch-neuronx 2.9.0.1.0" in r.stderr and "neuron-runtime" in r.stderr
    assert "pip uninstall torch-neuronx" in r.stderr
