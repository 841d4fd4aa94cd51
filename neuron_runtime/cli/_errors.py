"""The CLI's errors. Each carries the exit status it maps to; messages name the fix."""

from __future__ import annotations

#: exit statuses (documented in docs/cli.md)
OK, PROBLEMS, USAGE = 0, 1, 2


class CliError(Exception):
    """An error `main` prints as one line on stderr (no traceback) and turns into `exit_code`."""

    exit_code = PROBLEMS


class UsageError(CliError):
    """Bad flags, arguments or configuration: nothing was done."""

    exit_code = USAGE


class BundleError(CliError):
    """A bundle that cannot be read at all (not a bundle, bad manifest, bad bundle signature)."""


class JobError(CliError):
    """The warm-up job could not be started."""
