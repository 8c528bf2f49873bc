"""How the hosts of a job find each other, and how each learns that another is gone.

`HostRendezvous` is torchrun's static rendezvous (host 0 serves a TCPStore at the master
address, every host's `--node-rank` is its group rank, so ranks are laid out host by host) plus
what a deployment needs to be told in one line: which host never joined, and which was lost.

- **Authenticity**: the store answers whoever reaches its port, so every value graphc writes
  carries an HMAC-SHA256 tag under the job secret (`HostOptions.secret`) over this job's nonce
  (`graphc/job`, host 0's), the key and the value: a value whose tag does not verify is foreign
  (another party wrote it, or hosts disagree on the secret); it is named in one line and never
  acted on. Nothing read from the store is unpickled. torch's own keys (the agents' barrier,
  gloo's address exchange) are not graphc's to tag: the trust model (docs/security.md) says what
  that leaves.
- **Joining**: each host claims its node rank (`graphc/claim/H`, an atomic add: a second command
  with the same `--node-rank` is refused), writes `graphc/joined/H` and waits for every other
  host's key until `--join-timeout`; a host that never came is named (and so is host 0 if its store
  never answers), and so is one whose key is foreign.
- **Liveness**: each host's launcher beats (`graphc/beat/H`, a counter, twice a second) and
  watches the others' counters: a host whose counter stands still for `LOST_SECONDS` without having
  left is lost (its processes were killed, or its network is gone), and so is host 0 when its
  store stops answering. A launcher that stops writes why first (`graphc/left/H`: "ok" or the
  failure), so a host ending normally is never taken for a lost one. The watch runs in the
  launchers, not in the ranks: a host whose ranks are idle (a server between requests) still
  learns of a lost host within `LOST_SECONDS` and stops its ranks.
- **Leaving**: host 0's launcher serves the store, so it waits (at most `LOST_SECONDS`) for the
  other hosts to leave before it exits.

Counters, not clocks: the hosts' clocks need not agree.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import socket
import threading
import time
from datetime import timedelta
from typing import Callable

from torch.distributed import PrefixStore, TCPStore
# The agents' exit barrier (torch is pinned exactly; `HostRendezvous.leave` says why it is joined).
from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo, RendezvousStoreInfo
from torch.distributed.elastic.utils.store import _barrier_nonblocking

from graphc.errors import GraphcError
from graphc.runtime.hosts import NO_SECRET, SECRET_ENV, HostLayout, HostOptions

logger = logging.getLogger(__name__)

BEAT_SECONDS = 0.5
LOST_SECONDS = 10.0
"""A host whose beat stands still this long is lost. Long against a beat (a launcher busy on a
loaded host still beats), short against the 30 s within which the others must stop."""
STORE_SECONDS = 5.0
"""A store operation's timeout once every host has joined."""
RUN_ID = "graphc"
"""The agents' key prefix: the same on every host (the store is the job's own, at its port)."""


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def _key(kind: str, host: int) -> str:
    return f"graphc/{kind}/{host}"


JOB_KEY = "graphc/job"
"""Host 0's nonce for this job: tags from an earlier job under the same secret do not verify."""


class Seal:
    """Tags graphc's store values with the job secret, and checks them on read."""

    def __init__(self, secret: str, job: str):
        self._secret, self._job = secret.encode(), job

    def _tag(self, key: str, value: str) -> str:
        message = "\0".join((self._job, key, value)).encode()
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def seal(self, key: str, value: str) -> str:
        return f"{self._tag(key, value)}:{value}"

    def open(self, key: str, raw: bytes) -> str | None:
        """The value stored at `key`, or None where its tag is not this job's."""
        tag, sep, value = raw.decode(errors="replace").partition(":")
        return value if sep and hmac.compare_digest(tag, self._tag(key, value)) else None


def foreign(key: str, endpoint: str) -> str:
    return (f"{key} in the rendezvous store at {endpoint} does not carry this job's tag: another party wrote it, "
            "or the hosts were given different job secrets")


def _listening_socket(addr: str, port: int) -> int:
    """A socket listening at `addr` alone (TCPStore's own server listens on every interface): its fd."""
    family, _, _, _, address = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
        return sock.detach()  # the store's server owns it from here


