"""Start the ranks of a run, or join the ones torchrun started; never hang on a dead rank.

Two ways in:

* under ``torchrun`` (one node or many): every process is a rank already; the
  process group comes from torchrun's environment (``env://``) and torchrun's agent
  stops all ranks when one fails;
* otherwise the calling process becomes a driver and spawns the n ranks on this host
  (``LocalRanks``). The driver joins no collective: it sends commands over queues and
  reads replies (and rank 0's streamed tokens), so an idle run never trips a
  collective timeout and a failed rank is always seen. A rank that raises sends its
  traceback (a lost peer: the one line naming it) before exiting; a rank that dies is
  seen by the driver (its exit code) and by its peers (gloo reports the closed
  connection), and every collective has ``timeout_s``.

A server under torchrun needs both (``JoinedRanks``): requests arrive at one process, while
the ranks are torchrun's, on every host. Global rank 0's process becomes the driver: it starts
global rank 0's worker as its child (torchrun's environment inherited, so the child joins the
run's process group as rank 0), listens on a TCP port with a random key, and the child tells the
other ranks where (``share_driver``); each of them connects (``join_driver``) and obeys the
driver's commands as a LocalRanks child does.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener, Pipe, wait
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist

from shardlm.errors import PeerLost, RankFailure, UsageError


def torchrun_env() -> dict[str, int] | None:
    """Rank, world size and local rank when this process is already one rank of a run
    (started by torchrun, or the caller initialised torch.distributed itself), else None."""
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    else:
        return None
    return {
        "rank": rank,
        "world": world,
        "local_rank": int(os.environ.get("LOCAL_RANK", rank)),
        "local_world": int(os.environ.get("LOCAL_WORLD_SIZE", world)),
    }


def cpu_threads(local_world: int) -> int:
    """Cores of this host shared evenly among its ranks (more threads than cores only thrash)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // local_world)


def start_rank(
    device: str,
    threads: int | None,
    *,
    rank: int,
    world: int,
    local_rank: int,
    local_world: int,
    init_method: str | None,
    timeout_s: float,
) -> torch.device:
    """Bind this rank to its device (``resolve_device``: the host's ``local_rank``-th GPU, made
    current, or ``threads`` of its cores, None for an even share) and join the world's process group."""
    if resolve_device(device, local_world) == "cuda":
        torch.cuda.set_device(local_rank)
        out = torch.device("cuda", local_rank)
    else:
        torch.set_num_threads(threads or cpu_threads(local_world))
        out = torch.device("cpu")
    if world > 1:
        init_distributed(rank, world, init_method, out.type, timeout_s)
    return out


def init_distributed(rank: int, world: int, init_method: str | None, device_type: str, timeout_s: float) -> None:
    """Join the world's process group, unless this process already belongs to one (a caller that
    started it, as the test harness does); ``init_method`` None means torch's default (env://)."""
    global _started
    if dist.is_initialized():
        return
    backend = "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"
    kwargs: dict[str, Any] = {}
    if device_type == "cuda":
        kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
    try:
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout_s),
            **kwargs,
        )
    except RuntimeError as e:  # torch's DistStoreError: peers that never came
        if (line := _not_joined(str(e), rank)) is None:
            raise
        raise RankFailure(line) from None
    _started = True
    atexit.register(_end_group)
    if torchrun_env() is not None and world > 1:  # ranks on other hosts: learn which host holds which rank
        here = (socket.gethostname(), _address())
        everyone: list = [None] * world
        dist.all_gather_object(everyone, here)
        HOSTS[:] = everyone


_started = False  # init_distributed started this process's group (not a caller's: the test harness's)
_holders: weakref.WeakSet = weakref.WeakSet()  # what holds that group's mesh: closed at exit (_end_group)


def holds_group(holder) -> None:
    """Have ``holder.close()`` let go of its model and mesh when the process ends, before the group
    shardlm started is destroyed (``_end_group``); an LLM or Trainer built under torchrun."""
    if _started:
        _holders.add(holder)


