"""``ringstream-bench cluster``: N daemons behind vLLM's router, routed by their KV-cache events.

Starts N ``ringstream serve --http`` daemons on one model (each with ``--kv-events``), then ``vllm-router``
in front of them once per routing policy, and sends the same multi-tenant workload through it: ``tenants``
system prompts of ``system_tokens`` tokens each, every request one tenant's system prompt and a question of
its own, in rounds of ``concurrency`` sent at once, each round once the daemons' KV events for the one before
have settled (:func:`run_policy` says why). For each policy it reports the prefix-cache hit fraction summed over the
daemons (prompt tokens found cached / prompt tokens looked up, from each daemon's ``/metrics``), beside what one
daemon gets from the same workload at the same concurrency (``single``: requests of one tenant in flight at once
miss each other there too) and the ideal: the fraction a cache that never evicts would hit with one request at a
time, computed from the prompts' token ids (each prompt's longest block-aligned prefix shared with an earlier
prompt). With ``--kill`` the
last daemon is SIGKILLed mid-run under ``kv_aware``, and the report counts the requests that failed and those
that went on. The daemons' caches are reset between policies by restarting them.

The router is the ``vllm-router`` package (``pip install vllm-router``); the command says so when it is
missing. Nothing here downloads anything.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["ClusterError", "Cluster", "Workload", "add_parser", "command", "ideal_hit_fraction", "run_policy"]

BUILTIN_KV_CACHE_BYTES = 16 * 2**20
"""Each daemon's KV pool with the built-in model by default: 128 blocks of 16 tokens (8 KiB a token)."""
SINGLE = "single"
"""The reference run: the workload sent straight to one daemon (no router), at the same concurrency."""
POLICIES = (SINGLE, "kv_aware", "round_robin", "cache_aware")
"""Compared by default: one daemon, then vllm-router's policies over all: routed by KV events, blind, and by the
router's own guess from the requests it routed."""
ROUTER_START_S = 30.0
DAEMON_START_S = 180.0
REQUEST_TIMEOUT_S = 120.0
SERVED_NAME = "cluster-model"
EVENTS_SETTLE_S = 0.05
"""A round of requests ends once the daemons' KV event streams have been quiet this long after its last answer,
seconds: a daemon publishes a request's blocks before it answers, and the router, subscribed to the same streams,
applies a batch within milliseconds."""
EVENTS_SETTLE_MAX_S = 2.0
"""A round waits at most this long for the streams to go quiet, seconds."""
HEARTBEAT_WAIT_S = 2.5
"""Pause between a run's last answer and the hit-fraction read, seconds: the daemons' counters reach /metrics
with the worker's next heartbeat (once a second when idle)."""


class ClusterError(RuntimeError):
    """The cluster could not be started or measured (the message says what failed)."""


def _log(message: str) -> None:
    print(f"[cluster] {message}", file=sys.stderr, flush=True)


def router_command() -> list[str] | None:
    """The command that runs vllm-router, None when the package is not installed."""
    exe = shutil.which("vllm-router") or str(Path(sys.executable).with_name("vllm-router"))
    return [exe] if Path(exe).exists() else None


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout_s: float = REQUEST_TIMEOUT_S) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.load(resp)


