"""The `neuron-cache` entry point: `_build_parser()` and `main(argv) -> int`."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from neuron_runtime.cli._errors import CliError

log = logging.getLogger(__name__)


def _build_parser() -> argparse.ArgumentParser:
    from neuron_runtime.cli import _bundle, _explain, _inspect, _service, _warm

    p = argparse.ArgumentParser(
        prog="neuron-cache",
        description="Warm, move and inspect neuron-runtime's executable cache. Every read command takes --json; "
                    "logs and progress go to stderr. Cache locations default to the runtime's environment "
                    "variables (TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR, TORCH_NEURONX_NEFF_CACHE_DIR).",
        epilog="See docs/cli.md. Exit status: 0 ok, 1 problems found (failed compiles, refused or damaged "
               "entries, failed job), 2 usage or configuration error.")
    p.add_argument("--log-level", default=os.environ.get("NEURON_CACHE_LOG_LEVEL", "WARNING"),
                   help="log level on stderr [env NEURON_CACHE_LOG_LEVEL, default WARNING]")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _warm.add_parsers(sub)
    _bundle.add_parsers(sub)
    _inspect.add_parsers(sub)
    _explain.add_parsers(sub)
    _service.add_parsers(sub)
    return p


def _split_job(argv: list[str]) -> tuple[list[str], list[str]]:
    """`warm [options] -- JOB...`: everything after the first `--` is the job, untouched by argparse
    (so the job's own flags, like `--steps`, never reach our parser)."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        # This process imports the runtime, whose exit hook would write *this* process's (empty) counters
        # over the user's TORCH_NEURONX_STATS_FILE: keep the path for `stats`, drop it from the environment.
        from neuron_runtime.cli import _common

        _common.STATS_FILE_ENV = os.environ.pop("TORCH_NEURONX_STATS_FILE", None)
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, job = _split_job(argv)
    parser = _build_parser()
    args = parser.parse_args(ours)
    if job:
        if args.command != "warm":
            parser.error(f"`--` and a job are only for warm, not {args.command}")
        args.job = list(getattr(args, "job", []) or []) + job
    logging.basicConfig(level=str(args.log_level).upper(), stream=sys.stderr,
                        format="%(asctime)s neuron-cache %(levelname)s %(name)s: %(message)s")
    try:
        status: int = args.func(args)
        return status
    except CliError as e:
        print(f"neuron-cache {args.command}: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"neuron-cache {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `neuron-cache ls | head`: the reader went away; not an error worth a traceback.
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115
        except OSError:
            pass
        return 0
