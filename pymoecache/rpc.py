"""GPU layers on a ggml RPC server: ``Llama(n_gpu_layers=N, rpc_servers="HOST:PORT")``.

ggml's RPC backend is a real second backend with its own device buffers, reached over TCP: a
machine with a GPU runs llama.cpp's ``rpc-server`` (or ``pymoecache rpc-server``, which serves
this machine's CPU) and another process offloads layers to it as to a local GPU. With residency
stream or mmap the offloaded layers' dense part (attention, norms, routers, shared experts) goes
to the device and the routed experts stay in this process's cache, as llama.cpp's ``--cpu-moe``
places them; the routing, the counters and the reads are the CPU run's.

The tests use it as the GPU they do not have: a local server on the loopback.

>>> import pymoecache.rpc as rpc
>>> rpc.parse_endpoints("127.0.0.1:50052, gpu-box:50052")
['127.0.0.1:50052', 'gpu-box:50052']
>>> with rpc.LocalServer() as server:                                      # doctest: +SKIP
...     llm = pymoecache.Llama("model.gguf", n_gpu_layers=99, rpc_servers=server.endpoint)
"""

from __future__ import annotations

import ctypes
import errno
import os
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
from ctypes import c_char_p, c_size_t, c_void_p
from typing import List, Optional

from ._lib import (GGML_BACKEND_DEVICE_TYPE_CPU, GGML_BACKEND_DEVICE_TYPE_GPU, GGML_BACKEND_DEVICE_TYPE_IGPU,
                   find_lib_dir, load_ggml)
from .errors import ConfigError, MissingDependencyError

# --- ctypes: ggml-rpc.h (ggml-backend.h's calls: pymoecache._lib.load_ggml) ------------------

_libs: Optional[tuple] = None
_lock = threading.Lock()
_added: List[str] = []  # endpoints registered in this process, in order
_stopped: set = set()  # those a LocalServer of this process served and stopped (gone_servers)
_lost: set = set()  # those a Llama lost (DeviceLostError): ggml keeps their dead connection for good


def _load():
    """(libggml, libggml-rpc) of our build, declared; MissingDependencyError where RPC was left out.
    Both are libllama's handle (pymoecache._lib.load_ggml): libggml-rpc is one of the libraries it
    was linked with, and a copy of it opened by path would be a second one."""
    global _libs
    if _libs is None:
        ggml = load_ggml()
        rpc = ctypes.CDLL(ggml._name, mode=ctypes.RTLD_GLOBAL)  # (a second handle object: its own declarations)
        if not hasattr(rpc, "ggml_backend_rpc_add_server"):
            raise MissingDependencyError(f"this pymoecache was built without ggml's RPC backend ({find_lib_dir()} "
                                         "has no libggml-rpc): rebuild without -DGGML_RPC=OFF")
        # GGML_BACKEND_API ggml_backend_reg_t ggml_backend_rpc_add_server(const char * endpoint);
        rpc.ggml_backend_rpc_add_server.argtypes = [c_char_p]
        rpc.ggml_backend_rpc_add_server.restype = c_void_p
        # GGML_BACKEND_API void ggml_backend_rpc_start_server(const char * endpoint, const char * cache_dir,
        #                                                     size_t n_threads, size_t n_devices, ggml_backend_dev_t * devices);
        rpc.ggml_backend_rpc_start_server.argtypes = [c_char_p, c_char_p, c_size_t, c_size_t, ctypes.POINTER(c_void_p)]
        rpc.ggml_backend_rpc_start_server.restype = None
        _libs = (ggml, rpc)
    return _libs


# --- Python layer ---------------------------------------------------------------------------

def parse_endpoints(servers: "str | List[str]") -> List[str]:
    """``"host:port,host:port"`` (llama.cpp's ``--rpc``) or a list of them, checked; ConfigError otherwise.

    >>> parse_endpoints(["localhost:1"])
    ['localhost:1']
    >>> parse_endpoints("gpu-box")
    Traceback (most recent call last):
    ...
    pymoecache.errors.ConfigError: rpc server 'gpu-box': expected HOST:PORT, e.g. 127.0.0.1:50052
    """
    if not isinstance(servers, (str, list, tuple)):
        raise ConfigError(f"rpc_servers must be 'HOST:PORT[,HOST:PORT...]' or a list of them, got {servers!r}")
    items = servers.split(",") if isinstance(servers, str) else list(servers)
    out = []
    for item in items:
        e = str(item).strip()
        host, sep, port = e.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"rpc server {e!r}: expected HOST:PORT, e.g. 127.0.0.1:50052")
        out.append(e)
    if not out:
        raise ConfigError("rpc_servers is empty: expected HOST:PORT[,HOST:PORT...]")
    return out