def _end_group() -> None:
    """At exit, while the interpreter is whole, end the process group shardlm started: close what
    holds its mesh, destroy the group (its subgroups too) and collect them, so that every gloo
    worker thread is joined here, not at interpreter teardown.

    Left to teardown, a worker that is late to drop a finished collective's tensors (under load)
    frees them after the interpreter began finalizing; a tensor whose Python object it outlived
    takes the GIL to free it, which ends the thread there and aborts the process ("terminate called
    without an active exception"; a core dump shows ``~AsyncAllgatherWork`` in gloo's ``runLoop``;
    pytorch issue 190489). Under torchrun that fails a run that succeeded (the two-host tests' flake).
    After an uncaught exception the group is left as it is: a collective still waiting on a lost
    peer would hold its destruction until the timeout. A script that destroyed the group itself
    still has its holders closed and collected: they hold the subgroups."""
    if hasattr(sys, "last_value") or getattr(sys, "last_exc", None) is not None:
        return
    for holder in list(_holders):
        try:
            holder.close()
        except Exception as e:  # the group is still destroyed below
            print(f"shardlm: closing {type(holder).__name__} at exit failed: {e!r}", file=sys.stderr)
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def leave(code: int) -> None:
    """End a torchrun rank's process now, with ``code``, if shardlm started its process group (a
    process the CLI runs starts one only as a torchrun rank; LocalRanks' ranks leave by ``_rank_main``):
    flush the output, then ``os._exit``, skipping exit handlers and interpreter teardown, as those
    ranks do: a lost peer cannot hold the exit up (``_end_group`` is for processes the CLI does
    not own: a user's script that builds an LLM under torchrun)."""
    if not _started:
        return
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


HOSTS: list[tuple[str, str]] = []
"""(hostname, address) of every global rank of a torchrun run that spans processes (set by
``init_distributed``), so that a lost peer can be named by its host and ranks."""


def _address() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "?"


_PEER_LOST = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|Connection refused")
_PEER_ADDRESS = re.compile(r"\[([0-9a-fA-F.:]+)\]:\d+")  # gloo writes "[10.0.0.2]:43210" before or after
_KEYS_TIMEOUT = re.compile(r"wait timeout after (\d+)ms, keys: (.*)", re.S)  # gloo's connect: the missing ranks' keys
_STORE_TIMEOUT = re.compile(r"Timed out after (\d+) seconds waiting for clients\. (\d+)/(\d+) clients joined")


