"""Soak-and-fault harness: a real ComfyUI server driven through its HTTP API for hundreds of prompts, with faults.

Opt-in (needs a ComfyUI checkout; CPU ranks, tiny random-weight models, so it runs on a 2-core machine)::

    # COMFYUI_DIR: a ComfyUI checkout; COMFYUI_PYTHON: the Python that runs it (tests/comfyui/README.md)
    $COMFYUI_PYTHON tests/comfyui/soak.py --prompts 300 --rng 1 --out soak-report.json --summary results/soak/summary.json

It starts the server itself (``test_comfyui_server.serve``: ``main.py --cpu`` with a private ``--base-directory`` whose
custom_nodes hold the pack, the suite's test-only nodes and ``soak_nodes.py``; the models of
``make_soak_models.py``), runs the schedule of ``soak_cases.py`` (mix prompts beside their stock twins, pairs
queued at once by two clients, and every fault kind), and writes a JSON report and a short text summary beside it.

What it holds every case to (the requirement's "must hold" list):

* a mix prompt completes, and each PatchRay output equals its stock twin within the case's bound;
* a fault's prompt ends within ``--error-bound`` seconds of the fault (or of being queued, for refusals) as the case
  expects: interrupted, or an error whose message names the cause (``Case.words``) and carries nothing of Ray's
  wrapping; the server never dies (a dead server is a failure, and is started again so the soak goes on);
* the prompt after every fault works;
* ComfyUI's and each rank's resident memory stay flat (growth per 100 prompts reported), and Ray's object store does
  not fill (read every ``--probe-every`` cases by the test-only probe node);
* after every stop of the server (SIGKILL, SIGTERM and the final stop) no process of its session, no listener of
  those processes, no new /dev/shm entry and no PatchRay rendezvous folder in its private TMPDIR is left, within
  ``--leftover-bound`` seconds; and the next start works.
"""

from __future__ import annotations

import argparse
import base64
import collections
import contextlib
import json
import os
import platform
import random
import re
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Dict, List, Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

import soak_cases  # noqa: E402  (a sibling module; the harness runs as a script or from the opt-in test)
from soak_cases import FAULT_KINDS, Case, schedule  # noqa: E402

#: what a user's error message must not carry: Ray's wrapping, a traceback, terminal codes
RAY_NOISE = ("Traceback", "\x1b[", "ray::", "actor_id", "ActorID(", "RayTaskError", "pid=", "patchray-import")


# ------------------------------------------------------------------------------------------------------ HTTP


def _get(url: str, timeout: float = 30):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        body = r.read()
        return json.loads(body) if body.strip() else {}


def _post(url: str, payload: dict, timeout: float = 60):
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body = r.read()
            return r.status, json.loads(body) if body.strip() else {}
    except urllib.error.HTTPError as exc:
        body = exc.read() or b"{}"
        try:
            return exc.code, json.loads(body)
        except ValueError:
            return exc.code, {"error": body.decode(errors="replace")}


