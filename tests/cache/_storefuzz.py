"""The stores' answers, fuzzed: sizes, drips, truncations, lies and hangs, against the HTTP, Redis and path
stores. One case = one scripted answer (`_scripted.Answer`, or a path entry of some kind) and one `get`;
`check_case` judges it. Shared by tests/cache/test_store_fuzz.py (a bounded run) and
benchmarks/store_fuzz.py (>= 10,000 cases for the record).

What a case must show (else `check_case` raises `AssertionError` naming the case):
  * no hang past the deadline: `get` returns within `DEADLINE` + `SLACK`;
  * no wrong result: `get` returns None or exactly the bytes the answer's framing delimits (the body up to
    its announced size; never a torn or over-long answer, never more than `LIMIT` bytes); an honest,
    prompt answer within the cap is a hit (no false miss);
  * no unbounded read: the call's peak Python allocation (tracemalloc, all threads) stays under
    `4 * LIMIT + 512 KiB`, whatever size was announced or sent.
"""

from __future__ import annotations

import os
import time
import tracemalloc
import warnings
from dataclasses import dataclass
from pathlib import Path

from hypothesis import strategies as st

from _cachetest import key_of  # type: ignore[import-not-found]
from _scripted import Answer, ScriptedServer  # type: ignore[import-not-found]

from neuron_runtime.cache import HttpStore, RedisStore, SharedPathStore

LIMIT = 64 * 1024
DEADLINE = 0.25
SLACK = 0.5  # a call may come back this much after its deadline on a loaded host
MEMORY_BOUND = 4 * LIMIT + 512 * 1024
KEY = key_of("fuzzed")


@dataclass
class Case:
    store: str  # "http", "resp" or "path"
    answer: Answer
    kind: str = "file"  # path store: "file", "fifo", "devzero", "dir", "sparse"

    def describe(self) -> str:
        a = self.answer
        return (f"{self.store}/{self.kind}: body {len(a.body)} B, announce {a.announce}, chunk {a.chunk}, "
                f"drip {a.drip_s}, hang {a.hang}, chunked {a.chunked}, status {a.status}, record {a.record_size}")


def _sizes() -> st.SearchStrategy[int]:
    return st.one_of(st.integers(0, 64), st.integers(LIMIT - 2, LIMIT + 2), st.integers(0, 3 * LIMIT))


@st.composite
def cases(draw: st.DrawFn) -> Case:
    store = draw(st.sampled_from(["http", "resp", "path"]))
    n = draw(_sizes())
    body = os.urandom(n)
    lie = draw(st.sampled_from(["honest"] * 4 + ["short", "long", "huge"]))
    announce = {"honest": None, "short": max(0, n - draw(st.integers(1, 100))), "long": n + draw(st.integers(1, 100)),
                "huge": draw(st.integers(LIMIT + 1, 1 << 40))}[lie]
    if store == "path":
        kind = draw(st.sampled_from(["file"] * 4 + ["fifo", "devzero", "dir", "sparse"]))
        return Case(store, Answer(body=body), kind)
    answer = Answer(
        body=body, announce=announce,
        chunk=draw(st.sampled_from([1, 13, 4096, 1 << 16])),
        drip_s=draw(st.sampled_from([0.0, 0.0, 0.0, 0.001, 0.01])),
        hang=draw(st.integers(0, 9)) == 0,
    )
    if answer.drip_s and answer.chunk < 4096:
        answer.body = body[:draw(st.integers(0, 64))]  # a drip of a few sends: some end in time, some do not
    if store == "http":
        answer.chunked = draw(st.integers(0, 4)) == 0
        answer.status = draw(st.sampled_from([200] * 6 + [404, 500]))
        answer.record_size = draw(st.sampled_from([None, None, 0, LIMIT + 1]))
    return Case(store, answer)


def framed(case: Case) -> bytes | None:
    """The bytes the answer's framing delimits, or None where it delimits none (torn, over the cap,
    an error status, not a regular file)."""
    a = case.answer
    if case.store == "path":
        return a.body if case.kind == "file" and len(a.body) <= LIMIT else None
    if case.store == "http" and (a.status != 200 or (a.record_size if a.record_size is not None else a.size) > LIMIT):
        return None
    if a.chunked:
        return a.body if len(a.body) <= LIMIT else None
    if a.size > LIMIT or a.size > len(a.body):
        return None
    return a.body[:a.size]


def prompt(case: Case) -> bool:
    """True when an honest answer certainly arrives well within the deadline (a miss would be false)."""
    a = case.answer
    sends = -(-len(a.body) // max(1, a.chunk))
    # Few sends (thousands of 13-byte sends take the server itself longer than the deadline on a busy host).
    return sends <= 64 and sends * a.drip_s < DEADLINE / 4 and a.announce is None


def run_case(case: Case, tmp: Path) -> tuple[bytes | None, float, int]:
    """(what `get` returned, seconds it took, peak bytes allocated meanwhile)."""
    if case.store == "path":
        store = SharedPathStore(str(tmp), timeout_s=DEADLINE, max_entry=LIMIT)
        path = Path(store._path(KEY))
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.is_dir():
            path.rmdir()
        elif path.exists():
            path.unlink()
        if case.kind == "file":
            path.write_bytes(case.answer.body)
        elif case.kind == "fifo":
            os.mkfifo(path)
        elif case.kind == "devzero":
            path.symlink_to("/dev/zero")
        elif case.kind == "dir":
            path.mkdir()
        else:
            with open(path, "wb") as f:
                f.truncate(4 * LIMIT)
        return _timed(store.get)
    server = ScriptedServer(case.store, case.answer)
    server.keys = (KEY,)
    try:
        url = server.url(max_entry=str(LIMIT))
        store = HttpStore(url, timeout_s=DEADLINE) if case.store == "http" else RedisStore(url, timeout_s=DEADLINE)
        try:
            return _timed(store.get)
        finally:
            store.close()
    finally:
        server.close()


def _timed(get: object) -> tuple[bytes | None, float, int]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tracemalloc.start()
        try:
            t0 = time.monotonic()
            got = get(KEY)  # type: ignore[operator]
            took = time.monotonic() - t0
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    return got, took, peak


def check_case(case: Case, tmp: Path) -> str:
    """Run one case and judge it (see the module docstring); returns its outcome: "hit" or "miss"."""
    got, took, peak = run_case(case, tmp)
    what = case.describe()
    assert took <= DEADLINE + SLACK, f"hang past the deadline ({took:.2f} s): {what}"
    assert peak <= MEMORY_BOUND, f"unbounded read ({peak} bytes allocated): {what}"
    want = framed(case)
    if got is not None:
        assert got == want and len(got) <= LIMIT, f"wrong result ({len(got)} bytes): {what}"
    elif want is not None and prompt(case) and not case.answer.hang:
        raise AssertionError(f"false miss: {what}")
    return "miss" if got is None else "hit"