def _check_reachable(endpoint: str) -> None:
    host, _, port = endpoint.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
    except OSError as e:
        raise ConfigError(f"rpc server {endpoint} is not reachable ({e}): start one there "
                          "(`pymoecache rpc-server --port PORT`, or llama.cpp's rpc-server)") from None


def add_server(endpoint: str) -> None:
    """Make the devices of the RPC server at ``endpoint`` available to models loaded from now on
    (llama.cpp then offloads ``n_gpu_layers`` to them, as to a local GPU). Once per process and
    endpoint; the server must be reachable now (ConfigError otherwise, instead of ggml's abort)."""
    (endpoint,) = parse_endpoints([endpoint])
    with _lock:
        if endpoint in _added:
            return
        _check_reachable(endpoint)
        ggml, rpc = _load()
        reg = rpc.ggml_backend_rpc_add_server(endpoint.encode())
        if not reg:
            raise ConfigError(f"rpc server {endpoint}: ggml could not add it (see the log above)")
        ggml.ggml_backend_register(reg)
        _added.append(endpoint)
        _catch_rpc_abort()


# typedef void (*ggml_abort_callback_t)(const char * error_message);
_ABORT_CB = ctypes.CFUNCTYPE(None, c_char_p)
_abort_handler = None  # (kept referenced: ggml holds the pointer for the life of the process)
_stderr_fd = 2  # a copy of this process's stderr, made with the handler: llama-cpp-python points fd 2 at
#                 /dev/null while it loads a model quietly (verbose=False), and the error line must be seen

# the exit status of a process whose RPC server stopped answering during a command (the CLI's for an error)
EXIT_RPC_LOST = 2


def _on_ggml_abort(message: bytes) -> None:
    """ggml's abort callback (it aborts the process when this returns). ggml's RPC client aborts when a
    server stops answering during a command, on its own thread, with no error path back to the caller:
    nothing can be raised to the code that decodes. What it can do is end the process the way an error
    does: what was printed is flushed, one line says which server and why, exit status EXIT_RPC_LOST, and
    no core dump or debugger output. Every other abort prints its message and backtrace as before."""
    text = (message or b"").decode(errors="replace")
    if "ggml-rpc" not in text.partition(": ")[0]:  # (file:line: message; not ggml-rpc.cpp's)
        os.write(_stderr_fd, (text + "\n").encode(errors="replace"))
        try:
            load_ggml().ggml_print_backtrace()
        except Exception:
            pass
        return
    try:
        gone = [e for e in _added if server_gone(e)] or list(_added)
    except Exception:
        gone = list(_added)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    reason = text.rpartition(": ")[2].strip() or text
    os.write(_stderr_fd, (f"pymoecache: error: rpc server {', '.join(gone)} stopped answering during a command (ggml: "
                 f"{reason}). ggml's RPC client has no way to return this error, so the process ends here (exit "
                 f"status {EXIT_RPC_LOST}). Start the server again and load the model in a new process, or run "
                 "without -ngl.\n").encode(errors="replace"))
    os._exit(EXIT_RPC_LOST)


def _catch_rpc_abort() -> None:
    """Install :func:`_on_ggml_abort` (once per process, when a server is first registered)."""
    global _abort_handler, _stderr_fd
    if _abort_handler is None:
        try:
            _stderr_fd = os.dup(2)
        except OSError:
            pass
        ggml = load_ggml()
        ggml.ggml_set_abort_callback.argtypes = [_ABORT_CB]
        ggml.ggml_set_abort_callback.restype = c_void_p
        _abort_handler = _ABORT_CB(_on_ggml_abort)
        ggml.ggml_set_abort_callback(_abort_handler)


def servers() -> List[str]:
    """The RPC endpoints registered in this process so far."""
    return list(_added)


def _peer(endpoint: str) -> set:
    host, _, port = endpoint.rpartition(":")
    try:
        return {(a[4][0], int(port)) for a in socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)}
    except OSError:
        return set()


