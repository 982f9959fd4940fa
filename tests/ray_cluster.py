"""A real local Ray cluster for the tests: a head and two worker nodes.

Each node is its own `ray start --block` process (its own raylet, object
store and workers) with its own loopback address (127.0.0.10 for the head,
127.0.0.11 and .12 for the nodes) and its own temp dir (as on machines of
their own: nodes sharing one pick the same socket names when they start
at once), in a process group of its own, so a test can kill one node's
raylet and teardown can kill each node whole (never `ray stop`, which
stops every Ray on the machine).  The worker nodes start side by side.
No node runs Ray's log monitor: it forwards workers' output to drivers,
and the fronts join with log_to_driver off (the logs stay in the files).
Only the two worker nodes have session slots (`sessiond_slots`), two
each, so a handful of sessions lands on both.  The head checks nodes'
health every 0.5 s, so a killed node is noticed in seconds.  The cluster
requires Ray's token authentication (`token_file`, `auth_env()`).

Ray binds some of its ports on every interface (the GCS and the raylet
on `::`, an agent on 0.0.0.0) whatever --node-ip-address says, so as root
every node runs in a network namespace of the suite's own (`LoopbackNetns`)
where only `lo` is up: nothing of the test cluster can be reached from, or
reach, another machine.  Whatever talks to the cluster (the fronts under
test, tests/ray_contract_child.py, tests/ray_other_front.py) is started in
the same namespace (`enter`, a command prefix); the tests reach the fronts
over their Unix sockets, which a network namespace does not divide.

Started once per test run, by tests/test_cluster.py (all the Ray tests
are there) and stopped when that module is done.  No Ray installed: the
test fails saying what to install; it is never skipped.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from harness import env_for_children

__all__ = ["HEALTH_ENV", "NODE_IPS", "LoopbackNetns", "RayCluster"]

_INSTALL_HINT = "Ray is not installed: pip install -e '.[cluster]' (make test does)"
HEAD_IP = "127.0.0.10"
NODE_IPS = ("127.0.0.11", "127.0.0.12")
SLOTS = 2
# Ray's own settings (RAY_<name>), read by the head's GCS: how soon a dead
# node is declared dead.  docs/cluster.md (Set-up) names them.
HEALTH_ENV = {
    "RAY_health_check_initial_delay_ms": "0",
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_timeout_ms": "500",
    "RAY_health_check_failure_threshold": "3",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LoopbackNetns:
    """A network namespace with only `lo` up, held open by a sleeping
    process of its own; `enter` runs a command in it.  Not root (no
    namespaces to make): `enter` is empty and everything runs as before,
    on loopback addresses of the machine's own namespace."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.enter: list[str] = []
        if os.geteuid() != 0:
            return
        self.proc = subprocess.Popen(
            ["unshare", "--net", "sh", "-c", "ip link set lo up && echo up && exec sleep infinity"],
            stdout=subprocess.PIPE, start_new_session=True,
        )
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != b"up":
            self.close()
            raise RuntimeError("could not make a network namespace with lo up (unshare --net, ip link)")
        self.enter = ["nsenter", f"--net=/proc/{self.proc.pid}/ns/net", "--"]

    @property
    def inode(self) -> int | None:
        """The namespace's identity (what /proc/PID/ns/net of its members stats to)."""
        return None if self.proc is None else os.stat(f"/proc/{self.proc.pid}/ns/net").st_ino

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


