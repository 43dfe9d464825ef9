"""Test-only fork server ("zygote"): the suite's Python commands start with torch and fairseq
already imported.

Importing torch and fairseq is most of a fairseq command's start (about 3.5 s of a 4-updates
``fairseq-train`` on this machine), and the suite starts a few hundred such commands. The test
session (``tests/conftest.py``) starts one server per pytest worker, which imports ``PRELOAD``
once and listens on the Unix socket named by ``$NORMPLUG_TEST_ZYGOTE``. Every Python process a
test starts finds ``sitecustomize`` (this folder is on its PYTHONPATH), which calls
:func:`start_through_zygote` before the command's own code runs:

* the process (the *client*) sends its argv, environment and working directory, and its stdin,
  stdout and stderr as file descriptors;
* the server forks a *keeper*, which forks the *command*: it takes over the descriptors, the
  environment and the working directory, and runs the script as ``__main__``;
* the client forwards the signals it receives to the command, and exits with the command's
  exit status, or is killed by the signal that killed it;
* when the client dies (``kill -9``, a killed process group), the keeper kills the command's
  process group: a killed command is as dead as if it had started on its own.

A command starts on its own, as without the server, when anything could make it differ: no
server yet (it is still importing), a Python command given with ``-c`` or ``-m``, another
interpreter (the wheel test's fresh virtual environment), or an environment variable read
while the interpreter or the preloaded modules start (``FIXED_AT_START``) that differs from
the server's. Not the same as a fresh process: ``resource`` usage of the client covers only
the client, and warnings the preloaded modules gave at import are not repeated.
"""
import atexit
import gc
import json
import os
import select
import signal
import socket
import sys

ENV = "NORMPLUG_TEST_ZYGOTE"
#: what the server imports once: the bulk of every fairseq command's start. Not the plugin,
#: which reads NORMPLUG_* at import, and not fairseq_cli.*, which configure logging at import
PRELOAD = ("numpy", "torch", "fairseq", "fairseq.tasks", "fairseq.models", "fairseq.criterions",
           "fairseq.optim", "fairseq.checkpoint_utils", "fairseq.options", "fairseq.sequence_generator",
           "sacrebleu")
#: prefixes of environment variables read when the interpreter or PRELOAD start
FIXED_AT_START = ("PYTHON", "TORCH", "PYTORCH", "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "MALLOC_",
                  "LD_", "CUDA", "LOGLEVEL", "LC_", "LANG")
