"""Export and AOT lowering of the `aoti` tier: `torch.export` of an op's call with its example inputs
(dynamic dims for a shape class), the refusal of outputs an executable cannot be, and AOTInductor's
lowering stopped before its C++ build (the op's unit, `_units`), all inside our private scratch
(`redirected`: Inductor's scratch paths are process globals)."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import tempfile
from collections.abc import Iterator
from typing import Any

import torch

from . import _toolchain, _units
from ._base import CompileRefused, Executable

log = logging.getLogger(__name__)


def export(qualname: str, run: Executable, n_tensors: int, inputs: list[torch.Tensor],
           dynamic: list[list[Any]] | None = None, restride: bool = False) -> Any:
    """`torch.export` of the op's call; `dynamic`: per tensor input its sizes, a symbol name where the
    dim is dynamic (a shape class). Each symbol is a `Dim` with min=2, or the class's minimum for it (its
    `minimum` attribute, `_examples.Symbol`): export refuses (constraint violation) rather than narrow it,
    so a class it cannot keep generic over those sizes is refused, never half-generic.
    `restride`: each output is written into a buffer of eager's strides (the traced meta strides), for an
    op whose Inductor lowering picks another layout (`cat` of permuted inputs keeps their order, eager's
    is contiguous)."""
    class _Op(torch.nn.Module):
        def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
            # `.item()` on an input keeps the scalar symbolic (an unbacked SymFloat/SymInt): the value is
            # read when the executable runs instead of being baked into the code.
            outs = tuple(run(args[:n_tensors], [s.item() for s in args[n_tensors:]]))
            if not restride:
                return outs
            return tuple(torch.empty_strided(o.shape, o.stride(), dtype=o.dtype).copy_(o)
                         if isinstance(o, torch.Tensor) else o for o in outs)

    shapes: Any = None
    if dynamic is not None:
        dims: dict[str, Any] = {}
        specs: list[Any] = [{i: dims.setdefault(n, torch.export.Dim(n, min=getattr(n, "minimum", 2)))
                             for i, n in enumerate(sizes) if isinstance(n, str)} or None for sizes in dynamic]
        specs += [None] * (len(inputs) - len(specs))
        shapes = (tuple(specs),)
    try:
        return torch.export.export(_Op(), tuple(inputs), dynamic_shapes=shapes, strict=False)
    except CompileRefused:
        raise
    except Exception as e:  # noqa: BLE001 - anything export rejects is an op we cannot compile
        first = e
    if shapes is not None:
        # Most guards that pin a class's dim ask whether a size *derived* from it is 1 (a pooled or
        # padded output's `H // 2 != 1`), asked by the tensor metadata export records (its memory
        # format: "are the strides contiguous, skipping size-1 dims?"), not by the kernel. Traced again
        # size-obliviously, those questions take the answer true of sizes >= 2 and add no guard; a real
        # constraint (a dim that must be 2) still fails. Only a class whose plain export failed is
        # traced so; the self-check runs it on two shapes like any class.
        import torch.fx.experimental._config as fx_config

        try:
            with fx_config.patch(backed_size_oblivious=True):
                ep = torch.export.export(_Op(), tuple(inputs), dynamic_shapes=shapes, strict=False)
            log.debug("aoti: %s: exported size-obliviously (plainly: %s)", qualname, _first_line(first)[:200])
            return ep
        except CompileRefused:
            raise
        except Exception as e:  # noqa: BLE001 - the plain export's error is the one to report
            log.debug("aoti: %s: size-oblivious export failed too (%s)", qualname, _first_line(e)[:300])
    what = "export with dynamic dims" if dynamic is not None else "export"
    raise CompileRefused(f"{qualname}: {what} failed ({type(first).__name__}: {_first_line(first)[:300]})") from first


def _first_line(e: BaseException) -> str:
    """What a refusal quotes of an error: its first line (export's and Inductor's run to pages)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