def _get(url: str, timeout_s: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except (OSError, urllib.error.URLError):
        return 0, ""


def prefix_counters(url: str) -> tuple[float, float]:
    """``(prompt tokens looked up, found)`` in a daemon's prefix cache, from its /metrics."""
    status, text = _get(url + "/metrics")
    if status != 200:
        raise ClusterError(f"{url}/metrics answered {status}")
    queries = hits = 0.0
    for line in text.splitlines():
        if line.startswith("ringstream_prefix_cache_queries_total"):
            queries += float(line.rsplit(" ", 1)[1])
        elif line.startswith("ringstream_prefix_cache_hits_total"):
            hits += float(line.rsplit(" ", 1)[1])
    return queries, hits


@dataclass
class Workload:
    """Tenants sharing long system prompts; each request a tenant's system prompt and its own question."""

    tenants: int = 8
    requests: int = 48
    system_tokens: int = 320
    concurrency: int = 2
    max_tokens: int = 2
    seed: int = 0

    def prompts(self) -> list[str]:
        """The requests' prompts, in sending order (tenants drawn at random with ``seed``)."""
        rng = random.Random(self.seed)
        words = max(1, self.system_tokens // 10)  # the built-in tokenizer spends about 10 tokens per clause
        systems = [" ".join(f"tenant{t} rule{i}: {rng.choice('abcdefgh')}." for i in range(words))
                   for t in range(self.tenants)]
        return [f"{systems[rng.randrange(self.tenants)]}\nQuestion {r}: {rng.random():.6f}?"
                for r in range(self.requests)]


def ideal_hit_fraction(token_ids: list[list[int]], block_size: int) -> float:
    """Prompt tokens one daemon would find cached over all prompt tokens, for these prompts in this order.

    Each prompt hits its longest prefix shared with an earlier prompt, in whole blocks, short of its last
    token (always computed for its logits): what a cache that never evicts gives (vLLM's and ringstream's
    prefix caching, :meth:`ringstream.daemon.engine.block_manager.BlockManager.allocate`).
    """
    total = hits = 0
    for i, ids in enumerate(token_ids):
        shared = 0
        for earlier in token_ids[:i]:
            n = 0
            for a, b in zip(ids, earlier):
                if a != b:
                    break
                n += 1
            shared = max(shared, n)
        hits += min(shared, len(ids) - 1) // block_size * block_size
        total += len(ids)
    return hits / total if total else 0.0


@dataclass
class Cluster:
    """N daemons (``ringstream serve --http --kv-events``) and the router in front of them; a context manager.

    Args:
        daemons: how many daemons.
        model: model directory; None = the built-in one.
        serve_args: more ``serve`` arguments for every daemon.
        threads: torch threads per daemon's worker.
    """

    daemons: int = 2
    model: str | None = None
    serve_args: tuple[str, ...] = ()
    threads: int = 1
    procs: list = field(default_factory=list)
    urls: list[str] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    router: subprocess.Popen | None = None
    router_url: str = ""
    used: bool = False
    """Whether the daemons' caches hold a run's prompts (the next run restarts them)."""
    _tmp: tempfile.TemporaryDirectory | None = None

    def __enter__(self) -> "Cluster":
        try:
            self.start_daemons()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def start_daemons(self) -> None:
        """Start (or restart, with empty caches) every daemon; waits until each answers /health."""
        from ringstream.daemon.launcher import DaemonProcess
        from ringstream.tools.bench_serving import write_config

        self.stop_daemons()
        self.used = False
        self._tmp = self._tmp or tempfile.TemporaryDirectory(prefix="rs-cluster-")
        config = write_config(Path(self._tmp.name), {"worker_threads": self.threads, "devices": "cpu"})
        self.urls, self.events = [], []
        for _ in range(self.daemons):
            port, events = _free_port(), f"tcp://127.0.0.1:{_free_port()}"
            args = ["--config", str(config), "--http", f"127.0.0.1:{port}", "--kv-events", events,
                    "--served-model-name", SERVED_NAME, *self.serve_args]
            if self.model:
                args += ["--model", self.model]
            daemon = DaemonProcess(*args, prefix="cl", own_session=True)
            self.procs.append(daemon)
            daemon.start(wait_ready=False)
            self.urls.append(f"http://127.0.0.1:{port}")
            self.events.append(events)
        for daemon, url in zip(self.procs, self.urls):
            daemon.wait_ready(DAEMON_START_S)
            deadline = time.monotonic() + DAEMON_START_S
            while _get(url + "/health")[0] != 200:
                if daemon.proc.poll() is not None or time.monotonic() > deadline:
                    raise ClusterError(f"the daemon at {url} did not serve HTTP:\n{daemon.log_tail()}")
                time.sleep(0.2)

    def start_router(self, policy: str, *extra: str) -> None:
        """Start vllm-router with ``policy`` over the daemons (KV event sources given for ``kv_aware``)."""
        command = router_command()
        if command is None:
            raise ClusterError("vllm-router is not installed: pip install vllm-router")
        self.stop_router()
        port = _free_port()
        args = [*command, "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
                "--worker-urls", *self.urls, "--log-level", os.environ.get("RS_ROUTER_LOG", "warning"), *extra]
        if policy == "kv_aware":
            for url, events in zip(self.urls, self.events):
                args += ["--kv-event-source", f"{url}={events}"]
            args += ["--kv-event-model", SERVED_NAME]
        log = open(Path(self._tmp.name) / f"router-{policy}.log", "w")  # noqa: SIM115 (closed with the router)
        self.router = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.router._log = log  # type: ignore[attr-defined]
        self.router_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + ROUTER_START_S
        while _get(self.router_url + "/health")[0] != 200:
            if self.router.poll() is not None or time.monotonic() > deadline:
                raise ClusterError(f"vllm-router did not start: {self.router_log()[-2000:]}")
            time.sleep(0.2)

    def router_log(self) -> str:
        return (Path(self._tmp.name) / f"router-{self.router.args[self.router.args.index('--policy') + 1]}.log"
                ).read_text(errors="replace") if self.router is not None else ""

    def kill(self, index: int) -> None:
        """SIGKILL daemon ``index``'s front (its workers and HTTP child follow it; its rings stay in /dev/shm
        until :meth:`close` removes them)."""
        self.procs[index].stop(signal.SIGKILL, timeout_s=10.0)
        self.procs[index].killed = True

    def counters(self) -> tuple[float, float]:
        """``(looked up, found)`` prompt tokens summed over the live daemons."""
        queries = hits = 0.0
        for daemon, url in zip(self.procs, self.urls):
            if daemon.proc.poll() is None:
                q, h = prefix_counters(url)
                queries, hits = queries + q, hits + h
        return queries, hits

    def stop_router(self) -> None:
        if self.router is not None:
            with contextlib.suppress(ProcessLookupError):
                self.router.send_signal(signal.SIGTERM)
            try:
                self.router.wait(10.0)
            except subprocess.TimeoutExpired:
                self.router.kill()
                self.router.wait()
            self.router._log.close()  # type: ignore[attr-defined]
            self.router = None

    def stop_daemons(self) -> None:
        for daemon in self.procs:
            leftovers = daemon.close()
            if not leftovers.clean and not leftovers.killed:
                _log(f"daemon stopped with leftovers {leftovers.as_dict()}")
        self.procs = []

    def close(self) -> None:
        self.stop_router()
        self.stop_daemons()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


class _EventWatch:
    """Subscribes to the daemons' KV event streams, as the router does, to tell when they have gone quiet; a
    context manager."""

    def __init__(self, endpoints: list[str]) -> None:
        import zmq

        self._ctx = zmq.Context()
        self._poller = zmq.Poller()
        self._socks = []
        for endpoint in endpoints:
            sock = self._ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(endpoint)
            self._poller.register(sock, zmq.POLLIN)
            self._socks.append(sock)

    def __enter__(self) -> "_EventWatch":
        return self

    def __exit__(self, *exc_info) -> None:
        for sock in self._socks:
            sock.close()
        self._ctx.term()

    def settle(self, quiet_s: float = EVENTS_SETTLE_S, max_s: float = EVENTS_SETTLE_MAX_S) -> None:
        """Return once no batch has arrived for ``quiet_s`` seconds (those queued meanwhile count as arriving
        now), or after ``max_s``."""
        import zmq

        now = time.monotonic()
        deadline, quiet_until = now + max_s, now + quiet_s
        while (now := time.monotonic()) < min(quiet_until, deadline):
            ready = self._poller.poll(1000 * (min(quiet_until, deadline) - now))
            for sock, _ in ready:
                with contextlib.suppress(zmq.Again):
                    while True:
                        sock.recv_multipart(zmq.NOBLOCK)
            if ready:
                quiet_until = time.monotonic() + quiet_s


def _send(url: str, prompt: str, max_tokens: int) -> tuple[bool, str]:
    try:
        body = _post(url + "/v1/completions", {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens,
                                               "temperature": 0})
        return bool(body["choices"][0]["finish_reason"]), ""
    except urllib.error.HTTPError as exc:
        return False, f"HTTP {exc.code}: {exc.read()[:200]!r}"
    except (OSError, urllib.error.URLError, KeyError, ValueError) as exc:
        return False, f"{type(exc).__name__}: {exc}"


def run_policy(cluster: Cluster, policy: str, workload: Workload, kill_after: int | None = None,
               fresh: bool = True) -> dict:
    """Send ``workload`` through the router under ``policy`` (daemons with empty caches unless not ``fresh``);
    the figures as a dict.

    The requests go out in rounds of ``workload.concurrency`` sent at once, each round once the daemons' KV
    events for the one before have settled (:class:`_EventWatch`). vllm-router's ``kv_aware`` cost charges a
    daemon for the requests in flight there, for their prompt tokens until their blocks come back in its KV
    events: while one daemon computes a request's miss, a request whose prefix it holds goes to the other daemon
    and is computed in full there. Sent as each answer came back, whether a request met such a charge came down
    to milliseconds, and a few misrouted early requests could leave both daemons holding most tenants and
    evicting them (``kv_aware`` hit 0.61 to 0.77 of the prompt tokens from one run to the next). In rounds, a
    request meets the same charges in every run: those of its round's earlier requests, none from before.

    ``kill_after``: SIGKILL the last daemon once that many requests have completed; the figures then count
    the requests that failed and those that completed after the kill. Such a run sends each request as soon as
    one in flight is answered (no rounds), so that the kill lands among requests in flight.
    """
    if cluster.used and fresh:
        cluster.start_daemons()
    cluster.used = True
    if policy == SINGLE:
        target = cluster.urls[0]
    else:
        cluster.start_router(policy)
        target = cluster.router_url
    prompts = workload.prompts()
    before = cluster.counters()
    done = 0
    failed: list[str] = []
    after_kill_ok = 0
    killed = threading.Event()
    lock = threading.Lock()
    started = time.monotonic()

    def one(prompt: str) -> None:
        nonlocal done, after_kill_ok
        was_killed = killed.is_set()
        ok, error = _send(target, prompt, workload.max_tokens)
        with lock:
            done += 1
            if not ok:
                failed.append(error)
            elif was_killed:
                after_kill_ok += 1
            if kill_after is not None and done == kill_after and not killed.is_set():
                cluster.kill(len(cluster.procs) - 1)
                killed.set()

    step = len(prompts) if kill_after is not None else workload.concurrency
    with concurrent.futures.ThreadPoolExecutor(workload.concurrency) as pool, _EventWatch(cluster.events) as watch:
        for start in range(0, len(prompts), step):
            list(pool.map(one, prompts[start:start + step]))
            if kill_after is None:
                watch.settle()
    elapsed = time.monotonic() - started
    time.sleep(HEARTBEAT_WAIT_S)
    after = cluster.counters() if kill_after is None else (0.0, 0.0)
    queries, hits = after[0] - before[0], after[1] - before[1]
    cluster.stop_router()
    return {"policy": policy, "requests": len(prompts), "failed": len(failed), "errors": failed[:5],
            "hit_fraction": hits / queries if queries else None, "prompt_tokens": queries,
            "cached_tokens": hits, "seconds": round(elapsed, 2),
            **({"killed_after": kill_after, "completed_after_kill": after_kill_ok} if kill_after is not None else {})}


def token_ids(url: str, prompts: list[str]) -> list[list[int]]:
    """The prompts as a daemon tokenizes them (its ``/tokenize``)."""
    return [_post(url + "/tokenize", {"model": SERVED_NAME, "prompt": p})["tokens"] for p in prompts]


def add_parser(sub) -> None:
    from ringstream.daemon.cli import _DefaultsHelp

    p = sub.add_parser("cluster", formatter_class=_DefaultsHelp,
                       help="N daemons behind vllm-router: prefix-cache hits by routing policy, and a daemon killed "
                            "mid-run",
                       description="Tenants share long system prompts; each request is one tenant's system prompt "
                                   f"and its own question, {Workload.max_tokens} tokens generated. Policies: "
                                   f"{SINGLE} (one daemon, no router: the reference) and vllm-router's.")
    p.add_argument("--daemons", type=int, default=2, help="daemons")
    p.add_argument("--model", help="model directory (default: the built-in model)")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated: single and vllm-router's")
    p.add_argument("--tenants", type=int, default=Workload.tenants, help="system prompts")
    p.add_argument("--requests", type=int, default=Workload.requests, help="requests per policy")
    p.add_argument("--system-tokens", type=int, default=Workload.system_tokens,
                   help="about this many tokens of system prompt per tenant")
    p.add_argument("--concurrency", type=int, default=Workload.concurrency,
                   help="requests in flight, sent in rounds of this many once the last round's KV events have gone "
                        "quiet (the --kill run: each as one is answered)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per daemon")
    p.add_argument("--kv-cache-bytes", type=int,
                   help=f"each daemon's KV pool (default: {BUILTIN_KV_CACHE_BYTES} with the built-in model, about "
                        "half of what the default tenants' prompts need, else the daemon's own); smaller than all "
                        "tenants' prefixes shows what routing by KV events adds: each daemon holds some tenants")
    p.add_argument("--kill", action="store_true", help="also SIGKILL a daemon mid-run under kv_aware")
    p.add_argument("--json", help="write the figures to this file")


def command(args: argparse.Namespace) -> int:
    if router_command() is None:
        print("ringstream-bench cluster: vllm-router is not installed (pip install vllm-router)", file=sys.stderr)
        return 2
    workload = Workload(tenants=args.tenants, requests=args.requests, system_tokens=args.system_tokens,
                        concurrency=args.concurrency)
    rows = []
    kv_bytes = args.kv_cache_bytes or (BUILTIN_KV_CACHE_BYTES if args.model is None else None)
    serve_args = ("--kv-cache-bytes", str(kv_bytes)) if kv_bytes else ()
    with Cluster(args.daemons, args.model, serve_args, threads=args.threads) as cluster:
        ideal = ideal_hit_fraction(token_ids(cluster.urls[0], workload.prompts()), _block_size(cluster))
        for policy in args.policies.split(","):
            _log(f"{policy}: {workload.requests} requests, {workload.concurrency} in flight")
            rows.append(run_policy(cluster, policy, workload))
        if args.kill:
            _log("kv_aware with the last daemon SIGKILLed mid-run")
            rows.append(run_policy(cluster, "kv_aware", workload, kill_after=workload.requests // 3) | {
                "policy": "kv_aware+kill"})
    print(f"{args.daemons} daemons, {workload.tenants} tenants x ~{workload.system_tokens}-token system prompts, "
          f"{workload.requests} requests, {workload.concurrency} in flight")
    print(f"{'policy':<16} {'hit fraction':>12} {'of ideal':>9} {'failed':>7} {'seconds':>8}")
    print(f"{'ideal':<16} {ideal:>12.3f} {1.0:>9.2f} {'':>7} {'':>8}")
    for row in rows:
        frac = row["hit_fraction"]
        print(f"{row['policy']:<16} {'' if frac is None else f'{frac:.3f}':>12} "
              f"{'' if frac is None else f'{frac / ideal:.2f}':>9} {row['failed']:>7} {row['seconds']:>8}")
        if "completed_after_kill" in row:
            print(f"{'':<16} daemon killed after {row['killed_after']} requests; {row['completed_after_kill']} "
                  f"completed after the kill, {row['failed']} failed")
    if args.json:
        Path(args.json).write_text(json.dumps({"ideal_hit_fraction": ideal, "rows": rows}, indent=2))
    return 0


def _block_size(cluster: Cluster) -> int:
    from ringstream.ipc.client import Client

    with Client(cluster.procs[0].address, timeout_s=5.0) as client:
        return client.status().workers[0].block_size