class HostRendezvous(RendezvousHandler):
    """The rendezvous of host `options.node_rank` among `layout.hosts`, registered with the agent
    as `backend`; `on_lost(message)` is called once (from the watch thread) when another host is
    lost or fails."""

    def __init__(self, options: HostOptions, layout: HostLayout, backend: str, on_lost: Callable[[str], None]):
        self.options, self.layout, self.backend, self.on_lost = options, layout, backend, on_lost
        self.host = options.node_rank
        if options.secret is None:
            raise GraphcError(NO_SECRET)
        self.store: TCPStore | None = None
        self.seal: Seal | None = None
        self.watch: HostWatch | None = None

    def get_backend(self) -> str:
        return self.backend

    @property
    def use_agent_store(self) -> bool:
        return True  # the ranks' process group bootstraps from the agents' store

    def next_rendezvous(self) -> RendezvousInfo:
        self.store = self._connect()
        deadline = time.monotonic() + self.options.join_timeout
        if self.store.add(_key("claim", self.host), 1) != 1:
            raise GraphcError(f"{self.layout.describe(self.host)} has already joined the job at "
                              f"{self.options.endpoint}: another `--node-rank {self.host}` command runs; give each "
                              "host its own --node-rank")
        if self.host == 0:
            self.store.set(JOB_KEY, secrets.token_hex(16))
        self._wait_for(lambda h: h != 0 or self.store.check([JOB_KEY]), deadline)
        # Taken unchecked: a nonce that is not host 0's makes every tag fail, which the join names.
        self.seal = Seal(self.options.secret, self.store.get(JOB_KEY).decode(errors="replace"))
        for kind, value in (("beat", "0"), ("joined", "1")):  # the beat first: once joined, it is there to read
            self.store.set(_key(kind, self.host), self.seal.seal(_key(kind, self.host), value))
        self._wait_for(self._joined, deadline)
        self.watch = HostWatch(self.options, self.layout, self.seal, self.on_lost)
        return RendezvousInfo(PrefixStore(RUN_ID, self.store), self.host, self.layout.hosts,
                              RendezvousStoreInfo(self.options.master_addr, self.options.master_port))

    def _wait_for(self, joined: Callable[[int], bool], deadline: float) -> None:
        """Until `joined(h)` for every host h; past `deadline`, GraphcError naming those that never came."""
        missing = list(range(self.layout.hosts))
        while missing := [h for h in missing if not joined(h)]:
            if time.monotonic() > deadline:
                names = ", ".join(self.layout.describe(h) for h in missing)
                raise GraphcError(f"{names} never joined within {self.options.join_timeout:g} s (rendezvous at "
                                  f"{self.options.endpoint}); start `--node-rank {missing[0]}` there, or raise "
                                  "--join-timeout")
            time.sleep(0.05)

    def _joined(self, host: int) -> bool:
        """Whether `host` has joined; a join key that is not this job's stops the join (a host given
        another secret, or a party without it posing as a host)."""
        key = _key("joined", host)
        if not self.store.check([key]):
            return False
        if self.seal.open(key, self.store.get(key)) is None:
            raise GraphcError(f"{foreign(key, self.options.endpoint)}: give every host the same job secret "
                              f"({SECRET_ENV} or --job-secret-file), and keep the rendezvous port private")
        return True

    def _connect(self) -> TCPStore:
        addr, port = self.options.master_addr, self.options.master_port
        timeout = timedelta(seconds=self.options.join_timeout)
        if self.host == 0:
            try:
                listening = _listening_socket(addr, port)
            except OSError as e:
                raise GraphcError(f"cannot serve the rendezvous at {self.options.endpoint}: {e.strerror or e}; "
                                  "--master-addr must be an address of host 0, and --master-port free there") from None
            try:
                # Not multi-tenant: a server already on this port in this process is another job's, with its keys.
                return TCPStore(addr, port, None, True, timeout, wait_for_workers=False, master_listen_fd=listening)
            except Exception as e:  # c10d's DistNetworkError / RuntimeError
                with contextlib.suppress(OSError):  # unless the server took it before it failed
                    os.close(listening)
                raise GraphcError(f"cannot serve the rendezvous at {self.options.endpoint}: {_first_line(e)}; "
                                  "choose another --master-port") from None
        # Wait for host 0's store here rather than in TCPStore's own retries, which log each try.
        deadline = time.monotonic() + self.options.join_timeout
        while True:
            try:
                socket.create_connection((addr, port), timeout=1.0).close()
                break
            except OSError as e:
                if time.monotonic() > deadline:
                    raise GraphcError(f"{self.layout.describe(0)} did not answer at {self.options.endpoint} within "
                                      f"{self.options.join_timeout:g} s ({e.strerror or e})") from None
                time.sleep(0.1)
        return TCPStore(addr, port, None, False, timeout)

    def leave(self, reason: str, agent_exited_normally: bool) -> None:
        """Tell the other hosts this one stops, and why ("ok" or the failure); stop watching.

        The agents wait for one another when their ranks have all succeeded (torchelastic's exit
        barrier, up to 300 s). An agent that stopped otherwise (a signal, a failure) never comes
        to it, so a host whose ranks ended normally would wait there in vain (a server's
        followers, when its leader's host is stopped by SIGTERM): such a host checks in for it.
        """
        if self.watch is None:
            return
        self.watch.leave(reason)
        if not agent_exited_normally:
            try:
                _barrier_nonblocking(PrefixStore(RUN_ID, self.store), self.layout.hosts, _TERMINAL_STATE_SYNC_ID)
            except Exception:
                pass  # host 0's store is gone: nobody waits on it
        if self.host == 0:  # the store lives in this process: keep it up until the others are done with it
            self.watch.wait_for_others(LOST_SECONDS)
        # The agent's handler registry keeps this handler: drop the connections (on host 0 the
        # server, which closes with its last reference), so the port is free for the next job.
        self.store = self.watch.store = None

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return RUN_ID

    def shutdown(self) -> bool:
        return True  # the agent calls it before the launcher judges a failure: `leave` stops the watch