class RayCluster:
    def __init__(self, slots: int = SLOTS, netns: LoopbackNetns | None = None) -> None:
        self.slots = slots
        self.netns = netns
        # Before any command that talks to the cluster (see the module's docstring).
        self.enter: list[str] = netns.enter if netns is not None else []
        self.ray = Path(sys.executable).parent / "ray"
        if not self.ray.exists():
            found = shutil.which("ray")
            if found is None:
                pytest.fail(_INSTALL_HINT, pytrace=False)
            self.ray = Path(found)
        try:
            import ray  # noqa: F401
        except ImportError:
            pytest.fail(_INSTALL_HINT, pytrace=False)
        # Short: Ray puts Unix sockets below it.
        self.root = Path(tempfile.mkdtemp(prefix="sdray-", dir="/tmp"))
        # Token authentication, as a cluster anyone can reach must have:
        # every node starts with it, and only those holding the token (the
        # fronts: `[cluster] auth_token_file`) may call anything.
        self.token_file = self.root / "auth_token"
        self.token_file.write_text(secrets.token_hex(32))
        self.token_file.chmod(0o600)
        self.port = _free_port()
        self.address = f"{HEAD_IP}:{self.port}"
        self.nodes: dict[str, subprocess.Popen[bytes]] = {}
        try:
            self._start(HEAD_IP, "--head", f"--port={self.port}", "--include-dashboard=false")
            self.start_node(*NODE_IPS)
        except BaseException:
            self.close()
            raise

    def start_node(self, *ips: str) -> None:
        """Worker nodes with session slots (again, after `kill_node`), all
        started, then each waited for."""
        logs = {ip: self._launch(ip, f"--address={self.address}", f"--resources={{\"sessiond_slots\": {self.slots}}}")
                for ip in ips}
        for ip, log in logs.items():
            self._wait_started(ip, log)

    def _start(self, ip: str, *args: str) -> None:
        self._wait_started(ip, self._launch(ip, *args))

    def _launch(self, ip: str, *args: str) -> Path:
        log = self.root / f"{ip}.log"
        log.unlink(missing_ok=True)
        # The head's is the root; a worker node's is named by its last
        # octet (short: Ray's Unix sockets are below it).
        temp = self.root if "--head" in args else self.root / ip.rsplit(".", 1)[1]
        temp.mkdir(exist_ok=True)
        # The tests' handlers (tests/fixture_handlers.py) are importable on
        # every node, as an operator's own handlers must be installed there.
        env = {**env_for_children(), **HEALTH_ENV, **self.auth_env(), "RAY_USAGE_STATS_ENABLED": "0"}
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [*self.enter, str(self.ray), "start", "--block", f"--node-ip-address={ip}", "--num-cpus=1",
                 "--object-store-memory=80000000", "--disable-usage-stats", "--include-log-monitor=false",
                 f"--temp-dir={temp}", *args],
                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            )
        self.nodes[ip] = proc
        return log

    def auth_env(self) -> dict[str, str]:
        """The environment that lets a process of the tests join the cluster."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.token_file)}

    def _wait_started(self, ip: str, log: Path) -> None:
        proc = self.nodes[ip]
        deadline = time.monotonic() + 60
        while b"Ray runtime started" not in log.read_bytes():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray start on {ip} failed:\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.1)

    def raylet(self, ip: str) -> psutil.Process:
        for child in psutil.Process(self.nodes[ip].pid).children(recursive=True):
            if child.name() == "raylet" or "raylet" in " ".join(child.cmdline()[:1]):
                return child
        raise AssertionError(f"no raylet for {ip}")

    def kill_node(self, ip: str) -> None:
        """What a machine's crash does to its Ray: everything on it dies at
        once, the raylet first.  (Its processes are listed before: once the
        raylet is dead its workers, the node host among them, are no longer
        its descendants, and would live on for a while on their own.)"""
        members = self._members(self.nodes[ip])
        self.raylet(ip).kill()
        self._kill_group(self.nodes[ip], members)

    @staticmethod
    def _members(proc: subprocess.Popen[bytes]) -> list[psutil.Process]:
        try:
            return [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def _kill_group(self, proc: subprocess.Popen[bytes], members: list[psutil.Process] | None = None) -> None:
        """SIGKILL to the node's group and every descendant (some leave
        the group): a node's processes die as a machine's do, at once."""
        if members is None:
            members = self._members(proc)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for p in members:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        proc.wait(timeout=30)
        psutil.wait_procs(members, timeout=30)

    def close(self, keep_logs: bool = False) -> None:
        """Kill every node; `keep_logs`: leave the temp dir (each node's
        log and Ray's session_*/logs, the node hosts' among them) for a
        failure to be read, and say where on stderr."""
        for ip in reversed(list(self.nodes)):
            self._kill_group(self.nodes[ip])
        if keep_logs:
            sys.stderr.write(f"\nray_cluster: a test failed; the nodes' logs stay in {self.root}\n")
            return
        shutil.rmtree(self.root, ignore_errors=True)