def _not_joined(text: str, rank: int) -> str | None:
    """One line for an ``init_process_group`` that timed out waiting for peers (their host was lost
    during start-up, or they never started), naming them where torch says which; else None."""
    if (m := _KEYS_TIMEOUT.search(text)) is not None:
        seconds, missing = (
            int(m.group(1)) / 1000,
            sorted({int(r) for r in re.findall(r"/(\d+)(?=\s*(?:,|\]|$))", m.group(2))}),
        )
        who = f"ranks {missing}" if missing else "some ranks"
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) if "TORCHELASTIC_RUN_ID" in os.environ else 0
        if per_node and missing:
            nodes = sorted({r // per_node for r in missing})
            who += f" (torchrun node{'s' if len(nodes) > 1 else ''} {', '.join(map(str, nodes))})"
    elif (m := _STORE_TIMEOUT.search(text)) is not None:
        seconds, joined, world = float(m.group(1)), int(m.group(2)), int(m.group(3))
        who = f"{world - joined} of {world} ranks"
    else:
        return None
    return (
        f"rank {rank}: {who} did not join the process group within {seconds:g} s (--timeout): their process or "
        f"host was lost or never started; the run stops (start shardlm on every node, or raise --timeout if "
        f"start-up is that slow)"
    )


_TIMED_OUT = re.compile(r"Timed out waiting (\d+)ms for (send|recv) operation")


def lost_ranks(error: BaseException) -> list[int]:
    """The global ranks of the host a collective's error says is gone ([] where it names none known)."""
    m = _PEER_ADDRESS.search(str(error)) if _PEER_LOST.search(str(error)) else None
    return [r for r, (_, a) in enumerate(HOSTS) if m and a == m.group(1)]


def _host(ranks: list[int], address: str = "?") -> str:
    """'host NAME (ADDRESS, ranks [...])' for the global ranks of one host, or the bare address."""
    if not ranks:
        return f"the peer at {address}"
    name, address = HOSTS[ranks[0]]
    return f"host {name} ({address}, ranks {[r for r, (_, a) in enumerate(HOSTS) if a == address]})"


def relayed_failure(error: BaseException) -> str | None:
    """One line for a shared-memory collective that failed because a peer on this host gave up on a
    lost host (``shm_segment.give_up_everywhere``): that host, as the peer's own line names it; None
    for any other error."""
    lost = getattr(error, "lost", None)
    if not lost or not HOSTS or max(lost) >= len(HOSTS):
        return None
    return f"lost {_host(lost)}, found by a rank of this host that then stopped; the run stops"


def peer_failure(error: BaseException) -> str | None:
    """One line for a collective that failed because a peer rank is gone (its host died, its
    network went down, or it did not answer within the timeout), naming the host and ranks where
    they are known; None for any other error."""
    text = str(error)
    if _PEER_LOST.search(text) is not None:
        m = _PEER_ADDRESS.search(text)
        host = _host(lost_ranks(error), m.group(1) if m else "?")
        return f"lost {host}: its connection closed (the ranks there died or the host went down); the run stops"
    if (m := _TIMED_OUT.search(text)) is not None:
        seconds = int(m.group(1)) / 1000
        others = sorted({h for h, _ in HOSTS} - {socket.gethostname()})
        where = f" (on {', '.join(others)})" if others else ""
        return (
            f"a peer rank{where} did not answer a {m.group(2)} for {seconds:g} s (--timeout): a lost host or a "
            f"network partition; the run stops"
        )
    return None


def resolve_device(device: str, local_world: int) -> str:
    """'cpu' or 'cuda' for a rank of a run with ``local_world`` ranks on this host (see
    EngineConfig.device, TrainConfig.device). Every rank of a host resolves alike, so a run never mixes devices."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    started = dist.get_backend_config() if dist.is_initialized() else None  # e.g. "cpu:gloo,cuda:nccl"
    if device == "auto":
        nccl = started is None or "nccl" in started
        return "cuda" if gpus >= local_world and nccl else "cpu"
    if device == "cuda":
        if gpus < local_world:
            raise UsageError(
                f"device='cuda' with {local_world} rank(s) on this host needs as many GPUs, and it has "
                f"{gpus}; use fewer ranks per host or device='cpu'"
            )
        if started is not None and "nccl" not in started:
            raise UsageError(
                f"device='cuda' but the process group was started with backends {started!r}, "
                f"none of them NCCL; start it with 'nccl' (or 'cpu:gloo,cuda:nccl')"
            )
    return device


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _watch_parent(parent: int) -> None:
    """Exit when the driver is gone (no orphans left holding ports or memory)."""
    while True:
        if os.getppid() != parent:
            os._exit(3)
        time.sleep(0.5)


class DriverLink:
    """A rank's connection to its driver: replies and events out, commands in."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self._send_lock = threading.Lock()  # busy() may send from another thread
        self.closing = False  # the driver said stop for good (its None) while the rank served

    def send(self, kind: str, value: Any) -> None:
        with self._send_lock:
            self.conn.send((kind, value))

    def poll(self, timeout: float) -> list[Any]:
        """Messages waiting from the driver (the first awaited up to ``timeout`` seconds); the
        driver's None (it is closing: LocalRanks.close) sets ``closing`` instead."""
        out: list[Any] = []
        while not self.closing and self.conn.poll(timeout if not out else 0):
            message = self.conn.recv()
            if message is None:
                self.closing = True
            else:
                out.append(message)
        return out


_driver: DriverLink | None = None  # in a rank process that LocalRanks started


def busy(what: str) -> None:
    """Tell this rank's driver that the rank is alive and busy with ``what`` (a compile that
    takes minutes on a small CPU), so that its silence is not taken for a hang. A no-op in
    a process that no LocalRanks driver started."""
    if _driver is not None:
        _driver.send("busy", what)


def _rank_main(fd: int) -> None:
    """A rank process started by LocalRanks (or JoinedRanks): build the worker, then run the
    driver's commands (``obey``)."""
    global _driver
    link = _driver = DriverLink(Connection(fd))
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    code = 1
    try:
        rank, world, init_method, make_worker, args = link.conn.recv()
        try:
            worker = make_worker(rank, world, init_method, *args)
        except BaseException as e:
            link.send(*failure_report(e))
            raise
        code = obey(link, worker, rank)
    except EOFError:
        code = 3  # the driver went away
    except BaseException:
        pass  # the driver has the report
    os._exit(code)  # skip interpreter teardown: peers may already be gone


def obey(link: DriverLink, worker, rank: int) -> int:
    """Say the worker is ready, then run the driver's commands until it says stop (0) or goes
    away (3): ``generate`` (rank 0 streams its tokens), ``serve`` (requests arrive until
    stopped), or any other worker method, called with the command's payload. A failure is sent
    to the driver (``failure_report``) and raised."""
    try:
        link.send("ready", worker.ready_info())
        while (cmd := link.conn.recv()) is not None:
            name, payload = cmd
            if name == "generate":
                stream = (lambda i, tok: link.send("token", (i, tok))) if rank == 0 else None
                link.send("done", worker.generate(payload, stream))
            elif name == "serve":
                worker.serve(link)
                if link.closing:  # the driver is going (a failed rank elsewhere): end quietly
                    return 0
                with contextlib.suppress(OSError):  # a driver that is closing may be gone already
                    link.send("done", None)
            else:  # any other method of the worker, e.g. a benchmark's
                link.send("done", getattr(worker, name)(payload))
    except EOFError:
        return 3
    except BaseException as e:
        with contextlib.suppress(OSError):
            link.send(*failure_report(e))
        raise
    return 0


def failure_report(error: BaseException) -> tuple[str, str]:
    """What a failed rank tells its driver: ("lost", one line) where it lost a peer (the traceback
    of the collective that noticed says nothing more, and the driver waits a moment for the peer's
    own report: ``LocalRanks.cause``), else ("error", the traceback)."""
    if isinstance(error, PeerLost):
        return "lost", str(error)
    if isinstance(error, RuntimeError) and (line := peer_failure(error)) is not None:
        return "lost", line
    return "error", "".join(traceback.format_exception(type(error), error, error.__traceback__))


def share_driver(address: tuple[int, bytes] | None) -> tuple[str, int, bytes]:
    """Under torchrun, collective over the world: global rank 0's worker gives the (port, key) its
    driver listens on (``JoinedRanks``), every rank gets (rank 0's host address, port, key)."""
    box: list = [None if address is None else (HOSTS[0][1] if HOSTS else "?", *address)]
    dist.broadcast_object_list(box, src=0)
    host, port, key = box[0]
    return (os.environ.get("MASTER_ADDR", "127.0.0.1") if host == "?" else host), port, key


def join_driver(where: tuple[str, int, bytes], rank: int, timeout_s: float) -> DriverLink:
    """A torchrun rank's link to the driver that global rank 0's process runs (``share_driver``)."""
    host, port, key = where
    deadline = time.monotonic() + timeout_s
    while True:  # the driver listens before its rank 0 says where; a refused connect is a lost host
        try:
            conn = Client((host, port), authkey=key)
            break
        except OSError as e:
            if time.monotonic() > deadline:
                raise RankFailure(f"rank {rank} cannot reach the driver at {host}:{port} ({e}); the run stops") from e
            time.sleep(0.5)
    conn.send((rank, socket.gethostname(), _address()))
    return DriverLink(conn)


LOST_GRACE_S = 2.0
"""How long a driver whose rank lost a peer waits for that peer's own report (``LocalRanks.cause``)."""


def readable(conns: list[Connection], timeout: float | None = None) -> list[Connection]:
    """The connections among ``conns`` with a message (or EOF) waiting, as ``multiprocessing``'s
    ``wait`` returns them."""
    return cast("list[Connection]", wait(conns, timeout))


def _child_rank(rank: int, world: int, init_method: str, make_worker: Callable, args: tuple):
    """Start a rank as a child process running ``python -m shardlm.launch`` (not
    multiprocessing's spawn, which would re-run the caller's ``__main__`` and demand an ``if
    __name__ == "__main__"``): (the driver's end of its socket pair, the process)."""
    pkg_root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [pkg_root, os.environ.get("PYTHONPATH")]))}
    mine, theirs = Pipe(duplex=True)
    fd = theirs.fileno()
    proc = subprocess.Popen([sys.executable, "-m", "shardlm.launch", str(fd)], pass_fds=[fd], env=env)
    theirs.close()  # so a dead rank reads as end-of-file here
    mine.send((rank, world, init_method, make_worker, args))
    return mine, proc