class HostWatch:
    """The beat of this host and the watch over the others (a daemon thread, its own store
    connection so the agent's is never shared across threads). Every value it reads must carry
    the job's tag (`seal`); one that does not is named once and ignored."""

    def __init__(self, options: HostOptions, layout: HostLayout, seal: Seal, on_lost: Callable[[str], None]):
        self.host, self.layout, self.seal, self.on_lost = options.node_rank, layout, seal, on_lost
        self.endpoint = options.endpoint
        self.store = TCPStore(options.master_addr, options.master_port, None, False, timedelta(seconds=STORE_SECONDS))
        self.lost: str | None = None
        """What was lost, once known: the message the launcher reports."""
        self.gone: set[int] = set()
        """Hosts known lost (they will never leave)."""
        now = time.monotonic()
        self._seen = {h: (-1, now) for h in range(layout.hosts) if h != self.host}
        self._beats = 0
        self._foreign: set[str] = set()
        self._answered = now
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="graphc-host-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(BEAT_SECONDS):
            with self._lock:
                if self._stopped.is_set():
                    return
                verdict = self._look()
            if verdict is not None:
                self.lost = verdict
                self._stopped.set()
                self.on_lost(verdict)
                return

    def _read(self, kind: str, host: int) -> str | None:
        """`graphc/kind/host`'s value if it is set and this job's (a foreign one is named once)."""
        key = _key(kind, host)
        if not self.store.check([key]):
            return None
        value = self.seal.open(key, self.store.get(key))
        if value is None and key not in self._foreign:
            self._foreign.add(key)
            logger.warning("ignored %s", foreign(key, self.endpoint))
        return value

    def _beat_count(self, host: int) -> int:
        """The host's latest beat (-1 before any that is this job's)."""
        value = self._read("beat", host)
        return int(value) if value is not None else -1

    def _look(self) -> str | None:
        """One beat: ours out, the others' in; what was lost, if anything."""
        now = time.monotonic()
        try:
            self._beats += 1
            self.store.set(_key("beat", self.host), self.seal.seal(_key("beat", self.host), str(self._beats)))
            for host, (count, since) in self._seen.items():
                if since == float("inf"):
                    continue  # ended normally
                reason = self._read("left", host)
                if reason is not None and reason != "ok":
                    return f"{self.layout.describe(host)} stopped: {reason}"
                if reason == "ok":
                    self._seen[host] = (count, float("inf"))  # ended normally: never lost
                    continue
                latest = self._beat_count(host)
                if latest > count:  # only a newer beat is a sign of life: an old one replayed is not
                    self._seen[host] = (latest, now)
                elif now - since > LOST_SECONDS:
                    self.gone.add(host)
                    return (f"{self.layout.describe(host)} was lost: no sign of it for {now - since:.0f} s "
                            "(its processes died or its network is gone)")
            self._answered = now
        except Exception:  # the store is served by host 0's launcher: it is gone, or unreachable
            if now - self._answered > LOST_SECONDS:
                return (f"{self.layout.describe(0)} was lost: its rendezvous store has not answered for "
                        f"{now - self._answered:.0f} s")
        return None

    def verdict(self) -> str | None:
        """After a rank of this host failed: a lost host, if that is what the failure was. Waits
        until every other host has beaten since (or left), or one is lost."""
        with self._lock:
            try:
                counts = {host: self._beat_count(host) for host in self._seen}
            except Exception:
                counts = {}  # host 0's store is gone: the watch will say so
        while self.lost is None and not self._stopped.is_set():
            if counts and all(seen == float("inf") or count > counts[host]
                              for host, (count, seen) in self._seen.items()):
                return None
            time.sleep(BEAT_SECONDS / 2)
        return self.lost

    def wait_for_others(self, seconds: float) -> None:
        """Until every other host not known lost has left (at most `seconds`)."""
        deadline = time.monotonic() + seconds
        waiting = [h for h in self._seen if h not in self.gone]
        while waiting and time.monotonic() < deadline:
            try:
                waiting = [h for h in waiting if self._read("left", h) is None]
            except Exception:
                return
            time.sleep(0.05)

    def leave(self, reason: str) -> None:
        with self._lock:
            self._stopped.set()
            try:
                self.store.set(_key("left", self.host), self.seal.seal(_key("left", self.host), reason))
            except Exception:
                pass  # host 0's store is gone: nobody is left to tell