class Events:
    """ComfyUI's websocket messages for one client id (a minimal RFC 6455 client on the standard library): the
    ``executing`` and ``progress`` events of each prompt, with the time they arrived."""

    def __init__(self, url: str, client_id: str):
        host, port = url.split("//", 1)[1].split(":")
        self.client_id = client_id
        self.by_prompt: Dict[str, list] = collections.defaultdict(list)
        self.cond = threading.Condition()
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET /ws?clientId={client_id} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
                           f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise ConnectionError("the websocket handshake was refused")
            head += chunk
        if b" 101 " not in head.split(b"\r\n", 1)[0]:
            raise ConnectionError(f"websocket handshake: {head[:100]!r}")
        self._buf = head.split(b"\r\n\r\n", 1)[1]
        self.sock.settimeout(None)
        self.closed = False
        threading.Thread(target=self._read, daemon=True, name=f"ws-{client_id[:6]}").start()

    def _recv(self, n: int) -> bytes:
        while len(self._buf) < n:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("closed")
            self._buf += chunk
        out, self._buf = self._buf[:n], self._buf[n:]
        return out

    def _read(self) -> None:
        parts, opcode = [], None
        try:
            while True:
                b0, b1 = self._recv(2)
                op, fin, n = b0 & 0x0F, b0 & 0x80, b1 & 0x7F
                if n == 126:
                    n = struct.unpack(">H", self._recv(2))[0]
                elif n == 127:
                    n = struct.unpack(">Q", self._recv(8))[0]
                mask = self._recv(4) if b1 & 0x80 else None
                data = self._recv(n)
                if mask:
                    data = bytes(c ^ mask[i % 4] for i, c in enumerate(data))
                if op == 8:
                    break
                if op == 9:  # ping -> pong (client frames are masked)
                    m = os.urandom(4)
                    self.sock.sendall(bytes([0x8A, 0x80 | len(data)]) + m + bytes(c ^ m[i % 4] for i, c in enumerate(data)))
                    continue
                if op in (1, 2):
                    opcode, parts = op, [data]
                elif op == 0:
                    parts.append(data)
                if fin and opcode == 1:
                    self._message(b"".join(parts))
        except (OSError, ConnectionError, ValueError):
            pass
        finally:
            self.closed = True
            with self.cond:
                self.cond.notify_all()

    def _message(self, raw: bytes) -> None:
        try:
            msg = json.loads(raw)
        except ValueError:
            return
        data = msg.get("data") or {}
        pid = data.get("prompt_id") if isinstance(data, dict) else None
        if pid:
            with self.cond:
                self.by_prompt[pid].append((time.monotonic(), msg.get("type"), data))
                self.cond.notify_all()

    def wait(self, pid: str, pred, timeout: float) -> Optional[float]:
        """Wait until an event of prompt ``pid`` satisfies ``pred(type, data)``; its arrival time, or ``None`` when the
        prompt ended (or ``timeout`` passed) first."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for t, kind, data in self.by_prompt.get(pid, ()):
                    if pred(kind, data):
                        return t
                if any(k in ("execution_success", "execution_error", "execution_interrupted") for _, k, _ in self.by_prompt.get(pid, ())):
                    return None
                left = deadline - time.monotonic()
                if left <= 0 or self.closed:
                    return None
                self.cond.wait(min(left, 0.5))

    def seen(self, pid: str) -> list:
        with self.cond:
            return list(self.by_prompt.get(pid, ()))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


# ------------------------------------------------------------------------------------------------------ processes


def _psutil():
    import psutil

    return psutil


def session_processes(leader: int) -> list:
    """Every live process of the server's session (the server started them in a session of its own: Ray's daemons and
    workers keep that session, also when re-parented to init)."""
    psutil = _psutil()
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.pid != leader and os.getsid(p.pid) == leader and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (ProcessLookupError, PermissionError, psutil.Error):
            pass
    return out


def _cmd(p) -> str:
    with contextlib.suppress(Exception):
        return " ".join(p.cmdline()) or p.name()
    return ""


def rank_processes(leader: int) -> list:
    return [p for p in session_processes(leader) if "_RankActor" in _cmd(p)]


def named_processes(leader: int, name: str) -> list:
    out = []
    for p in session_processes(leader):
        with contextlib.suppress(Exception):
            if p.name() == name:
                out.append(p)
    return out


def _rss(p) -> Optional[int]:
    with contextlib.suppress(Exception):
        return p.memory_info().rss
    return None


def _listeners(procs) -> List[int]:
    ports = set()
    for p in procs:
        with contextlib.suppress(Exception):
            ports |= {c.laddr.port for c in p.net_connections("inet") if c.status == "LISTEN"}
    return sorted(ports)


def _listening_now() -> set:
    out = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True, timeout=10).stdout if shutil.which("ss") else ""
    return {int(ln.split()[3].rsplit(":", 1)[1]) for ln in out.splitlines() if ln.strip()}


def _shm() -> set:
    with contextlib.suppress(OSError):
        return set(os.listdir("/dev/shm"))
    return set()


def shm_in_use(pids) -> set:
    """The /dev/shm entries the processes ``pids`` map or hold open (names; deleted ones included)."""
    names = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in open(f"/proc/{pid}/maps"):
                if "/dev/shm/" in line:
                    names.add(line.split("/dev/shm/", 1)[1].strip().replace(" (deleted)", ""))
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("/dev/shm/"):
                        names.add(target[len("/dev/shm/"):].replace(" (deleted)", ""))
    return names


def object_store(tmpdir: Path) -> Optional[dict]:
    """Ray's object store as the raylet last wrote it (``debug_state.txt``, every 10 s) in the session under ``tmpdir``:
    capacity, bytes in use, local objects, pinned bytes, spilled bytes."""
    path = tmpdir / "ray" / "session_latest" / "logs" / "debug_state.txt"
    try:
        text = path.read_text(errors="replace")
        age = time.time() - path.stat().st_mtime
    except OSError:
        return None

    def num(pattern):
        m = re.search(pattern, text)
        return float(m.group(1)) if m else None

    total = num(r'"total":\{[^}]*object_store_memory: \[(\d+)\]')  # Ray's resource units: 1e-4 of a byte
    capacity = total / 10000 if total is not None else None
    available = num(r"num bytes available for pulled objects: (\d+)")
    return {"capacity": capacity, "bytes_used": (capacity - available) if capacity is not None and available is not None else None,
            "objects": num(r"num local plasma objects: (\d+)"), "pinned_bytes": num(r"pinned objects size: (\d+)"),
            "spilled_bytes": num(r"num bytes currently spilled: (\d+)"), "age_s": round(age, 1)}


def _held_by_others(name: str, ours: set) -> bool:
    """Whether a live process outside the server's session maps or holds ``/dev/shm/<name>`` (another user's)."""
    path = "/dev/shm/" + name
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) in ours:
            continue
        with contextlib.suppress(OSError):
            if path in open(f"/proc/{pid}/maps").read():
                return True
        with contextlib.suppress(OSError):
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") == path for fd in os.listdir(f"/proc/{pid}/fd")):
                return True
    return False


# ------------------------------------------------------------------------------------------------------ the server


class Server:
    """The ComfyUI server under test, (re)started with ``test_comfyui_server.serve`` on a private base directory and a
    private TMPDIR (Ray's session folders and PatchRay's rendezvous folders land there, apart from other users')."""

    def __init__(self, base: Path, tmpdir: Path, log):
        from test_comfyui_server import serve

        self._serve = serve
        self.base, self.tmpdir, self.log = base, tmpdir, log
        self.stack: Optional[contextlib.ExitStack] = None
        self.url = self.proc = None
        self.events: List[Events] = []
        self.starts = 0
        self.seen_pids: Dict[int, float] = {}  # every session process seen: pid -> create time
        self.seen_ports: set = set()
        self.seen_shm: set = set()  # /dev/shm entries the session's processes were seen holding
        self.stale_rdzv: set = set()  # rendezvous folders a SIGKILLed server could not remove (the next start does)

    def start(self) -> float:
        t0 = time.monotonic()
        saved = os.environ.get("TMPDIR")
        os.environ["TMPDIR"] = str(self.tmpdir)
        try:
            self.stack = contextlib.ExitStack()
            self.url, self.proc = self.stack.enter_context(self._serve(self.base))
        finally:
            if saved is None:
                os.environ.pop("TMPDIR", None)
            else:
                os.environ["TMPDIR"] = saved
        self.starts += 1
        self.events = [Events(self.url, uuid.uuid4().hex) for _ in range(2)]
        self.log(f"server {self.starts} up (pid {self.proc.pid}) in {time.monotonic() - t0:.1f} s")
        return time.monotonic() - t0

    def alive(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            return False
        with contextlib.suppress(Exception):
            _get(self.url + "/system_stats", timeout=20)
            return True
        return False

    def remember(self) -> None:
        """Record the session's processes and their listeners (checked for leftovers after the server stops)."""
        if self.proc is None:
            return
        procs = session_processes(self.proc.pid)
        for p in procs:
            with contextlib.suppress(Exception):
                self.seen_pids[p.pid] = p.create_time()
        self.seen_ports |= set(_listeners(procs))
        self.seen_shm |= shm_in_use([self.proc.pid] + [p.pid for p in procs])

    def stop(self, how: str, bound_s: float) -> dict:
        """Stop the server (``kill9``: SIGKILL of ComfyUI's process alone, as a crash; ``term``: SIGTERM; ``int``: Ctrl-C)
        and report what of its session is left after it, waiting up to ``bound_s`` for Ray's processes to go."""
        self.remember()
        leader = self.proc.pid
        shm_before = self.shm_at_start
        for ev in self.events:
            ev.close()
        t0 = time.monotonic()
        sig = {"kill9": signal.SIGKILL, "term": signal.SIGTERM, "int": signal.SIGINT}[how]
        with contextlib.suppress(ProcessLookupError):
            os.kill(leader, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=60)
        exited = self.proc.poll()
        psutil = _psutil()
        while True:
            left = [p for p in session_processes(leader)]
            left += [p for pid, ct in self.seen_pids.items() if psutil.pid_exists(pid)
                     for p in [_same(pid, ct)] if p is not None and p.pid not in {q.pid for q in left}]
            ports = sorted(self.seen_ports & _listening_now()) if not left else _listeners(left)
            if (not left and not ports) or time.monotonic() - t0 > bound_s:
                break
            time.sleep(0.5)
        clean_after = time.monotonic() - t0
        now_shm = _shm()
        new_shm = sorted(now_shm - shm_before)
        ours_shm = sorted(self.seen_shm & now_shm)  # held by the session's processes at some point, and still there
        rdzv = {p.name for p in self.tmpdir.glob("patchray-rdzv-*")}
        report = {
            "how": how, "exit_status": exited, "seconds_until_clean": round(clean_after, 1) if not left and not ports else None,
            "processes_left": [f"{p.pid} {_cmd(p)[:80]}" for p in left], "ports_left": ports,
            "dev_shm_left": ours_shm, "dev_shm_seen_held": len(self.seen_shm),
            "dev_shm_new_not_ours": sorted(n for n in new_shm if n not in self.seen_shm),
            "rendezvous_folders_left": sorted(rdzv - (self.stale_rdzv if how == "kill9" else set())) if how != "kill9" else [],
            "rendezvous_folders_after_kill9": sorted(rdzv) if how == "kill9" else [],
        }
        if how == "kill9":
            self.stale_rdzv |= rdzv  # a SIGKILLed driver cannot remove its folder: the next cluster start must
        # serve()'s own clean-up (SIGKILL of the session) runs now; whatever was left is recorded above
        with contextlib.suppress(Exception):
            self.stack.close()
        log_copy = self.base / f"server-{self.starts}.log"
        with contextlib.suppress(OSError):
            shutil.copy(self.base / "server.log", log_copy)
        self.proc = None
        self.seen_pids, self.seen_ports, self.seen_shm = {}, set(), set()
        return report

    @property
    def shm_at_start(self) -> set:
        return self._shm_at_start

    def snapshot_shm(self) -> None:
        self._shm_at_start = _shm()


def _same(pid: int, create_time: float):
    psutil = _psutil()
    with contextlib.suppress(Exception):
        p = psutil.Process(pid)
        if abs(p.create_time() - create_time) < 1e-3 and p.status() != psutil.STATUS_ZOMBIE:
            return p
    return None


# ------------------------------------------------------------------------------------------------------ the soak


def _setup_base(base: Path, comfy_dir: str, python: str, log) -> None:
    from test_comfyui_server import _install_test_conditioning_node

    (base / "custom_nodes").mkdir(parents=True, exist_ok=True)
    link = base / "custom_nodes" / "PatchRay"
    if not link.exists():
        os.symlink(ROOT, link)
    _install_test_conditioning_node(base / "custom_nodes")
    soak = base / "custom_nodes" / "patchray_soak_nodes"
    soak.mkdir(exist_ok=True)
    shutil.copy(HERE / "soak_nodes.py", soak / "__init__.py")
    (base / "input").mkdir(exist_ok=True)
    t0 = time.monotonic()
    subprocess.run([python, str(HERE / "make_soak_models.py"), comfy_dir, str(base / "models")], check=True, timeout=900, cwd=str(base),
                   env=dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2")), capture_output=True)
    log(f"models ready in {time.monotonic() - t0:.1f} s")


def _messages(entry: dict) -> list:
    return [m for m in entry.get("status", {}).get("messages", [])]


def _error_text(entry: dict) -> str:
    errors = [m[1] for m in _messages(entry) if m and m[0] == "execution_error"]
    return "; ".join(f"{e.get('node_type')}: {e.get('exception_type')}: {e.get('exception_message')}".strip() for e in errors)


def _rejection_text(body: dict) -> str:
    parts = []
    err = body.get("error")
    if isinstance(err, dict):
        parts.append(f"{err.get('type')}: {err.get('message')} {err.get('details', '')}".strip())
    for nid, ne in (body.get("node_errors") or {}).items():
        for e in ne.get("errors", []):
            parts.append(f"{ne.get('class_type')}: {e.get('message')}: {e.get('details')}")
    return "; ".join(parts) or json.dumps(body)[:500]


def _normal(text: str) -> str:
    """A message with its numbers and paths blanked, to count the kinds of messages seen."""
    text = re.sub(r"/[^\s'\"]+", "<path>", text)
    text = re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "N", text)
    return text[:300]


class Soak:
    def __init__(self, args):
        self.args = args
        self.rng = random.Random(args.rng + 1)
        self.t0 = time.monotonic()
        self.log_file = open(args.log, "a") if args.log else None
        self.records: List[dict] = []
        self.memory: List[dict] = []
        self.probes: List[dict] = []
        self.stops: List[dict] = []
        self.censuses: List[dict] = []
        self.crashes: List[dict] = []
        self.state: Dict = {"ranks": None}
        self.stopping = False  # set by SIGTERM/SIGUSR1: finish the case in flight, stop the server, write the report

    def log(self, text: str) -> None:
        line = f"[{time.monotonic() - self.t0:7.1f}s] {text}"
        print(line, flush=True)
        if self.log_file:
            self.log_file.write(line + "\n")
            self.log_file.flush()

    # -- running one prompt

    def queue(self, api: dict, client: int = 0):
        ev = self.server.events[client]
        status, body = _post(self.server.url + "/prompt", {"prompt": api, "client_id": ev.client_id})
        return status, body, ev

    def wait_end(self, pid: str, timeout: float) -> Optional[dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.server.alive():
                return None
            with contextlib.suppress(Exception):
                hist = _get(f"{self.server.url}/history/{pid}", timeout=20)
                if pid in hist and hist[pid].get("status", {}).get("completed") is not None:
                    return hist[pid]
            time.sleep(0.25)
        return {"timeout": True}

    def wait_idle(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.server.alive():
            with contextlib.suppress(Exception):
                q = _get(self.server.url + "/queue")
                if not q.get("queue_running") and not q.get("queue_pending"):
                    return
            time.sleep(0.25)

    # -- faults

    def _phase_pred(self, case: Case, at: str):
        if at == "start":  # the ranks start in whichever PatchRay node uses them first
            return lambda k, d: k == "executing" and d.get("node") in (case.ours_sampler, case.ours_decode)
        if at == "ship":
            return lambda k, d: k == "executing" and d.get("node") == case.ours_sampler
        if at == "sample":
            return lambda k, d: k == "progress" and d.get("node") == case.ours_sampler and d.get("value", 0) >= 2
        if at == "decode":
            return lambda k, d: k == "executing" and d.get("node") == case.ours_decode
        return None

    def _wait_ranks_busy(self, pid: str, ev: "Events", timeout: float) -> bool:
        """Wait until a rank process runs a call (Ray titles it ``ray::_RankActor.call``) while prompt ``pid`` runs."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(".call" in _cmd(p) for p in rank_processes(self.server.proc.pid)):
                return True
            if any(k in ("execution_success", "execution_error", "execution_interrupted") for _, k, _ in ev.seen(pid)):
                return False
            time.sleep(0.1)
        return False

    def _observed_phase(self, case: Case, events: list, t_fault: float) -> str:
        before = [(k, d) for t, k, d in events if t <= t_fault]
        if case.ours_decode and any(k == "executing" and d.get("node") == case.ours_decode for k, d in before):
            return "decode"
        if case.ours_sampler and any(k == "progress" and d.get("node") == case.ours_sampler for k, d in before):
            return "sample"
        if case.ours_sampler and any(k == "executing" and d.get("node") == case.ours_sampler for k, d in before):
            return "start/ship"
        return "before"

    def inject(self, do: str) -> dict:
        leader = self.server.proc.pid
        if do == "interrupt":
            status, _ = _post(self.server.url + "/interrupt", {})
            return {"interrupt_status": status}
        if do == "kill_rank":
            ranks = rank_processes(leader)
            if not ranks:
                return {"killed": None}
            victim = self.rng.choice(ranks)
            victim.kill()
            return {"killed": "rank", "pid": victim.pid}
        if do in ("kill_raylet", "kill_gcs"):
            name = "raylet" if do == "kill_raylet" else "gcs_server"
            procs = named_processes(leader, name)
            for p in procs:
                p.kill()
            return {"killed": name if procs else None}
        if do == "free":
            status, _ = _post(self.server.url + "/free", {"unload_models": True, "free_memory": True})
            return {"free_status": status}
        return {}

    # -- one case

    def run_case(self, case: Case) -> dict:
        rec = {"index": case.index, "kind": case.kind, "family": case.family, "settings": case.settings, "client": case.client}
        t_case = time.monotonic()
        action = case.action or {}
        if case.kind in ("restart_kill9", "restart_term"):
            return self._restart(case, rec)
        if not case.api:  # a server-level fault between prompts
            rec.update(self.inject(action["do"]))
            rec["outcome"] = "injected"
            if action.get("do") in ("kill_raylet", "kill_gcs"):
                time.sleep(2)  # the next prompt meets whatever the death left
            rec["seconds"] = round(time.monotonic() - t_case, 2)
            if action["do"] != "free" and rec.get("killed") is None:
                rec["outcome"] = "nothing to kill"  # no ranks were up (the fault before stopped them)
            rec["ok"] = True  # judged by the prompt after it
            return rec
        status, body, ev = self.queue(case.api, case.client)
        if status != 200:
            rec.update(outcome="rejected", message=_rejection_text(body), seconds=round(time.monotonic() - t_case, 2),
                       seconds_to_error=round(time.monotonic() - t_case, 2))
            return self._judge(case, rec)
        pid = body["prompt_id"]
        rec["prompt_id"] = pid
        t_fault = None
        if action.get("do") not in (None, "none"):
            pred = self._phase_pred(case, action.get("at", ""))
            if pred is not None:
                reached = ev.wait(pid, pred, timeout=self.args.phase_timeout)
                if reached is not None:
                    if action.get("do") == "kill_rank":
                        # the node may first start the ranks (seconds): kill one once the ranks are working on a call
                        self._wait_ranks_busy(pid, ev, self.args.phase_timeout)
                    if action.get("at") in ("sample", "decode"):
                        time.sleep(self.rng.uniform(0.2, 1.5))
                    elif action.get("at") == "start":
                        time.sleep(self.rng.uniform(0.5, 2.0))
                    rec["ranks_at_fault"] = [_cmd(p)[:40] for p in rank_processes(self.server.proc.pid)]
                    t_fault = time.monotonic()
                    rec.update(self.inject(action["do"]))
                    rec["fault_phase"] = self._observed_phase(case, ev.seen(pid), t_fault)
                    if len(rec["ranks_at_fault"]) < (case.settings.get("ranks") or 0):
                        rec["fault_phase"] = "start (ranks starting)"
                else:
                    rec["fault_phase"] = "missed (the prompt ended first)"
        entry = self.wait_end(pid, self.args.prompt_timeout)
        now = time.monotonic()
        rec["seconds"] = round(now - t_case, 2)
        if entry is None:
            rec["outcome"] = "server_died"
            return self._judge(case, rec)
        if entry.get("timeout"):
            rec["outcome"] = "timeout"
            with contextlib.suppress(Exception):
                _post(self.server.url + "/interrupt", {})
            return self._judge(case, rec)
        events = [m[0] for m in _messages(entry)]
        ended = max((t for t, k, _ in ev.seen(pid) if k in ("execution_error", "execution_interrupted", "execution_success")), default=now)
        if "execution_interrupted" in events:
            rec["outcome"] = "interrupted"
        elif entry["status"].get("status_str") == "success":
            rec["outcome"] = "success"
        else:
            rec["outcome"] = "error"
            rec["message"] = _error_text(entry)
        if t_fault is not None:
            rec["seconds_to_error"] = round(max(0.0, ended - t_fault), 2)
        elif rec["outcome"] in ("error", "interrupted"):
            rec["seconds_to_error"] = rec["seconds"]
        notes = []
        for nid, out in (entry.get("outputs") or {}).items():
            for line in out.get("text", []) if isinstance(out, dict) else []:
                if "note" in line or "out of memory" in line or "cannot" in line:
                    notes.append(line)
        if notes:
            rec["notes"] = notes
        if rec["outcome"] == "success" and case.checks:
            rec["checks"] = self._compare(case, entry)
        return self._judge(case, rec)

    def _compare(self, case: Case, entry: dict) -> list:
        import torch
        from safetensors.torch import load_file

        out, results = entry.get("outputs") or {}, []
        for check in case.checks:
            try:
                a, b = (self._load(out, nid, check.what, load_file) for nid in (check.stock, check.ours))
                if a.shape != b.shape:
                    results.append({"what": check.what, "ok": False, "why": f"shapes {list(a.shape)} vs {list(b.shape)}"})
                    continue
                nan_a, nan_b = torch.isnan(a), torch.isnan(b)
                same_nans = bool(torch.equal(nan_a, nan_b))
                a, b = a.double().nan_to_num(0.0), b.double().nan_to_num(0.0)
                if check.what == "latent":
                    value = ((a - b).norm() / max(a.norm().item(), 1e-30)).item()
                else:
                    value = (a - b).abs().max().item()
                results.append({"what": check.what, "value": value, "bound": check.bound, "ok": same_nans and value <= check.bound,
                                **({} if same_nans else {"why": "NaNs in other places than the stock output's"})})
            except Exception as exc:
                results.append({"what": check.what, "ok": False, "why": f"{type(exc).__name__}: {exc}"[:300]})
        return results

    def _load(self, outputs: dict, nid: str, what: str, load_file):
        node = outputs[nid]
        out_dir = self.base / "output"
        if what == "latent":
            item = node["latents"][0]
            return load_file(str(out_dir / item["subfolder"] / item["filename"]))["latent_tensor"]
        return load_file(str(out_dir / node["tensors"][0]))["image"]

    def _judge(self, case: Case, rec: dict) -> dict:
        why = []
        outcome = rec["outcome"]
        if outcome not in case.expect:
            why.append(f"outcome {outcome}, expected {'/'.join(case.expect)}")
        message = rec.get("message", "")
        if outcome in ("error", "rejected"):
            if not message.strip():
                why.append("an error without a message")
            noise = [n for n in RAY_NOISE if n in message]
            if noise:
                why.append(f"the message carries {noise}")
            if case.words and outcome == "error" and not re.search(case.words, message, re.IGNORECASE):
                why.append(f"the message does not name the cause ({case.words!r})")
        bound = self.args.error_bound
        if rec.get("seconds_to_error") is not None and rec["seconds_to_error"] > bound:
            why.append(f"{rec['seconds_to_error']} s to the error, bound {bound} s")
        for c in rec.get("checks", []):
            if not c["ok"]:
                detail = c.get("why") or "{:.3g} > {:.3g}".format(c["value"], c["bound"])
                why.append(f"{c['what']} differs from the stock twin: {detail}")
        note_words = case.settings.get("note_words")
        if note_words and outcome == "success":
            rec["retried"] = any(re.search(note_words, n) for n in rec.get("notes", []))
        rec["ok"] = not why
        if why:
            rec["why"] = why
        return rec

    def _restart(self, case: Case, rec: dict) -> dict:
        how = "kill9" if case.kind == "restart_kill9" else "term"
        # a prompt is running when the server goes (half the time): nothing of it may stay behind either
        if self.rng.random() < 0.5:
            long = soak_cases._long_sampling(case.index, self.rng, self.state.get("ranks") or 2)
            status, body, ev = self.queue(long.api)
            if status == 200:
                ev.wait(body["prompt_id"], lambda k, d: k == "progress" and d.get("node") == long.ours_sampler, timeout=self.args.phase_timeout)
                rec["during"] = "sampling"
        self.server.remember()
        stop = self.server.stop(how, self.args.leftover_bound)
        stop["index"] = case.index
        self.stops.append(stop)
        rec["stop"] = stop
        self.server.snapshot_shm()
        rec["restart_seconds"] = round(self.server.start(), 1)
        rec["outcome"] = "restarted"
        why = _leftover_problems(stop)
        rec["ok"] = not why
        if why:
            rec["why"] = why
        self.state["ranks"] = None
        return rec

    # -- memory

    def sample_memory(self, index: int) -> None:
        leader = self.server.proc.pid
        psutil = _psutil()
        with contextlib.suppress(Exception):
            comfy = psutil.Process(leader).memory_info().rss
            ranks = {p.pid: _rss(p) for p in rank_processes(leader)}
            ray = {n: sum(_rss(p) or 0 for p in named_processes(leader, n)) for n in ("raylet", "gcs_server")}
            self.memory.append({"index": index, "server": self.server.starts, "comfyui": comfy, "ranks": ranks, **ray,
                                "session_processes": len(session_processes(leader))})
        self.server.remember()

    def census(self, index: int) -> None:
        """What each rank holds now (the test-only census node; it runs nothing when no cluster runs)."""
        api = {"1": {"class_type": "PatchRaySoakRankCensus", "inputs": {"tag": f"after case {index}"}}}
        status, body, _ = self.queue(api)
        if status != 200:
            return
        entry = self.wait_end(body["prompt_id"], 300)
        with contextlib.suppress(Exception):
            out = entry["outputs"]["1"]["census"][0]
            self.censuses.append({"index": index, "server": self.server.starts, "ranks": out["ranks"], "driver": out["driver"]})

    def probe(self, index: int) -> None:
        """Ray's object store at idle (the raylet writes its state every 10 s: read after that long)."""
        time.sleep(10.5)
        store = object_store(self.server.tmpdir)
        if store is not None:
            self.probes.append({"index": index, "server": self.server.starts, "object_store": store})

    # -- the whole run

    def run(self) -> dict:
        args = self.args
        self.base = Path(args.base) if args.base else Path(tempfile.mkdtemp(prefix="patchray-soak-"))
        self.base.mkdir(parents=True, exist_ok=True)
        tmpdir = Path(tempfile.mkdtemp(prefix="prsoak-", dir="/tmp"))  # short: Ray's socket paths live below it
        from test_comfyui_server import COMFYUI_DIR, PYTHON

        if not COMFYUI_DIR:
            raise SystemExit("set COMFYUI_DIR (and COMFYUI_PYTHON) to a ComfyUI checkout (tests/comfyui/README.md)")
        self.log(f"base {self.base}, TMPDIR {tmpdir}")
        _setup_base(self.base, COMFYUI_DIR, PYTHON, self.log)
        kinds = tuple(args.kinds.split(",")) if args.kinds else FAULT_KINDS
        cases = schedule(args.prompts, args.rng, kinds=kinds, min_each=args.min_each, fault_share=args.fault_share,
                         block=args.block, quiet=args.quiet)
        self.server = Server(self.base, tmpdir, self.log)
        self.server.snapshot_shm()
        self.server.start()
        i = 0
        last_fault = None
        previous = {sig: signal.signal(sig, lambda *_: setattr(self, "stopping", True)) for sig in (signal.SIGTERM, signal.SIGUSR1)}
        try:
            while i < len(cases) and not self.stopping:
                case = cases[i]
                if case.pair is not None and i + 1 < len(cases) and cases[i + 1].pair == case.pair:
                    recs = self._run_pair(case, cases[i + 1])
                    i += 2
                else:
                    recs = [self.run_case(case)]
                    i += 1
                for rec in recs:
                    if last_fault is not None and rec["kind"] == "mix":
                        last_fault["recovered"] = rec["ok"]
                        last_fault = None
                    if rec["kind"] != "mix":
                        last_fault = rec
                    self.records.append(rec)
                    self.log(f"case {rec['index']:4d} {rec['kind']:18s} {rec.get('outcome', ''):11s} {rec.get('seconds', '')!s:>7} s "
                             f"{'ok' if rec.get('ok') else 'FAIL ' + '; '.join(rec.get('why', []))}"
                             + (f"  [{rec.get('message', '')[:140]}]" if rec.get("message") else ""))
                if not self.server.alive():
                    self.crashes.append({"after_case": recs[-1]["index"], "log_tail": _tail(self.base / "server.log")})
                    self.log(f"the server died after case {recs[-1]['index']}: starting it again")
                    stop = self.server.stop("kill9", args.leftover_bound)
                    stop.update(index=recs[-1]["index"], after_crash=True)
                    self.stops.append(stop)
                    self.server.snapshot_shm()
                    self.server.start()
                    self.state["ranks"] = None
                    continue
                self.wait_idle()
                last = recs[-1]
                if last.get("kind") == "mix":
                    self.state["ranks"] = last["settings"].get("ranks")
                self.sample_memory(last["index"])
                if args.census_every and (last["index"] + 1) % args.census_every == 0:
                    self.census(last["index"])
                if (last["index"] + 1) % args.probe_every == 0:
                    self.probe(last["index"])
                    self.checkpoint(cases)
        finally:
            if self.server.proc is not None:
                self.probe(len(cases))
                stop = self.server.stop(args.final_stop, args.leftover_bound)
                stop.update(index=len(cases), final=True)
                self.stops.append(stop)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        report = self.report(cases)
        if not args.keep_base:
            shutil.rmtree(self.base, ignore_errors=True)
        shutil.rmtree(tmpdir, ignore_errors=True)
        return report

    def checkpoint(self, cases: List[Case]) -> None:
        """The report so far, written where the final one goes (a run stopped early still leaves its figures)."""
        with contextlib.suppress(Exception):
            report = self.report(cases)
            report["partial"] = True
            out = Path(self.args.out)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(report, indent=1, default=str))
            out.with_suffix(".txt").write_text("(partial: the run goes on)\n" + summary_text(report))

    def _run_pair(self, a: Case, b: Case) -> List[dict]:
        """Two mix prompts queued at the same moment by two clients (threads); ComfyUI runs them one after the other."""
        out: Dict[int, dict] = {}
        barrier = threading.Barrier(2)

        def go(case):
            barrier.wait()
            out[case.index] = self.run_case(case)

        threads = [threading.Thread(target=go, args=(c,)) for c in (a, b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for rec in out.values():
            rec["pair"] = a.pair
        return [out[a.index], out[b.index]]

    # -- the report

    def report(self, cases: List[Case]) -> dict:
        recs = self.records
        faults = [r for r in recs if r["kind"] != "mix"]
        by_kind = collections.Counter(r["kind"] for r in faults)
        recovered = collections.Counter(r["kind"] for r in faults if r.get("recovered"))
        outcomes: Dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        for r in faults:
            outcomes[r["kind"]][r.get("outcome", "?")] += 1
        to_error = [r["seconds_to_error"] for r in recs if r.get("seconds_to_error") is not None]
        to_error_by_kind = {}
        for r in recs:
            if r.get("seconds_to_error") is not None:
                to_error_by_kind[r["kind"]] = max(to_error_by_kind.get(r["kind"], 0), r["seconds_to_error"])
        messages = collections.Counter()
        kinds_of = collections.defaultdict(set)
        for r in recs:
            for text in [r.get("message")] + list(r.get("notes", [])):
                if text:
                    messages[_normal(text)] += 1
                    kinds_of[_normal(text)].add(r["kind"])
        prompts = sum(1 for r in recs if r.get("prompt_id") or r.get("outcome") == "rejected")
        mix = [r for r in recs if r["kind"] == "mix"]
        report = {
            "command": " ".join(["tests/comfyui/soak.py"] + list(self.args.argv)),
            "cases_planned": len(cases),
            "stopped_early": self.stopping,
            "machine": _machine(),
            "rng": self.args.rng,
            "wall_seconds": round(time.monotonic() - self.t0, 1),
            "error_bound_s": self.args.error_bound,
            "leftover_bound_s": self.args.leftover_bound,
            "cases": len(recs),
            "prompts_run": prompts,
            "mix_prompts": {"run": len(mix), "passed": sum(1 for r in mix if r["ok"]),
                            "by_path": dict(collections.Counter(f"{r['settings'].get('sampler')} + {r['settings'].get('decode')}" for r in mix)),
                            "by_family": dict(collections.Counter(r["family"] for r in mix)),
                            "by_ranks": dict(collections.Counter(str(r["settings"].get("ranks")) for r in mix)),
                            "by_parallelism": dict(collections.Counter(r["settings"].get("parallelism") for r in mix)),
                            "concurrent_pairs": len({r["pair"] for r in mix if r.get("pair") is not None}),
                            "worst": _worst(mix)},
            "faults": {"injected": dict(by_kind), "total": sum(by_kind.values()), "passed": sum(1 for r in faults if r["ok"]),
                       "recovered": dict(recovered), "outcomes": {k: dict(v) for k, v in outcomes.items()},
                       "phases": dict(collections.Counter(f"{r['kind']}@{r.get('fault_phase')}" for r in faults if r.get("fault_phase")))},
            "max_seconds_to_error": max(to_error) if to_error else None,
            "seconds_to_error_by_kind": to_error_by_kind,
            "messages": [{"text": t, "count": n, "kinds": sorted(kinds_of[t])} for t, n in messages.most_common()],
            "server_crashes": self.crashes,
            "memory": _memory_summary(self.memory, self.probes),
            "memory_samples": [{"index": m["index"], "server": m["server"], "comfyui_mb": round(m["comfyui"] / 2**20, 1),
                                "ranks_mb": {str(k): round((v or 0) / 2**20, 1) for k, v in m["ranks"].items()},
                                "raylet_mb": round(m["raylet"] / 2**20, 1), "gcs_mb": round(m["gcs_server"] / 2**20, 1)}
                               for m in self.memory],
            "stops": self.stops,
            "rank_census": self.censuses,
            "failures": [{k: r.get(k) for k in ("index", "kind", "outcome", "why", "message", "settings", "fault_phase")} for r in recs if not r["ok"]],
            "records": recs,
        }
        report["holds"] = _holds(report)
        return report


def _tail(path: Path, n: int = 40) -> str:
    with contextlib.suppress(OSError):
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if "state-dump" not in ln]
        return "\n".join(lines[-n:])
    return ""


def _leftover_problems(stop: dict) -> List[str]:
    why = []
    if stop["processes_left"]:
        why.append(f"processes left after the stop: {stop['processes_left']}")
    if stop["ports_left"]:
        why.append(f"ports still listening: {stop['ports_left']}")
    if stop["dev_shm_left"]:
        why.append(f"/dev/shm entries left: {stop['dev_shm_left']}")
    if stop["rendezvous_folders_left"]:
        why.append(f"PatchRay rendezvous folders left: {len(stop['rendezvous_folders_left'])}")
    return why


def _worst(mix: List[dict]) -> dict:
    worst = {}
    for r in mix:
        for c in r.get("checks", []):
            if "value" in c:
                key = f"{c['what']} (bound {c['bound']:.0e})"
                worst[key] = max(worst.get(key, 0.0), c["value"])
    return {k: float(f"{v:.3g}") for k, v in worst.items()}


def _machine() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()}
    with contextlib.suppress(Exception):
        import psutil

        info["memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    with contextlib.suppress(Exception):
        info["cpu_model"] = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    with contextlib.suppress(Exception):
        import torch

        info["torch"] = torch.__version__
    with contextlib.suppress(Exception):
        info["comfyui"] = re.search(r'"([\d.]+)"', (Path(os.environ["COMFYUI_DIR"]) / "comfyui_version.py").read_text()).group(1)
    with contextlib.suppress(Exception):
        info["patchray_commit"] = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                                 text=True, timeout=10).stdout.strip()
    return info


def _slope_per_100(points: List[tuple]) -> Optional[float]:
    """Least-squares slope of ``(case index, bytes)`` points, in MB per 100 cases."""
    if len(points) < 5:
        return None
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    if den == 0:
        return None
    return round(sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den * 100 / 2**20, 1)


def _memory_summary(samples: List[dict], probes: List[dict]) -> dict:
    """ComfyUI's RSS per server run (after a warm-up of the first fifth of its cases), each rank process's RSS over its
    life, and Ray's object store as the probe read it."""
    out: dict = {"comfyui": [], "ranks": {}, "object_store": {}}
    by_server = collections.defaultdict(list)
    for s in samples:
        by_server[s["server"]].append(s)
    for server, ss in sorted(by_server.items()):
        if len(ss) < 5:
            continue
        warm = ss[len(ss) // 5:]  # ComfyUI's own model cache fills as the families and VAEs first appear
        first, last = warm[: max(1, len(warm) // 5)], warm[-max(1, len(warm) // 5):]
        span = max(1, warm[-1]["index"] - warm[0]["index"])
        early, late = statistics.median(s["comfyui"] for s in first), statistics.median(s["comfyui"] for s in last)
        out["comfyui"].append({
            "server_run": server, "cases": [ss[0]["index"], ss[-1]["index"]], "samples": len(ss),
            "rss_mb_after_warmup": round(early / 2**20, 1), "rss_mb_at_end": round(late / 2**20, 1),
            "rss_mb_max": round(max(s["comfyui"] for s in ss) / 2**20, 1),
            "growth_mb_per_100_cases": round((late - early) / span * 100 / 2**20, 1),
            "slope_mb_per_100_cases": _slope_per_100([(s["index"], s["comfyui"]) for s in warm]),
        })
    lives = collections.defaultdict(list)
    for s in samples:
        for pid, rss in s["ranks"].items():
            if rss:
                lives[(s["server"], pid)].append((s["index"], rss))
    long_lives = {k: v for k, v in lives.items() if len(v) >= 8}
    rank_growth = []
    for (server, pid), pts in long_lives.items():
        # a rank fills as the families first reach it (one sampling model and one VAE cached at a time): the growth is
        # read over the second half of its life, medians of its first and last thirds
        late = pts[len(pts) // 2:]
        k = max(1, len(late) // 3)
        span = max(1, late[-1][0] - late[0][0])
        growth = (statistics.median(p[1] for p in late[-k:]) - statistics.median(p[1] for p in late[:k])) / span * 100 / 2**20
        rank_growth.append({"server_run": server, "pid": pid, "cases": [pts[0][0], pts[-1][0]], "samples": len(pts),
                            "rss_mb_first": round(pts[0][1] / 2**20, 1), "rss_mb_last": round(pts[-1][1] / 2**20, 1),
                            "rss_mb_max": round(max(p[1] for p in pts) / 2**20, 1),
                            "slope_mb_per_100_cases": _slope_per_100(late), "growth_mb_per_100_cases": round(growth, 1)})
    rank_growth.sort(key=lambda r: -r["samples"])
    out["ranks"] = {"processes_seen": len(lives), "lives_of_8_or_more_cases": rank_growth[:12],
                    "max_growth_mb_per_100_cases": max((r["growth_mb_per_100_cases"] for r in rank_growth), default=None),
                    "rss_mb_max": round(max((max(p[1] for p in v) for v in lives.values()), default=0) / 2**20, 1)}
    stores = [p["object_store"] for p in probes if p["object_store"].get("bytes_used") is not None]
    used = [s["bytes_used"] for s in stores]
    objects = [s["objects"] for s in stores if s.get("objects") is not None]
    out["object_store"] = {"probes": len(probes), "read": len(stores),
                           "bytes_used_max_mb": round(max(used) / 2**20, 1) if used else None,
                           "bytes_used_last_mb": round(used[-1] / 2**20, 1) if used else None,
                           "objects_max": max(objects) if objects else None, "objects_last": objects[-1] if objects else None,
                           "pinned_mb_max": round(max(s.get("pinned_bytes") or 0 for s in stores) / 2**20, 1) if stores else None,
                           "spilled_mb_max": round(max(s.get("spilled_bytes") or 0 for s in stores) / 2**20, 1) if stores else None,
                           "capacity_mb": round(stores[-1]["capacity"] / 2**20, 1) if stores else None,
                           "series": [(p["index"], round(p["object_store"]["bytes_used"] / 2**20, 1)) for p in probes
                                      if p["object_store"].get("bytes_used") is not None]}
    return out


def _within_slope(points: List[tuple]) -> Optional[float]:
    """Least-squares slope of ``(case index, MB, group)`` points with one level per group (the pooled within-group
    slope), in MB per 100 cases; ``None`` with fewer than 5 points in groups of two or more."""
    groups = collections.defaultdict(list)
    for x, y, g in points:
        groups[g].append((x, y))
    num = den = 0.0
    used = 0
    for pts in groups.values():
        if len(pts) < 2:
            continue
        mx, my = statistics.fmean(p[0] for p in pts), statistics.fmean(p[1] for p in pts)
        num += sum((x - mx) * (y - my) for x, y in pts)
        den += sum((x - mx) ** 2 for x, _ in pts)
        used += len(pts)
    if used < 5 or den == 0:
        return None
    return round(num / den * 100, 1)


def same_model_growth(report: dict) -> dict:
    """Resident-memory growth per 100 cases with the model held fixed: a rank holds one sampling model at a time (the
    family last shipped: SD3-class ~1.47 GB, the SD1-class UNet ~1.56 GB, Wan ~1.64 GB on these CPU ranks), so a
    plain slope over a rank's life mostly says which family came last. Each point is tagged with the family of the
    last mix prompt before it (on the ranks: since they started; in ComfyUI: since the server started) and the slope is
    the pooled within-family one (one level per family, one slope). Both are read over the second half of each series
    (a server run; a rank's life of at least 16 cases): in the first half ComfyUI's own cache fills with the three
    families, their text encoders and VAEs (about 30 cases), and a rank's resident memory rises to the level the
    largest model it held leaves behind; a leak keeps growing in the second half, a cache filling does not."""
    families = {r["index"]: r["family"] for r in report.get("records", []) if r.get("kind") == "mix"}
    by_server = collections.defaultdict(list)
    for m in report.get("memory_samples", []):
        by_server[m["server"]].append(m)
    comfy, ranks = [], []
    for server, ss in sorted(by_server.items()):
        family, tagged = None, []
        lives = collections.defaultdict(list)
        for m in ss:
            family = families.get(m["index"], family)
            tagged.append((m["index"], m["comfyui_mb"], family))
            for pid, mb in m["ranks_mb"].items():
                if mb:
                    lives[pid].append((m["index"], mb, family))
        warm = tagged[len(tagged) // 2:]
        if len(warm) >= 8:
            comfy.append({"server_run": server, "cases": [warm[0][0], warm[-1][0]], "samples": len(warm),
                          "mb_per_100_cases": _within_slope(warm)})
        for pid, pts in lives.items():
            if len(pts) >= 16:
                late = pts[len(pts) // 2:]
                ranks.append({"server_run": server, "pid": pid, "life": [pts[0][0], pts[-1][0]], "cases": [late[0][0], late[-1][0]],
                              "samples": len(late), "mb_per_100_cases": _within_slope(late)})
    ranks.sort(key=lambda r: -r["samples"])
    comfy_vals = [c["mb_per_100_cases"] for c in comfy if c["mb_per_100_cases"] is not None]
    rank_vals = [r["mb_per_100_cases"] for r in ranks if r["mb_per_100_cases"] is not None]
    # every rank process starts afresh when the rank count changes or after a fault: the baseline a new rank returns to,
    # per cached family, early in the run against late in it (medians of every rank's samples)
    last = max((m["index"] for m in report.get("memory_samples", [])), default=0)
    thirds: Dict[str, dict] = {}
    for server, ss in sorted(by_server.items()):
        family = None
        for m in ss:
            family = families.get(m["index"], family)
            part = "first_third" if m["index"] < last / 3 else "last_third" if m["index"] >= 2 * last / 3 else None
            if family and part:
                thirds.setdefault(family, {"first_third": [], "last_third": []})[part] += [mb for mb in m["ranks_mb"].values() if mb]
    baseline = {f: {k: round(statistics.median(v), 1) if v else None for k, v in d.items()} for f, d in sorted(thirds.items())}
    return {"ranks_rss_mb_by_family": baseline, "comfyui": comfy, "comfyui_max_mb_per_100_cases": max(comfy_vals, default=None),
            "ranks_lives_of_16_or_more": len(ranks), "ranks_median_mb_per_100_cases": statistics.median(rank_vals) if rank_vals else None,
            "ranks_max_mb_per_100_cases": max(rank_vals, default=None), "ranks": ranks[:12]}


def _holds(report: dict) -> dict:
    """The "must hold" list, each with its verdict."""
    mem = report["memory"]
    comfy = max((c["growth_mb_per_100_cases"] for c in mem["comfyui"]), default=None)
    store = mem["object_store"]
    stops = report["stops"]
    return {
        "every mix prompt equals its stock twin": report["mix_prompts"]["passed"] == report["mix_prompts"]["run"],
        "every fault ends as expected, readable, within the bound": report["faults"]["passed"] == report["faults"]["total"],
        "the prompt after every fault works": all(r.get("recovered") for r in report["records"] if r["kind"] != "mix" and "recovered" in r),
        "the server never died": not report["server_crashes"],
        "max seconds to error within the bound": (report["max_seconds_to_error"] or 0) <= report["error_bound_s"],
        "ComfyUI's RSS growth per 100 cases (MB)": comfy,
        "ranks' RSS growth per 100 cases (MB, worst process)": mem["ranks"]["max_growth_mb_per_100_cases"],
        "object store empty at idle": store["bytes_used_last_mb"] is not None and store["bytes_used_last_mb"] < 1.0,
        "nothing left after any stop": all(not _leftover_problems(s) for s in stops),
    }


def summary_text(report: dict) -> str:
    f, m = report["faults"], report["memory"]
    same = same_model_growth(report)
    lines = [
        f"PatchRay soak: {report['cases']} cases, {report['prompts_run']} prompts through the HTTP API in {report['wall_seconds'] / 60:.1f} min "
        f"(--rng {report['rng']}; {report['machine'].get('cpus')} CPUs, {report['machine'].get('memory_gib')} GiB; ComfyUI "
        f"{report['machine'].get('comfyui')}; PatchRay {report['machine'].get('patchray_commit')})",
        f"mix prompts: {report['mix_prompts']['passed']}/{report['mix_prompts']['run']} equal to their stock twins "
        f"(worst: {report['mix_prompts']['worst']}); {report['mix_prompts']['concurrent_pairs']} pairs queued by two clients at once",
        f"faults: {f['total']} injected, {f['passed']} ended as expected; by kind: "
        + ", ".join(f"{k} {n} (recovered {f['recovered'].get(k, 0)})" for k, n in sorted(f["injected"].items())),
        f"max time to error: {report['max_seconds_to_error']} s (bound {report['error_bound_s']} s)",
        "ComfyUI RSS: " + "; ".join(f"run {c['server_run']} cases {c['cases'][0]}-{c['cases'][1]}: {c['rss_mb_after_warmup']} -> {c['rss_mb_at_end']} MB "
                                     f"({c['growth_mb_per_100_cases']:+} MB per 100 cases)" for c in m["comfyui"]),
        f"ranks: {m['ranks']['processes_seen']} rank processes seen, max RSS {m['ranks']['rss_mb_max']} MB, worst growth "
        f"{m['ranks']['max_growth_mb_per_100_cases']} MB per 100 cases (over lives of >= 8 cases)",
        "second half of each series, same cached model (pooled within-family slope): ComfyUI {} MB per 100 cases (worst "
        "server run); ranks median {}, worst {} MB per 100 cases ({} lives of >= 16 cases)".format(
            same["comfyui_max_mb_per_100_cases"], same["ranks_median_mb_per_100_cases"], same["ranks_max_mb_per_100_cases"],
            same["ranks_lives_of_16_or_more"]),
        "ranks' RSS by cached family, median of the first third of the cases -> the last third: " + "; ".join(
            f"{f} {d['first_third']} -> {d['last_third']} MB" for f, d in same["ranks_rss_mb_by_family"].items()),
        f"object store: max {m['object_store']['bytes_used_max_mb']} MB used, {m['object_store']['bytes_used_last_mb']} MB at the end "
        f"(capacity {m['object_store']['capacity_mb']} MB)",
        "stops: " + "; ".join(f"{s['how']}{' (crash)' if s.get('after_crash') else ''}: "
                              + ("clean in %s s" % s["seconds_until_clean"] if not _leftover_problems(s) else "; ".join(_leftover_problems(s)))
                              for s in report["stops"]),
        f"server crashes: {len(report['server_crashes'])}",
        "must hold: " + "; ".join(f"{k}: {v}" for k, v in report["holds"].items()),
    ]
    if report["failures"]:
        lines.append(f"failures ({len(report['failures'])}):")
        for fl in report["failures"][:40]:
            lines.append(f"  case {fl['index']} {fl['kind']} ({fl.get('outcome')}): {'; '.join(fl.get('why') or [])[:300]}")
    return "\n".join(lines) + "\n"


def compact(report: dict) -> dict:
    """The report without its per-case records, for ``results/soak/``: the figures, the must-hold verdicts, the
    failures (if any) and ComfyUI's and the ranks' resident memory per case (MB). Machine-independent: no paths."""
    keep = ("command", "cases_planned", "stopped_early", "rng", "wall_seconds", "error_bound_s", "leftover_bound_s", "cases",
            "prompts_run", "mix_prompts", "faults", "max_seconds_to_error", "seconds_to_error_by_kind", "messages",
            "memory", "holds", "failures")
    out = {k: report[k] for k in keep if k in report}
    words, argv = report.get("command", "").split(), []
    for i, w in enumerate(words):  # where this run's files went is not part of what it did
        if w in ("--out", "--log", "--base", "--summary", "--keep-base") or (i and words[i - 1] in ("--out", "--log", "--base", "--summary")):
            continue
        argv.append(w)
    out["command"] = " ".join(argv)
    out["machine"] = {k: v for k, v in report.get("machine", {}).items() if k in ("cpus", "memory_gib", "cpu_model", "torch", "comfyui",
                                                                              "patchray_commit", "python")}
    out["server_crashes"] = len(report.get("server_crashes", []))
    out["stops"] = [{k: s.get(k) for k in ("index", "how", "after_crash", "final", "exit_status", "seconds_until_clean", "processes_left",
                                          "ports_left", "dev_shm_left", "dev_shm_seen_held", "rendezvous_folders_left",
                                          "rendezvous_folders_after_kill9") if k in s} for s in report.get("stops", [])]
    out["memory_same_model"] = same_model_growth(report)
    out["rss_mb_per_case"] = [{"index": m["index"], "server": m["server"], "comfyui": m["comfyui_mb"],
                               "ranks": sorted(m["ranks_mb"].values(), reverse=True)} for m in report.get("memory_samples", [])]
    return out


def chart(report: dict, path: Path) -> None:
    """ComfyUI's and each rank's resident memory over the cases (server restarts and faults marked), as a small PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = report.get("memory_samples", [])
    if not samples:
        return
    fig, ax = plt.subplots(figsize=(9, 3.6), dpi=80)
    by_server = collections.defaultdict(list)
    for m in samples:
        by_server[m["server"]].append(m)
    for n, (server, ss) in enumerate(sorted(by_server.items())):
        ax.plot([m["index"] for m in ss], [m["comfyui_mb"] for m in ss], color="tab:blue", lw=1.2, label="ComfyUI" if n == 0 else None)
        if n:
            ax.axvline(ss[0]["index"], color="grey", ls=":", lw=0.8)
    lives = collections.defaultdict(list)
    for m in samples:
        for pid, mb in m["ranks_mb"].items():
            lives[(m["server"], pid)].append((m["index"], mb))
    for n, pts in enumerate(lives.values()):
        ax.plot([p[0] for p in pts], [p[1] for p in pts], color="tab:orange", lw=0.8, alpha=0.7, label="a rank (one line per process)" if n == 0 else None)
    for r in report.get("records", []):
        if r["kind"] != "mix":
            ax.axvline(r["index"], color="tab:red", lw=0.3, alpha=0.4)
    ax.set_xlabel("case (red: a fault; dotted: ComfyUI started again)")
    ax.set_ylabel("resident memory (MB)")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(f"PatchRay soak: {report['cases']} cases, {report['prompts_run']} prompts, CPU ranks", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=60, help="cases to run (mix prompts, pairs and faults)")
    p.add_argument("--rng", type=int, default=1, help="the start of the random draws: the schedule and the fault timing")
    p.add_argument("--out", default="soak-report.json", help="the JSON report; the summary goes beside it (.txt)")
    p.add_argument("--summary", default=None, help="also write the report without its records (compact()) here, with its .txt "
                   "summary and an RSS chart (.png) beside it")
    p.add_argument("--log", default=None, help="a progress log to append to")
    p.add_argument("--base", default=None, help="the server's base directory (default: a fresh temporary one)")
    p.add_argument("--keep-base", action="store_true", help="keep the base directory (outputs, server logs)")
    p.add_argument("--error-bound", type=float, default=60.0, help="seconds from a fault to its prompt's end")
    p.add_argument("--leftover-bound", type=float, default=90.0, help="seconds the session's processes may take to go after a stop")
    p.add_argument("--prompt-timeout", type=float, default=600.0)
    p.add_argument("--phase-timeout", type=float, default=240.0, help="how long to wait for the phase a fault is meant for")
    p.add_argument("--probe-every", type=int, default=10)
    p.add_argument("--min-each", type=int, default=1, help="each fault kind at least this often")
    p.add_argument("--fault-share", type=float, default=0.3)
    p.add_argument("--block", type=int, default=30, help="cases per block: each block opens with --quiet fault-free cases")
    p.add_argument("--quiet", type=int, default=12, help="fault-free mix prompts on one rank count at the start of each block")
    p.add_argument("--census-every", type=int, default=0, help="every N cases, what each rank holds (tensors, heap, objects); 0: never")
    p.add_argument("--kinds", default="", help="comma-separated fault kinds to inject (default: all of soak_cases.FAULT_KINDS)")
    p.add_argument("--final-stop", choices=("term", "int", "kill9"), default="term")
    p.add_argument("--from-report", default=None, help="run nothing: write --summary (and the .txt) from this JSON report")
    args = p.parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.from_report:
        report = json.loads(Path(args.from_report).read_text())
    else:
        report = Soak(args).run()
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1, default=str))
    out = Path(args.from_report or args.out)
    text = summary_text(report)
    out.with_suffix(".txt").write_text(text)
    if args.summary:
        summary = Path(args.summary)
        summary.parent.mkdir(parents=True, exist_ok=True)
        summary.write_text(json.dumps(compact(report), indent=1, default=str))
        summary.with_suffix(".txt").write_text(text)
        with contextlib.suppress(ImportError):
            chart(report, summary.with_name("rss.png"))
    print(text)
    return 0 if all(v is True or not isinstance(v, bool) for v in report["holds"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