class LocalRanks:
    """All ranks of a run on this host, as child processes of a driver that never joins a
    collective: it talks to each rank over its own socket pair, so it always sees a rank fail."""

    def __init__(self, world: int, make_worker: Callable, args: tuple, *, timeout_s: float):
        self.world, self.timeout_s = world, timeout_s
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self.conns: list[Connection] = []
        self.procs: dict[int, subprocess.Popen] = {}  # the ranks that are this process's children
        self.hosts: dict[int, tuple[str, str]] = {}  # (hostname, address) of ranks on other hosts
        for rank in range(world):
            conn, self.procs[rank] = _child_rank(rank, world, init_method, make_worker, args)
            self.conns.append(conn)

    def call(self, name: str, payload: Any, on_token: Callable[[int, int], None] | None = None) -> list[Any]:
        """Run ``worker.name(payload)`` on every rank; returns the results in rank order."""
        for conn in self.conns:
            conn.send((name, payload))
        return self.collect("done", on_token=on_token)

    def collect(self, kind: str, *, on_token: Callable[[int, int], None] | None = None) -> list[Any]:
        """Wait for one ``kind`` reply from every rank; raise RankFailure if one fails, dies or stalls.

        A rank that stops answering gets ``timeout_s`` (the collective timeout) plus a
        margin, since the ranks themselves then fail with a more precise message; a rank
        that says it is busy (``busy()``, while it compiles) has not stopped answering.
        """
        got: dict[int, Any] = {}
        last_news = time.monotonic()
        while len(got) < self.world:
            pending = [c for r, c in enumerate(self.conns) if r not in got]
            ready = readable(pending, timeout=1.0)
            if not ready and time.monotonic() - last_news > self.timeout_s + 30:
                missing = sorted(set(range(self.world)) - set(got))
                raise RankFailure(f"ranks {missing} sent nothing for {self.timeout_s + 30:.0f}s; stopping all ranks")
            for conn in ready:
                rank = self.conns.index(conn)
                try:
                    what, value = conn.recv()
                except EOFError:
                    raise RankFailure(f"{self.died(rank)}; stopping all ranks") from None
                last_news = time.monotonic()
                if what in ("error", "lost"):
                    raise RankFailure(self.cause(rank, what, value))
                if what == "token":
                    if on_token is not None:
                        on_token(*value)
                elif what == "busy":
                    pass  # news enough: the rank is alive (see busy())
                elif what == kind:
                    got[rank] = value
                else:
                    raise RankFailure(f"rank {rank} sent {what!r} while the driver waited for {kind!r}")
        return [got[r] for r in range(self.world)]

    def cause(self, rank: int, what: str, report: str) -> str:
        """Why the run failed, from rank ``rank``'s first report: its error; or, where it only lost
        a peer (``what`` "lost"), that peer's own error or death if either comes within
        ``LOST_GRACE_S``: it says why (a killed rank, a bug), where the report only says that."""
        if what == "lost":
            others = [c for r, c in enumerate(self.conns) if r != rank]
            deadline = time.monotonic() + LOST_GRACE_S
            while others and (left := deadline - time.monotonic()) > 0:
                for conn in readable(others, timeout=left):
                    peer = self.conns.index(conn)
                    try:
                        kind, value = conn.recv()
                    except (EOFError, OSError):
                        return self.died(peer)
                    if kind == "error":
                        return f"rank {peer} failed:\n{value.rstrip()}"
                    if kind == "lost":  # it only saw the loss too: its exit that follows is not the cause
                        others.remove(conn)
        return f"rank {rank} failed:\n{report.rstrip()}"

    def died(self, rank: int) -> str:
        """What the driver says of a rank whose link ended."""
        return f"rank {rank} died ({self._exit_status(rank)})"

    def _exit_status(self, rank: int) -> str:
        if rank not in self.procs:  # a rank of another process (torchrun's): only its link is seen
            if rank not in self.hosts:
                return "connection lost"
            name, address = self.hosts[rank]
            theirs = sorted(r for r, h in self.hosts.items() if h == (name, address))
            return f"connection lost: host {name} ({address}, ranks {theirs}) gone or cut off"
        try:
            code = self.procs[rank].wait(timeout=2)
        except subprocess.TimeoutExpired:
            return "connection lost"
        return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"

    def close(self) -> None:
        """Stop every rank: ask politely, then kill what is left (nothing outlives the driver)."""
        for conn in self.conns:
            with contextlib.suppress(OSError, ValueError):
                conn.send(None)
        deadline = time.monotonic() + 5
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for conn in self.conns:
            conn.close()