#: ... except these, which the command applies itself (:func:`_become`)
ADJUSTABLE = ("PYTHONUNBUFFERED", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def _fixed(env: dict) -> dict:
    return {k: v for k, v in env.items() if k.startswith(FIXED_AT_START) and k not in ADJUSTABLE}


def _send(sock: socket.socket, message: dict, fds=()) -> None:
    data = json.dumps(message).encode() + b"\n"
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.sendall(data)


def _receive(sock: socket.socket, want_fds: int = 0):
    """One newline-terminated JSON message (and up to ``want_fds`` descriptors); None at EOF."""
    data, fds = b"", []
    while not data.endswith(b"\n"):
        if want_fds and not fds:
            chunk, fds, _, _ = socket.recv_fds(sock, 1 << 20, want_fds)
        else:
            chunk = sock.recv(1 << 20)
        if not chunk:
            return None, fds
        data += chunk
    return json.loads(data), fds


# ---- the client: runs in sitecustomize of every process a test starts ------------------------

def start_through_zygote() -> None:
    """Run this process's command in the server and exit with its status; return at once (the
    command then starts here, normally) when the server is absent or refuses it."""
    path = os.environ.get(ENV)
    script = sys.argv[0] if sys.argv else ""
    if not path or script in ("", "-c", "-m") or not os.path.isfile(script):
        return
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        _send(sock, {"argv": sys.argv, "cwd": os.getcwd(), "env": dict(os.environ),
                     "executable": sys.executable}, fds=(0, 1, 2))
        answer, _ = _receive(sock)
    except OSError:
        answer = None
    if not answer or "pid" not in answer:
        sock.close()
        return
    pid = answer["pid"]

    def forward(signum, _frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for signum in FORWARDED:
        signal.signal(signum, forward)
    end, _ = _receive(sock)
    if end is None:  # the keeper died: the command's fate is unknown
        os._exit(70)
    if "signal" in end:
        signal.signal(end["signal"], signal.SIG_DFL)
        os.kill(os.getpid(), end["signal"])
    os._exit(end["exit"])


# ---- the server ---------------------------------------------------------------------------

def serve(path: str):
    """Import PRELOAD, then fork a keeper per client. Returns only in a command's process: the
    command to run (the caller runs it at the top level, so that it exits like a script)."""
    import importlib
    import logging

    root = logging.getLogger()
    for name in PRELOAD:
        importlib.import_module(name)
    # as in a fresh interpreter: the root logger unconfigured, for the command's basicConfig
    # (fairseq_cli.train's, before it imports fairseq; a preloaded module added a handler)
    for handler in root.handlers[:]:
        root.removeHandler(handler)
    root.setLevel(logging.WARNING)
    gc.collect()
    gc.freeze()  # the collector leaves the preloaded objects alone: no copy-on-write of the heap
    fixed = _fixed(os.environ)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # clients see the socket only once it accepts
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # keepers are reaped by the kernel
    parent = os.getppid()
    while True:
        readable, _, _ = select.select([listener], [], [], 5.0)
        if os.getppid() != parent:  # the test session is gone
            os._exit(0)
        if not readable:
            continue
        conn, _ = listener.accept()
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            command = _keep(conn, fixed)
            if command is not None:
                return command
            os._exit(0)
        conn.close()


def _keep(conn: socket.socket, fixed: dict):
    """The keeper: check the request, fork the command, report how it ended. Returns the
    request in the command's process, None in the keeper when it is done."""
    request, fds = _receive(conn, want_fds=3)
    if (request is None or len(fds) != 3 or request["executable"] != sys.executable
            or _fixed(request["env"]) != fixed):
        _send(conn, {"refused": True})
        return None
    pid = os.fork()
    if pid == 0:
        os.setpgid(0, 0)
        conn.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        return request
    for fd in fds:
        os.close(fd)
    _send(conn, {"pid": pid})
    watch = os.pidfd_open(pid)
    while True:
        readable, _, _ = select.select([conn, watch], [], [])
        if watch in readable:
            _, status = os.waitpid(pid, 0)
            if os.WIFSIGNALED(status):
                _send(conn, {"signal": os.WTERMSIG(status)})
            else:
                _send(conn, {"exit": os.WEXITSTATUS(status)})
            return None
        if not conn.recv(1):  # the client died: so does the command, with its children
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
            return None


def _become(request: dict) -> None:
    """Turn this forked process into the requested command's process (before running it)."""
    import torch

    env = request["env"]
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request["cwd"])
    for signum in FORWARDED:
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    threads = env.get("OMP_NUM_THREADS") or env.get("MKL_NUM_THREADS")
    torch.set_num_threads(int(threads) if threads else os.cpu_count())
    if env.get("PYTHONUNBUFFERED"):
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(line_buffering=True, write_through=True)
    script = os.path.abspath(request["argv"][0])
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(script)


def main() -> None:
    request = serve(sys.argv[1])
    _become(request)
    import runpy
    import threading
    import traceback

    try:
        runpy.run_path(os.path.abspath(request["argv"][0]), run_name="__main__")
        code = 0
    except SystemExit as end:
        code = end.code
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:  # reported by sys.excepthook, as Python does (the plugin's exits 2)
        code = 1
        try:
            sys.excepthook(*sys.exc_info())
        except SystemExit as end:
            code = end.code
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    # what the interpreter does at exit, without tearing down the inherited heap (which would
    # copy every page of it): wait for threads, run atexit, flush
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if code == -signal.SIGINT:  # as Python ends on an uncaught KeyboardInterrupt
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code or 0)


if __name__ == "__main__":
    main()
