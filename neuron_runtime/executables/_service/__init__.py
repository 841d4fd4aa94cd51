"""The host's compile service: background compiles for every process on a host (docs/background.md).

    training process ──▶ ServiceClient ──Unix socket, JSON lines──▶ Server (_server.py, no torch)
      (_background.py)     (_client.py)                               └─ WorkerPool ──▶ _worker.py × N
                                                                         (_pool.py)

    _server.py  the service: socket, clients, one job per key, the bounded queue (standard library only)
    _pool.py    `WorkerPool`: the worker processes and their faults (also `neuron-cache warm/compile`'s)
    _client.py  a process's connection to the service, started on demand; the private socket directory
    _worker.py  one compile worker (the only one here that imports torch); `worker_env`, its environment

Lifecycle. One service per host and configuration (tier, compiler fingerprint, cache tiers, signing key,
timeouts: its socket's name is an HMAC of them under a per-user salt, in the private
`$TMPDIR/neuron-runtime-<uid>/`, checked without following links: `_client.ServiceDir`). The first
process that needs a compile starts it (under a lock file: concurrent processes start one); it is
shared by every later process with the same configuration (e.g. the ranks of a job), outlives the job
that started it, and exits after TORCH_NEURONX_COMPILE_IDLE_TIMEOUT seconds with no client and no job.
On SIGTERM it stops taking jobs, gives running compiles 30 s, and exits. Its workers die with it
(PR_SET_PDEATHSIG); a worker killed mid-compile leaves nothing behind, because entries are written
whole or not at all (temp file + rename, one SQLite transaction).

Protocol (client -> service; one JSON object per line, never pickle):
    {"op": "hello", "pid": N}                           -> {"op": "hello", "protocol": 1, "pid": ..., "workers": n}
    {"op": "compile", "key": K, "payload": {"signatures": [...], "key": K}, "priority": 0|1}
        0: an op waits for it (host runs meanwhile); 1: prefetched from the job's manifest (queued behind).
        The service keeps one job per K however many clients ask, and answers each of them:
        {"op": "started", "key": K}
        {"op": "done", "key": K, "status": "compiled"|"present"|"refused"|"failed"|"busy", "found": key,
         "reason": ..., "seconds": ..., "phases": {phase: seconds}, "caused": bool,
         "entry": base64 (only if the local tier refused it),
         "retry_after": seconds (only with "failed" while workers cannot start: ask again after that)}
    {"op": "status"}                                    -> queued, running, clients, workers, ready, counts
"compiled" and "present" mean the entry `found` is in the tiers (the local tier first); a client uses it
only if `found` is one of its own candidates for the key (`_background`); "caused" is true
for the client whose request made the compile (its `stats()["compiles"]` counts it); "busy" means the
bounded queue (TORCH_NEURONX_COMPILE_QUEUE) is full: the client asks again later. A line that is not a
JSON object with a known "op", or a compile without a 64-hex key and 1 to 8 signature objects, gets
{"op": "error", "reason": ...} and the connection goes on (nothing of it reaches a worker); a client that
sends more than 4 MiB without a newline is told so and disconnected; at most 256 clients at once; a
client that does not read its answers for 30 s is disconnected (tests/executables/test_server.py,
test_fuzz.py).
"""
