"""The child side of the sandbox (:mod:`sao_megatron.envs.sandbox`): the functions that isolate a
sandbox interpreter before it compiles a byte of the model's code.

They run inside that interpreter *from their source text* (:func:`bootstrap_source` joins them into
the ``-c`` program of ``python -I -S``), so they may use only ``os``, ``sys`` and each other
(``ctypes``/``resource`` are imported inside), and only builtin annotations. Nothing here runs in
the parent process.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import textwrap


def _c_isolate_files(
    src: bytes, uid: int, tmpfs_bytes: int, hidden: list, expose: list, binds: list, pidns: str
) -> None:
    """Mount namespace: private /tmp + workdir, hidden dirs (interpreter re-exposed), read-only /.

    ``binds`` (``(mode, source, target)``, mode ``rw`` or ``ro``) are host directories mounted at
    ``target``: each source is opened first, so it may lie under /tmp or a hidden directory.
    With ``pidns`` ``"1"`` or ``"2"`` the process forks into a new PID namespace with its own
    /proc: the parent stays root and outside, reaps the namespace's init (the child) and exits
    with its status; when that init ends, the kernel kills and reaps everything else in the
    namespace. ``"1"``: the program is that init (the shell's ``bash``). ``"2"``:
    :func:`_c_reaping_init` is, and the program runs as its child, so the program's own signals,
    rlimits and exit status work as without a namespace (an init ignores the signals it has no
    handler for, SIGXCPU included); the parent exits as the program did, of the same signal too.
    """
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    rdonly, nosuid, nodev, remount, bind, rec, mprivate, detach = 1, 2, 4, 32, 4096, 16384, 1 << 18, 2

    def mount(source, target, fstype, flags, data=None):
        args = [None if s is None else s.encode() for s in (source, target, fstype, data)]
        if libc.mount(args[0], args[1], args[2], ctypes.c_ulong(flags), args[3]) != 0:
            err = ctypes.get_errno()
            raise OSError(err, "mount " + target + ": " + os.strerror(err))

    mount(None, "/", None, rec | mprivate)
    held = [(os.open(source, os.O_PATH | os.O_DIRECTORY), mode, target) for mode, source, target in binds]
    private = f"size={max(tmpfs_bytes, 1 << 20)},nr_inodes=16384,mode=1777"
    mount("tmpfs", "/tmp", "tmpfs", nosuid | nodev, private)
    under = [e for e in expose if any(e == h or e.startswith(h + "/") for h in hidden)]
    stage = []
    for i, path in enumerate(under):
        spot = f"/tmp/.expose{i}"
        os.mkdir(spot)
        mount(path, spot, None, bind | rec)
        stage.append((spot, path))
    hidden = [path for path in hidden if os.path.isdir(path)]  # those under /tmp are gone already
    for path in hidden:
        mount("tmpfs", path, "tmpfs", nosuid | nodev, "size=64k,mode=755")
    for spot, path in stage:
        os.makedirs(path, mode=0o755, exist_ok=True)
        mount(spot, path, None, bind | rec)
        mount(None, path, None, remount | bind | rdonly | nosuid | nodev)
        libc.umount2(spot.encode(), detach)
        os.rmdir(spot)
    for fd, mode, target in held:
        os.makedirs(target, mode=0o755, exist_ok=True)
        mount(f"/proc/self/fd/{fd}", target, None, bind | rec)
        mount(None, target, None, remount | bind | nosuid | nodev | (rdonly if mode == "ro" else 0))
        os.close(fd)
    for path in hidden:  # only the tmpfs mounted above (a bind target may have made the path since)
        mount(None, path, None, remount | rdonly | nosuid | nodev, "size=64k,mode=755")
    if os.path.isdir("/dev/shm"):  # private, so multiprocessing works and nothing is shared
        mount("tmpfs", "/dev/shm", "tmpfs", nosuid | nodev, private)
    for shared in ("/var/tmp", "/run/lock"):
        if os.path.isdir(shared):
            mount("tmpfs", shared, "tmpfs", rdonly | nosuid | nodev, "size=4k,mode=755")
    mount(None, "/", None, remount | bind | rdonly)
    os.mkdir("/tmp/work", 0o700)
    with open("/tmp/work/main.py", "wb") as f:
        f.write(src)
    if uid >= 0:
        os.chown("/tmp/work", uid, uid)
    os.chdir("/tmp/work")
    if pidns != "0":
        report, told = os.pipe() if pidns == "2" else (-1, -1)
        os.unshare(os.CLONE_NEWPID)
        child = os.fork()
        if child:
            status = os.waitpid(child, 0)[1]
            if pidns == "2":
                os.close(told)
                status = int(os.read(report, 32) or status)  # the program's status, if the init lived to tell
            code = os.waitstatus_to_exitcode(status)
            if code < 0 and pidns == "2":
                _c_die_of(-code)
            os._exit(code if code >= 0 else 128 - code)
        mount("proc", "/proc", "proc", nosuid | nodev | 8)  # 8: MS_NOEXEC
        if pidns == "2":
            _c_reaping_init(report, told)


def _c_reaping_init(report: int, told: int) -> None:
    """Fork; the parent stays as the PID namespace's init: it reaps every process orphaned into
    the namespace until the child (the program) ends, writes the child's wait status to ``told``
    and exits, whereupon the kernel kills and reaps what is left. The child returns."""
    import ctypes

    ctypes.CDLL(None).prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG=SIGKILL: ends with the parent outside
    program = os.fork()
    if program == 0:
        os.close(report)
        os.close(told)
        return
    os.close(report)
    while True:
        pid, status = os.wait()
        if pid == program:
            os.write(told, str(status).encode())
            os._exit(0)


def _c_die_of(signum: int) -> None:
    """End this process by ``signum``, as the program it ran ended (no core file)."""
    import resource
    import signal

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if signum not in (signal.SIGKILL, signal.SIGSTOP):  # the two whose action cannot be set
        signal.signal(signum, signal.SIG_DFL)  # Python's own handlers (SIGINT, SIGPIPE) would not end us
    os.kill(os.getpid(), signum)
    os._exit(128 + signum)  # a signal whose default is to go on (SIGCHLD, SIGCONT, ...)


def _c_loopback_up() -> None:
    """Bring up the loopback of the new network namespace (it starts down): ``127.0.0.1`` then works
    inside the sandbox and still reaches nothing outside it (the agent's relay to its gateway)."""
    import fcntl
    import socket
    import struct

    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:  # struct ifreq: 16 bytes of name, then the flags (short) in a 24-byte union
        flags = struct.unpack("16sH22x", fcntl.ioctl(sock, 0x8913, struct.pack("16sH22x", b"lo", 0)))[1]
        fcntl.ioctl(sock, 0x8914, struct.pack("16sH22x", b"lo", flags | 1))  # SIOCGIFFLAGS, SIOCSIFFLAGS; IFF_UP
    finally:
        sock.close()


def _c_audit(event: str, args: tuple) -> None:
    """Audit hook: refuse non-AF_UNIX sockets and name lookups (defence in depth, bypassable)."""
    lookups = ("socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr", "socket.getnameinfo")
    if (event == "socket.__new__" and args[1] not in (1, -1)) or event in lookups:
        raise PermissionError("network access is disabled in the sandbox")


def _c_setup(argv: list) -> bytes:
    """Everything before the model's code: namespaces, mounts, rlimits, uid drop. Returns the code."""
    import ctypes
    import resource

    die_with_parent = ctypes.CDLL(None).prctl  # PR_SET_PDEATHSIG=SIGKILL: a killed supervisor ends the sandbox
    die_with_parent(1, 9, 0, 0, 0)  # (set again below: a fork or a uid change clears it)
    uid_rule, ns, preload, lim, hidden, expose, binds = argv[:7]
    uid = os.getpid() + int(uid_rule[4:]) if uid_rule.startswith("pid+") else int(uid_rule)
    cpu, mem, fsize, nofile, nproc, tmpfs, nice = (int(x) for x in lim.split(","))
    os.nice(nice)
    with open("main.py", "rb") as f:
        src = f.read()
    flags = (os.CLONE_NEWNET if ns[0] in "12" else 0) | (os.CLONE_NEWNS if ns[1] == "1" else 0)
    if flags:
        os.unshare(flags)
    if ns[0] == "2":
        _c_loopback_up()
    if ns[1] == "1":
        lines = [[p for p in arg.split("\n") if p] for arg in (hidden, expose, binds)]
        _c_isolate_files(src, uid, tmpfs, lines[0], lines[1], [b.split("\t") for b in lines[2]], ns[2:] or "0")
    elif uid >= 0:
        os.chown(".", uid, uid)
    for name in preload.split() if preload != "-" else ():
        __import__(name)
    for res, value in (
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_CPU, cpu),
        (resource.RLIMIT_AS, mem),
        (resource.RLIMIT_FSIZE, fsize),
        (resource.RLIMIT_NOFILE, nofile),
        (resource.RLIMIT_NPROC, nproc),
    ):
        resource.setrlimit(res, (value, value + 1 if res == resource.RLIMIT_CPU else value))
    if uid >= 0:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    die_with_parent(1, 9, 0, 0, 0)
    return src


def _c_main(argv: list) -> None:
    """Set up, then run the code as the real ``__main__`` (so pickle/multiprocessing find it), or,
    when arguments follow the seven of the set-up, ``execv`` them (the code stays in ./main.py)."""
    sys_ = sys
    os_ = os
    try:
        src = _c_setup(argv)
        if len(argv) > 7:
            os_.execv(argv[7], argv[7:])
    except BaseException as exc:
        sys_.stderr.write(f"sandbox setup failed: {exc!r}\n")
        sys_.stderr.flush()
        os_._exit(125)
    sys_.addaudithook(_c_audit)
    # typeshed says TextIO; the interpreter's own stdout/stderr are io.TextIOWrapper.
    sys_.stdout.reconfigure(errors="backslashreplace")  # pyright: ignore[reportAttributeAccessIssue]
    sys_.stderr.reconfigure(errors="backslashreplace")  # pyright: ignore[reportAttributeAccessIssue]
    sys_.argv = ["main.py"]
    namespace = sys_.modules["__main__"].__dict__
    for name in [n for n in namespace if n.startswith("_c_")] + ["os", "sys"]:
        del namespace[name]
    namespace["__file__"] = "main.py"
    try:
        exec(compile(src, "main.py", "exec"), namespace)
    except SystemExit:
        raise
    except BaseException as exc:  # report without the bootstrap's own frames
        import traceback

        tb = exc.__traceback__
        traceback.print_exception(type(exc), exc, tb.tb_next if tb is not None else None)
        sys_.exit(1)


@functools.cache
def bootstrap_source() -> str:
    """The ``-c`` program of the sandbox interpreter: the ``_c_*`` functions and a call."""
    funcs = (_c_isolate_files, _c_reaping_init, _c_die_of, _c_loopback_up, _c_audit, _c_setup, _c_main)
    body = "\n\n".join(textwrap.dedent(inspect.getsource(f)) for f in funcs)
    return f"import os, sys\n\n{body}\n\n_c_main(sys.argv[1:])\n"


# Sent by a helper running as the sandbox uid: kill(-1) reaches every process of that uid.
KILL_UID = """
import os, sys
uid = int(sys.argv[1])
os.setgroups([])
os.setresgid(uid, uid, uid)
os.setresuid(uid, uid, uid)
try:
    os.kill(-1, 9)
except ProcessLookupError:
    pass
"""