class JoinedRanks(LocalRanks):
    """The ranks of a torchrun run, driven from global rank 0's process (a server: requests arrive
    there). Rank 0's worker is this process's child; the others connect over TCP from their own
    processes, on any host (``share_driver``, ``join_driver``). Commands, replies and failures are
    LocalRanks'."""

    def __init__(self, world: int, make_worker: Callable, args: tuple, *, timeout_s: float):
        self.world, self.timeout_s = world, timeout_s
        key = os.urandom(32)
        listener = Listener(("0.0.0.0", 0), authkey=key)  # any interface: the other hosts' ranks connect
        conn, proc = _child_rank(0, world, "env://", make_worker, (*args, (listener.address[1], key)))
        self.procs = {0: proc}
        self.hosts: dict[int, tuple[str, str]] = {}
        joined: dict[int, Connection] = {0: conn}

        def accept() -> None:
            while len(joined) < world:
                try:
                    c = listener.accept()
                except AuthenticationError:  # a stranger on the port (no key): ignore it, keep waiting
                    continue
                except OSError:  # the listener closed: every rank is in, or the wait ended
                    return
                try:
                    rank, name, address = c.recv()
                except (EOFError, OSError):  # it left before saying which rank it is
                    continue
                self.hosts[rank] = (name, address)
                joined[rank] = c

        threading.Thread(target=accept, name="shardlm-join", daemon=True).start()
        deadline = time.monotonic() + timeout_s + 30
        while len(joined) < world:
            time.sleep(0.2)
            if proc.poll() is not None or time.monotonic() > deadline:
                listener.close()
                why = f"ranks {sorted(set(range(world)) - set(joined))} never reached the driver in {timeout_s + 30:.0f} s"
                if proc.poll() is not None:
                    why = f"rank 0 ended ({self._exit_status(0)}) before every rank joined"
                    with contextlib.suppress(EOFError, OSError):  # its traceback, if it sent one, says why
                        while readable([conn], 0):
                            what, value = conn.recv()
                            if what in ("error", "lost"):
                                why = f"rank 0 failed:\n{value.rstrip()}"
                self.conns = list(joined.values())
                self.close()
                raise RankFailure(f"{why}; stopping")
        listener.close()
        self.conns = [joined[r] for r in range(world)]


if __name__ == "__main__":
    # Run as the imported module, not as __main__: busy() and everything else that imports
    # shardlm.launch must see this rank's _driver.
    from shardlm.launch import _rank_main as rank_main

    rank_main(int(sys.argv[1]))