def _connections(peers: set) -> List[int]:
    """This process's open TCP connections (file descriptors) to any of ``peers`` ((address, port))."""
    import stat

    fd_dir = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"
    out = []
    for name in os.listdir(fd_dir):
        fd = int(name)
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            with socket.socket(fileno=os.dup(fd)) as sock:
                if sock.type == socket.SOCK_STREAM and tuple(sock.getpeername()[:2]) in peers:
                    out.append(fd)
        except OSError:
            continue
    return out


_conns: dict = {}  # endpoint -> (its addresses, the connections to it found last, a poll of them, their inodes):
                  # server_gone's per-token check


def _quiet(fds: List[int], poller, inodes: List[int]) -> bool:
    """These connections are the sockets found (same inodes), open, with nothing to read: a closed one
    reads as end of file, which poll reports. One poll and a stat per connection, no socket made."""
    if poller is None or poller.poll(0):
        return False
    try:
        return all(os.fstat(fd).st_ino == ino for fd, ino in zip(fds, inodes))
    except OSError:
        return False


def _probe(fds: List[int], peers: set) -> Optional[bool]:
    """True: one of these connections is open; False: every one was closed by the server; None: one of
    the descriptors is no longer a connection to ``peers`` (closed, or reused for something else)."""
    for fd in fds:
        try:
            with socket.socket(fileno=os.dup(fd)) as sock:
                if sock.type != socket.SOCK_STREAM or tuple(sock.getpeername()[:2]) not in peers:
                    return None
                if sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b"":
                    return True  # (bytes waiting: alive)
        except BlockingIOError:
            return True  # nothing to read, the connection open: alive
        except OSError as e:
            if e.errno in (errno.EBADF, errno.ENOTSOCK):
                return None
            continue  # reset: gone
    return False


def server_gone(endpoint: str) -> bool:
    """The RPC server at ``endpoint`` closed the connection ggml holds to it, or (where ggml holds
    none now) refuses a new one. A server that died or was stopped closes its connections at once;
    one behind a network that went silent is not seen here (ggml would wait for it). Called before
    every decode: the connections found are remembered, and only looked for again when one of them
    is no longer one (a few microseconds a call instead of a scan of every descriptor)."""
    cached = _conns.get(endpoint)
    if cached and cached[1]:
        if _quiet(*cached[1:]):  # (the usual case: a few microseconds)
            return False
        alive = _probe(cached[1], cached[0])
        if alive is not None:
            return not alive
    peers = _peer(endpoint)
    conns = _connections(peers)
    poller = select.poll() if hasattr(select, "poll") else None  # (not on Windows)
    for fd in conns if poller is not None else []:
        poller.register(fd, select.POLLIN | select.POLLPRI)
    try:
        inodes = [os.fstat(fd).st_ino for fd in conns]
    except OSError:
        conns, inodes = [], []
    _conns[endpoint] = (peers, conns, poller, inodes)
    alive = _probe(conns, peers) if conns else None
    if alive is not None:
        return not alive
    host, _, port = endpoint.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
        return False
    except OSError:
        return True


def gone_servers() -> List[str]:
    """The registered endpoints whose server is gone (:func:`server_gone`)."""
    return [e for e in _added if e in _stopped or e in _lost or server_gone(e)]


def mark_lost(endpoints: List[str]) -> None:
    """These servers went away under a loaded model: ggml keeps its connection to them, dead, for
    the life of the process (a server back at the same address cannot be used from this process)."""
    _lost.update(endpoints)


def was_lost(endpoint: str) -> bool:
    """A model of this process lost the server at ``endpoint`` (:func:`mark_lost`)."""
    return endpoint in _lost


def live_devices(gone: List[str]) -> list:
    """The GPU devices llama.cpp may use while the servers ``gone`` (:func:`gone_servers`) are gone
    (those of the live servers first, then the build's own GPUs, as llama.cpp orders them), to be
    given to a load instead of its default of every registered device: ggml would abort asking a
    gone server for its memory, and it cannot unregister a device."""
    gone = set(gone)
    ggml = load_ggml()
    rpc_devs, gpus, igpus = [], [], []
    for i in range(ggml.ggml_backend_dev_count()):
        dev = ggml.ggml_backend_dev_get(i)
        kind = ggml.ggml_backend_dev_type(dev)
        desc = (ggml.ggml_backend_dev_description(dev) or b"").decode(errors="replace")
        if desc in _added:
            if desc not in gone:
                rpc_devs.append(dev)
        elif kind == GGML_BACKEND_DEVICE_TYPE_GPU:
            gpus.append(dev)
        elif kind == GGML_BACKEND_DEVICE_TYPE_IGPU:
            igpus.append(dev)
    return rpc_devs + gpus + (igpus if not gpus else [])