def check_outputs(qualname: str, ep: Any) -> None:
    """Refuse what an executable cannot be: an output that is not a tensor, or one whose shape depends
    on the data. An output that is None in the trace (an optional gradient `output_mask` turned off:
    `native_layer_norm_backward`, `convolution_backward`) is None at every call: AOTInductor returns it
    as an undefined tensor, which the runner hands back as None, as eager does."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    out = next(iter(ep.graph.find_nodes(op="output")))
    for i, node in enumerate(out.args[0]):
        if node is None:
            continue
        val = getattr(node, "meta", {}).get("val")
        if not isinstance(val, torch.Tensor):
            raise CompileRefused(f"{qualname}: output {i} is not a tensor ({type(val).__name__})")
        if free_unbacked_symbols(val):  # sizes of a shape class's dynamic dims are fine
            raise CompileRefused(f"{qualname}: output {i} has a shape that depends on the data "
                                 f"({list(val.shape)}); it runs on the host")


def aot_lower(qualname: str, ep: Any, inputs: list[torch.Tensor], pinned: dict[str, Any],
              build: str) -> tuple[_units.Unit | None, bytes | None, float]:
    """AOTInductor's lowering of `ep`, stopped before its C++ build: (the op's unit, None, 0.0). Generated
    code of a shape the rewrite does not know (`_units.Unsupported`) is built by AOTInductor itself into
    `build` and packaged as a .pt2 zip in memory: (None, the zip, the seconds that build took)."""
    from torch._inductor import aot_compile
    from torch._inductor.package import package_aoti

    options = dict(pinned)
    options["aot_inductor.package"] = True
    options["aot_inductor.output_path"] = build
    classic: dict[str, float] = {}
    try:
        with _units.capturing(classic):
            files = aot_compile(ep.module(check_guards=False), tuple(inputs), options=options)
    except BaseException as e:  # noqa: BLE001 - `capturing` raises a BaseException to carry the code out
        got = _units.captured(e)
        if got is not None:
            return got, None, 0.0
        if not isinstance(e, Exception):
            raise
        # a failed lowering or C++ build is a refusal with its reason
        why = f"{type(e).__name__}: {_first_line(e)[:300]}"
        raise CompileRefused(f"{qualname}: AOTInductor failed ({why})") from e
    log.debug("aoti: %s built by AOTInductor whole (%s)", qualname, classic.get("why"))
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        raise CompileRefused(f"{qualname}: AOTInductor produced weights outside the .so; not supported")
    raw = io.BytesIO()
    package_aoti(raw, files)
    return None, raw.getvalue(), classic.get("seconds", 0.0)


# -- scratch redirection ----------------------------------------------------------------------------
@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def redirected(scratch: _toolchain.Scratch) -> Iterator[None]:
    """Inductor's scratch into our private directories for the duration of one compile.

    Three knobs, because Inductor reads them at different times: TORCHINDUCTOR_CACHE_DIR is read on every
    use; the precompiled-header directory was fixed at import of `torch._inductor.codecache` from
    tempfile.gettempdir() (so setting TMPDIR now would not move it) and is a module global; TMPDIR in the
    environment reaches g++ and tempfile.tempdir reaches Python's own temporary files."""
    import torch._inductor.codecache as codecache

    old_header = codecache._HEADER_DIR, codecache._HEADER_LOCK_DIR
    old_tempdir = tempfile.tempdir
    codecache._HEADER_DIR = str(scratch.pch)
    codecache._HEADER_LOCK_DIR = str(scratch.pch / "locks")
    tempfile.tempdir = str(scratch.tmp)
    try:
        with _env(TORCHINDUCTOR_CACHE_DIR=str(scratch.cache), TMPDIR=str(scratch.tmp)):
            yield
    finally:
        codecache._HEADER_DIR, codecache._HEADER_LOCK_DIR = old_header
        tempfile.tempdir = old_tempdir
