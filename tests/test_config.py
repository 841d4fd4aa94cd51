"""The one config module: `to_env` gives what `load` reads back into an equal Config."""

from __future__ import annotations

import dataclasses

from neuron_runtime import _config


def test_to_env_round_trips_every_flag_both_ways() -> None:
    base = _config.load({})
    flags = [f.name for f in dataclasses.fields(_config.Config) if isinstance(getattr(base, f.name), bool)]
    assert "graph_fallback" in flags  # the inverted one: TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION
    for value in (True, False):
        cfg = dataclasses.replace(base, **{f: value for f in flags}, signing_key=b"\x00k\xff",
                                  aoti_simdlen=8, fleet_timeout_s=2.5)
        assert _config.load(_config.to_env(cfg)) == cfg