def serve(endpoint: str = "127.0.0.1:50052", *, threads: Optional[int] = None, mem: Optional[int] = None) -> None:
    """Serve this machine's CPU as an RPC device at ``endpoint`` (blocks; llama.cpp's rpc-server with
    its CPU backend). ``mem``: the bytes of memory the device reports, free and total (default: the
    machine's); a client plans its GPU layers for that much (as for a GPU of that size). Only for
    trusted networks: the protocol has no authentication."""
    (endpoint,) = parse_endpoints([endpoint])
    ggml, rpc = _load()
    dev = ggml.ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU)
    if not dev:
        raise MissingDependencyError("ggml has no CPU device")
    if mem is not None:
        from . import _moecache_cpp as C

        dev = C.moecache_device_with_memory(dev, int(mem), int(mem))
    devices = (c_void_p * 1)(dev)
    n = threads if threads else max(1, (os.cpu_count() or 2) // 2)
    parent = os.environ.pop(_PARENT_ENV, "")
    if parent.isdigit():  # a LocalServer's: it ends with the process that started it, however that one ends
        threading.Thread(target=_exit_with_parent, args=(int(parent),), daemon=True).start()
    rpc.ggml_backend_rpc_start_server(endpoint.encode(), None, n, 1, devices)


_PARENT_ENV = "PYMOECACHE_RPC_PARENT"  # (set by LocalServer for its child: the pid it serves)


def _exit_with_parent(pid: int) -> None:
    """Exits this process once `pid` is no longer its parent (killed or gone without leaving the
    ``with`` block: the server would otherwise listen on, orphaned)."""
    while os.getppid() == pid:
        time.sleep(0.5)
    os._exit(0)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class LocalServer:
    """An RPC server of this machine's CPU in a child process on the loopback, for as long as the
    ``with`` block lasts (its ``endpoint`` is ``127.0.0.1:PORT``, a free port by default), or this
    process does: killed inside the block, it takes the server with it.

    The devices it serves are registered with :func:`add_server` on entry (unless ``register=False``).
    ggml cannot remove them again: after the block, a model loaded in this process is given the
    devices that are still there (:func:`live_devices`), and a Llama whose layers were on it raises
    :class:`~pymoecache.errors.DeviceLostError` at its next decode."""

    def __init__(self, port: int = 0, *, threads: int = 1, host: str = "127.0.0.1", timeout: float = 30.0,
                 register: bool = True, mem: Optional[int] = None):
        self.host, self.port, self.threads, self.timeout = host, port, threads, timeout
        self.mem = mem  # bytes of memory the device reports (rpc-server --mem), None: the machine's
        self.register = register  # False: only serve (another process offloads to it)
        self.proc: Optional[subprocess.Popen] = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def __enter__(self) -> "LocalServer":
        self.port = self.port or _free_port(self.host)
        self._log = tempfile.TemporaryFile()  # (its log, for the message if it does not start)
        self.proc = subprocess.Popen([sys.executable, "-m", "pymoecache", "rpc-server", "--host", self.host,
                                      "--port", str(self.port), "--threads", str(self.threads),
                                      *(["--mem", f"{self.mem}b"] if self.mem is not None else [])],
                                     stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, _PARENT_ENV: str(os.getpid())},
                                     cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # (this package)
        deadline = time.monotonic() + self.timeout
        while True:
            if self.proc.poll() is not None:
                self._log.seek(0)
                err = self._log.read().decode(errors="replace")
                raise MissingDependencyError(f"the RPC server exited with {self.proc.returncode}: {err.strip()}")
            try:
                socket.create_connection((self.host, self.port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    self.__exit__(None, None, None)
                    raise MissingDependencyError(f"the RPC server did not listen on {self.endpoint} "
                                                 f"within {self.timeout:g} s") from None
                time.sleep(0.05)
        if self.register:
            add_server(self.endpoint)
            _stopped.discard(self.endpoint)
        return self

    def __exit__(self, *exc) -> None:
        if self.endpoint in _added:
            _stopped.add(self.endpoint)
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self._log.close()
            self.proc = None
