"""The runner: the program that runs INSIDE the sandbox, set up and then running the model's code.

The launcher ships this file's text to a fresh interpreter (``python -I -u -c <text> <config fd>``; the
configuration itself, a JSON dict, is read from that descriptor), so it uses only the standard library and
nothing of the package it lives in. Roles (``cfg["role"]``): ``"cell"`` runs one piece of code (cold mode);
``"server"`` imports ``warm_imports`` and then serves requests on a socket, forking one child per call (warm
mode), with the code and output files passed as descriptors it never reads. The host imports the output
helper from here too. See docs/sandbox.md.
"""

import ctypes
import errno
import json
import os
import resource
import sys

# Modules used only by the cell or only by the server are imported where they are used, so a cold
# cell starts no heavier than it must and finds no server modules already loaded.

MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 8, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 4, 24, 36, 38
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
SYS_MOUNT_SETATTR, AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = 442, -100, 0x8000, 1  # 442 on every architecture
MOUNT_ATTR_NODEV = 0x4
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO = 0x7FFF0000, 0x00050000
SYSCALLS = {
    # audit arch, then the numbers of the system calls the runner makes or denies, per machine.
    "x86_64": {
        "arch": 0xC000003E,
        "pivot_root": 155,
        "keyctl": 250,
        "add_key": 248,
        "request_key": 249,
        "memfd_create": 319,
        "memfd_secret": 447,
        "shmget": 29,
        "flock": 73,
        "fcntl": 72,
        "inotify_init": 253,
        "inotify_init1": 294,
        "inotify_add_watch": 254,
        "fanotify_init": 300,
        "fanotify_mark": 301,
        "io_uring_setup": 425,
        "io_uring_enter": 426,
        "io_uring_register": 427,
        "userfaultfd": 323,
        "perf_event_open": 298,
        "bpf": 321,
        "setns": 308,
        "unshare": 272,
        "clone": 56,
        "clone3": 435,
    },
    "aarch64": {
        "arch": 0xC00000B7,
        "pivot_root": 41,
        "keyctl": 219,
        "add_key": 217,
        "request_key": 218,
        "memfd_create": 279,
        "memfd_secret": 447,
        "shmget": 194,
        "flock": 32,
        "fcntl": 25,
        "inotify_init1": 26,
        "inotify_add_watch": 27,
        "fanotify_init": 262,
        "fanotify_mark": 263,
        "io_uring_setup": 425,
        "io_uring_enter": 426,
        "io_uring_register": 427,
        "userfaultfd": 282,
        "perf_event_open": 241,
        "bpf": 280,
        "setns": 268,
        "unshare": 97,
        "clone": 220,
        "clone3": 435,
    },
}
"""System call numbers by ``os.uname().machine``; elsewhere the unshare mode and the seccomp filter are unavailable."""
FCNTL_DENIED_COMMANDS = (5, 6, 7, 36, 37, 38, 1024, 1025, 1026)
"""F_GETLK, F_SETLK, F_SETLKW, F_OFD_GETLK, F_OFD_SETLK, F_OFD_SETLKW, F_SETLEASE, F_GETLEASE (file locks and
leases) and F_NOTIFY (directory change notification)."""
DENIED_ALWAYS = (
    "keyctl",
    "add_key",
    "request_key",
    "flock",
    "inotify_init",
    "inotify_init1",
    "inotify_add_watch",
    "fanotify_init",
    "fanotify_mark",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "userfaultfd",
    "perf_event_open",
    "bpf",
    "setns",
)
"""Denied (EPERM) in every mode: the kernel keyrings (shared with the host and between calls); file locks and
file-change notifications (inotify, fanotify; with the ``fcntl`` commands above): channels between concurrent
calls through any file they can both open, read-only ones included, that also count the trainer's own opens;
and kernel surface model code never needs that is a frequent source of kernel escapes (io_uring, user-mode
userfaultfd, perf events, bpf, joining namespaces)."""
DENIED_WITHOUT_CGROUP = ("memfd_create", "memfd_secret", "shmget")
"""Denied when no per-call memory cgroup counts shared memory: anonymous files and System V segments
are not bounded by ``RLIMIT_AS``."""
DENIED_NOTE = (
    "(The sandbox denies some operations: file locks and change notifications, new namespaces, io_uring, "
    "perf events, bpf, userfaultfd, kernel keyrings.)"
)
"""Printed after the traceback of code that died of an EPERM or ENOSYS error, which may be the seccomp filter's."""
CLONE_NEWCGROUP, CLONE_NEWTIME = 0x02000000, 0x00000080
NAMESPACE_FLAGS = (
    CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET
)
"""``unshare`` and ``clone`` with any of these flags fail with EPERM where new namespaces are banned (``unshare``
also with ``CLONE_NEWTIME``, which in ``clone`` is part of the exit signal); ``clone3``, whose flags sit in
memory a filter cannot read, fails with ENOSYS, so the C library falls back to ``clone`` (threads, ``fork``,
``posix_spawn`` work)."""
DEV_NODES = ("null", "zero", "full", "random", "urandom", "tty")
"""The device nodes of the private ``/dev`` (what bubblewrap's ``--dev`` provides)."""
LINUX_CAPABILITY_VERSION_3 = 0x20080522
OVERFLOW_ID = 65534

PRIVATE_TMPFS = ("/tmp", "/dev/shm")
"""Replaced by a fresh tmpfs in every sandbox (and in every warm call)."""
CELL_FILENAME = "<cell>"
"""Filename of the model's code in tracebacks; frames of any other file are the runner's and hidden."""
CHILD_MODULES = (
    "ast",
    "atexit",
    "builtins",
    "io",
    "linecache",
    "random",
    "shutil",
    "tempfile",
    "threading",
    "traceback",
    "types",
)
"""What every warm call's child needs anyway: imported once by the server instead of once per call."""


def load_libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    ul = ctypes.c_ulong
    libc.prctl.argtypes = [ctypes.c_int, ul, ul, ul, ul]
    libc.unshare.argtypes = [ctypes.c_int]
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ul, ctypes.c_char_p]
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    return libc


def check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def prctl(libc: ctypes.CDLL, option: int, arg: int) -> int:
    return libc.prctl(option, arg, 0, 0, 0)


def mount(libc: ctypes.CDLL, source: str | None, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    check(libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def set_readonly(libc: ctypes.CDLL, path: str, recursive: bool, extra: int = 0) -> None:
    # mount_setattr(2) (Linux >= 5.12): flips the read-only flag (and ``extra`` MOUNT_ATTR_* flags) of a whole
    # mount tree at once, in our mount namespace only.
    class MountAttr(ctypes.Structure):
        _fields_ = [
            ("attr_set", ctypes.c_uint64),
            ("attr_clr", ctypes.c_uint64),
            ("propagation", ctypes.c_uint64),
            ("userns_fd", ctypes.c_uint64),
        ]

    attr = MountAttr(MOUNT_ATTR_RDONLY | extra, 0, 0, 0)
    flags = AT_RECURSIVE if recursive else 0
    ret = libc.syscall(
        ctypes.c_long(SYS_MOUNT_SETATTR),
        ctypes.c_int(AT_FDCWD),
        path.encode(),
        ctypes.c_uint(flags),
        ctypes.byref(attr),
        ctypes.c_size_t(ctypes.sizeof(attr)),
    )
    check(0 if ret == 0 else -1, f"mount_setattr {path}")


def write_id_maps(uid: int, gid: int) -> None:
    # Map our own uid/gid (from the parent namespace) and nothing else: allowed without privilege.
    # Inside, 0 becomes 65534: mapping root needs CAP_SETFCAP in the parent (Linux >= 5.12).
    inside_uid, inside_gid = uid or OVERFLOW_ID, gid or OVERFLOW_ID
    for name, text in (
        ("uid_map", f"{inside_uid} {uid} 1\n"),
        ("setgroups", "deny\n"),
        ("gid_map", f"{inside_gid} {gid} 1\n"),
    ):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


class CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def drop_caps(libc: ctypes.CDLL) -> None:
    for cap in range(64):  # bounding set: nothing can be regained through exec of a file with caps
        if prctl(libc, PR_CAPBSET_DROP, cap) != 0 and ctypes.get_errno() == errno.EINVAL:  # past the last cap
            break
    check(libc.capset(ctypes.byref(CapHeader(LINUX_CAPABILITY_VERSION_3, 0)), (CapData * 2)()), "capset")
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    check(prctl(libc, PR_SET_NO_NEW_PRIVS, 1), "PR_SET_NO_NEW_PRIVS")


def set_effective_caps(libc: ctypes.CDLL, on: bool) -> None:
    """Raise (``on``) or clear the effective capability set; the permitted set stays as it is."""
    header, data = CapHeader(LINUX_CAPABILITY_VERSION_3, 0), (CapData * 2)()
    check(libc.capget(ctypes.byref(header), data), "capget")
    for half in data:
        half.effective = half.permitted if on else 0
    check(libc.capset(ctypes.byref(header), data), "capset")


class SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]


def seccomp_program(deny: list[str], no_namespaces: bool) -> SockFprog:
    """A filter that makes the named system calls and the ``fcntl`` commands of :data:`FCNTL_DENIED_COMMANDS`
    fail with EPERM, new namespaces too when ``no_namespaces`` (see :data:`NAMESPACE_FLAGS`), and every system
    call of another ABI (i386 or x32 on x86_64) with ENOSYS. Names this machine has no such call for are
    skipped. Built once per server (~1 ms in Python), installed per call by :func:`install_seccomp`."""
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ/JGE/JSET|K, BPF_RET|K
    nrs = SYSCALLS.get(os.uname().machine)
    if nrs is None:  # refuse rather than run without the filter
        raise OSError(errno.ENOSYS, f"no seccomp filter for {os.uname().machine} (known: {', '.join(SYSCALLS)})")
    allow, eperm, enosys = SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO | errno.EPERM, SECCOMP_RET_ERRNO | errno.ENOSYS
    prog = [(ld, 0, 0, 4), (jeq, 1, 0, nrs["arch"]), (ret, 0, 0, enosys), (ld, 0, 0, 0)]
    if nrs["arch"] == 0xC000003E:
        prog += [(jge, 0, 1, 0x40000000), (ret, 0, 0, enosys)]  # x32 system calls
    for name in dict.fromkeys(deny):
        if name in nrs:
            prog += [(jeq, 0, 1, nrs[name]), (ret, 0, 0, eperm)]
    # Blocks that read an argument end in a return of their own (the accumulator no longer holds the number).
    # seccomp_data: nr at 0, arch at 4, instruction pointer at 8, args[i] at 16 + 8 i (the low half first).
    if no_namespaces:
        prog += [(jeq, 0, 1, nrs["clone3"]), (ret, 0, 0, enosys)]
        for name, flags in (("unshare", NAMESPACE_FLAGS | CLONE_NEWTIME), ("clone", NAMESPACE_FLAGS)):
            prog += [
                (jeq, 0, 4, nrs[name]),
                (ld, 0, 0, 16),
                (jset, 0, 1, flags),
                (ret, 0, 0, eperm),
                (ret, 0, 0, allow),
            ]
    prog += [(jeq, 0, 1 + 2 * len(FCNTL_DENIED_COMMANDS), nrs["fcntl"]), (ld, 0, 0, 24)]  # fcntl(fd, cmd, ...)
    for cmd in FCNTL_DENIED_COMMANDS:
        prog += [(jeq, 0, 1, cmd), (ret, 0, 0, eperm)]
    prog.append((ret, 0, 0, allow))
    filters = (SockFilter * len(prog))(*[SockFilter(*ins) for ins in prog])
    program = SockFprog(len(prog), filters)
    program._keep = filters  # the pointer does not keep the array alive
    return program


def install_seccomp(libc: ctypes.CDLL, program: SockFprog) -> None:
    """Install ``program`` (:func:`seccomp_program`) on this thread; needs ``no_new_privs``."""
    check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(program), 0, 0), "seccomp filter")


def join_cgroups(cfg: dict, close: bool) -> None:
    # Descriptors of the call's cgroup ``tasks`` files, opened by the host (root): writing "0" moves
    # the writing thread (we are single-threaded here), and whatever it forks later stays in the
    # call's memory/pids budget. The model's code
    # must never hold one (it could move itself out), so they are closed before it runs.
    for fd in cfg.get("cgroup_fds", ()):
        os.write(fd, b"0")
        if close:
            os.close(fd)


def seccomp_deny(cfg: dict) -> list[str]:
    return [*DENIED_ALWAYS, *(() if cfg.get("cgroup_fds") else DENIED_WITHOUT_CGROUP)]


def make_mount_point(path: str, like_dir: bool) -> None:
    os.makedirs(os.path.dirname(path) or "/", mode=0o755, exist_ok=True)
    if like_dir:
        os.makedirs(path, mode=0o755, exist_ok=True)
    elif not os.path.lexists(path):
        open(path, "w").close()


def bind_ro(libc: ctypes.CDLL, fd: int, target: str) -> None:
    # From an O_PATH handle taken before anything was covered: no path traversal at bind time.
    make_mount_point(target, os.path.isdir(f"/proc/self/fd/{fd}"))
    mount(libc, f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC, None)
    set_readonly(libc, target, True)


def under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def cover(libc: ctypes.CDLL, target: str) -> None:
    """Hide ``target``: an empty read-only-to-be tmpfs over a folder, /dev/null over a file.

    The file's /dev/null is bound read-only and ``nodev``, as bubblewrap's ``--ro-bind /dev/null`` lands on its
    ``nodev`` root: opening the hidden file fails (EACCES) in both modes, rather than reading empty here."""
    if os.path.isdir(target):
        mount(libc, "tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=64k")
    else:
        mount(libc, "/dev/null", target, None, MS_BIND, None)
        set_readonly(libc, target, False, MOUNT_ATTR_NODEV)


def setup_unshare_fs(cfg: dict, libc: ctypes.CDLL) -> None:
    """Build the sandbox's file tree the way bubblewrap does, and pivot into it.

    A fresh tmpfs becomes the root; only ``cfg["layout"]`` is shown (the interpreter, its libraries
    and site-packages, read-only), plus a fresh /proc, a private /dev with its own devpts, private
    /tmp, /dev/shm and scratch. The root itself ends read-only.
    """
    disk = cfg["disk_bytes"]
    mount(libc, None, "/", None, MS_REC | MS_PRIVATE, None)
    shown = [op[1] for op in cfg["layout"] if op[0] == "ro-bind"] + list(cfg["late"])
    handles = {p: os.open(p, os.O_PATH | os.O_CLOEXEC) for p in dict.fromkeys(shown)}
    dev = {n: os.open(f"/dev/{n}", os.O_PATH | os.O_CLOEXEC) for n in DEV_NODES if os.path.exists(f"/dev/{n}")}
    new = "/tmp"  # any directory will do: the tmpfs mounted on it (in our namespace only) becomes the root
    mount(libc, "tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    os.umask(0o022)
    late_covers = [op for op in cfg["layout"] if op[0] == "cover" and any(under(op[1], p) for p in cfg["late"])]
    for op in cfg["layout"]:
        target = new + op[-1]
        if op[0] == "symlink":
            os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
            os.symlink(op[1], target)
        elif op[0] == "ro-bind":
            bind_ro(libc, handles[op[1]], target)
        elif op[0] == "cover" and op not in late_covers:
            cover(libc, target)
    os.makedirs(new + "/proc", mode=0o555)
    mount(libc, "proc", new + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    os.makedirs(new + "/dev", mode=0o755)
    mount(libc, "tmpfs", new + "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=64k")
    for name, fd in dev.items():
        bind_ro(libc, fd, f"{new}/dev/{name}")
        os.close(fd)
    os.mkdir(new + "/dev/pts")
    mount(libc, "devpts", new + "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=620")
    for link, target in (
        ("ptmx", "pts/ptmx"),
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ):
        os.symlink(target, f"{new}/dev/{link}")
    for p in PRIVATE_TMPFS:  # /tmp and /dev/shm
        os.makedirs(new + p, exist_ok=True)
        mount(libc, "tmpfs", new + p, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={disk}")
    for p in cfg["late"]:  # interpreter paths under /tmp or /dev/shm (a virtualenv in /tmp)
        bind_ro(libc, handles[p], new + p)
    for op in late_covers:  # hidden paths inside those: covered once they are there, not before
        cover(libc, new + op[1])
    for fd in handles.values():
        os.close(fd)
    make_mount_point(new + cfg["scratch"], True)
    mount(libc, "tmpfs", new + cfg["scratch"], "tmpfs", MS_NOSUID | MS_NODEV, f"mode=0755,size={disk}")
    for op in cfg["layout"]:  # read-only once the paths shown again inside them have mount points
        if op[0] == "cover" and os.path.isdir(new + op[1]):
            set_readonly(libc, new + op[1], False)
    set_readonly(libc, new + "/dev", False)
    os.chdir(new)
    nr = SYSCALLS[os.uname().machine]["pivot_root"]
    check(0 if libc.syscall(ctypes.c_long(nr), b".", b".") == 0 else -1, "pivot_root")
    libc.umount2(b".", MNT_DETACH)  # the old root, stacked under the new one
    os.chdir("/")
    set_readonly(libc, "/", False)


def setup_process(cfg: dict, libc: ctypes.CDLL) -> None:
    """Mounts (unshare mode), uid drop, own user namespace, no capabilities: before any model code."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if cfg["role"] == "cell":
        join_cgroups(cfg, close=True)  # a warm server stays outside: each of its calls joins the call's cgroup
    if cfg["fs"] == "unshare":
        setup_unshare_fs(cfg, libc)
    for p in cfg["lift_proc_covers"]:
        libc.umount2(p.encode(), MNT_DETACH)  # best effort
    if cfg["fs"] != "none":
        os.chdir(cfg["scratch"])
    uid = cfg["drop_uid"]
    if cfg["userns"]:
        try:  # the user namespace's own NPROC budget is what counts; raising needs root, so now
            resource.setrlimit(resource.RLIMIT_NPROC, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        except (ValueError, OSError):
            pass
    if uid is not None:
        os.chown(cfg["scratch"], uid, uid)
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)  # leaving uid 0 clears the capability sets
    if cfg["userns"]:
        uid, gid = os.getuid(), os.getgid()  # after unshare these read as the overflow id
        prctl(libc, PR_SET_DUMPABLE, 1)  # /proc/self/uid_map belongs to root otherwise
        check(libc.unshare(CLONE_NEWUSER), "unshare(CLONE_NEWUSER)")
        write_id_maps(uid, gid)
    drop_caps(libc)
    # A server must not be readable/writable through /proc by the code it runs (same uid).
    prctl(libc, PR_SET_DUMPABLE, 0 if cfg["role"] == "server" else 1)


def apply_limits(cfg: dict) -> None:
    try:
        with open("/proc/self/statm") as f:
            baseline = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        baseline = 0
    mem = cfg["memory_bytes"] + baseline
    cpu = int(cfg["cpu_s"])
    for res, soft, hard in (
        (resource.RLIMIT_AS, mem, mem),
        (resource.RLIMIT_CPU, cpu, cpu + 1),
        (resource.RLIMIT_FSIZE, cfg["fsize_bytes"], cfg["fsize_bytes"]),
        (resource.RLIMIT_NOFILE, cfg["nofile"], cfg["nofile"]),
        (resource.RLIMIT_NPROC, cfg["nproc"], cfg["nproc"]),
        (resource.RLIMIT_CORE, 0, 0),
    ):
        resource.setrlimit(res, (soft, hard))


def exec_cell(code: str) -> int:
    """Run ``code`` as a notebook cell in a fresh ``__main__``; returns the exit status."""
    import ast
    import builtins
    import linecache
    import traceback
    import types

    name = CELL_FILENAME
    cell = types.ModuleType("__main__")
    cell.__builtins__ = builtins
    sys.modules["__main__"] = cell
    sys.argv = [""]
    sys.path.insert(0, "")  # like `python -c`: the code may import modules it wrote to its cwd
    sys.dont_write_bytecode = True
    linecache.cache[name] = (len(code), None, code.splitlines(True), name)
    try:
        tree = ast.parse(code, name)
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, name, "exec"), cell.__dict__)
        if last is not None:
            value = eval(compile(last, name, "eval"), cell.__dict__)
            if value is not None:
                print(repr(value))
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return (e.code or 0) & 0xFF
        print(e.code, file=sys.stderr)
        return 1
    except BaseException as e:
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != name:
            tb = tb.tb_next  # hide the runner's frames: the model sees only its own code
        try:
            traceback.print_exception(type(e), e, tb)
            if isinstance(e, OSError) and e.errno in (errno.EPERM, errno.ENOSYS):
                print(DENIED_NOTE, file=sys.stderr)
        except BaseException:
            pass
        return 1


def exit_like_interpreter(status: int) -> None:
    """Wait for the code's non-daemon threads, run its atexit handlers, flush, and exit."""
    import atexit

    try:
        import threading

        threading._shutdown()
    except BaseException:
        pass
    try:
        atexit._run_exitfuncs()
    except BaseException:
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    os._exit(status)


def read_tail(fd: int, max_chars: int, limit_bytes: int) -> tuple[str, bool]:
    """The last ``max_chars`` characters written to ``fd`` (a marker line first if cut), and whether it was cut."""
    size = os.fstat(fd).st_size
    budget = max_chars * 4 + 4
    start = max(0, size - budget)
    text = os.pread(fd, size - start, start).decode("utf-8", "replace")
    if start == 0 and len(text) <= max_chars:
        return text, False
    note = f"; the {limit_bytes >> 20} MB output limit was hit and later writes failed" if size >= limit_bytes else ""
    marker = "[sandbox: output truncated, about {:,} bytes cut{}; the last {:,} characters follow]\n"
    keep = max(0, max_chars - len(marker.format(size, note, max_chars)))
    tail = text[-keep:] if keep else ""
    cut = max(0, size - len(tail.encode("utf-8", "replace")))
    return marker.format(cut, note, len(tail)) + tail, True


def dup_high(fds: list[int]) -> list[int]:
    """Copies of ``fds`` numbered above the standard descriptors and the ones being placed."""
    import fcntl

    return [fcntl.fcntl(fd, fcntl.F_DUPFD, 64) for fd in fds]


def close_fds_except(keep: set[int]) -> None:
    """Close every descriptor from 3 up that is not in ``keep`` (an inherited one the launcher left open)."""
    low = 3
    for fd in sorted(k for k in keep if k >= 3):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, 1 << 20)


def read_code(fd: int) -> str:
    with os.fdopen(fd, "rb") as f:
        return f.read().decode("utf-8", "surrogatepass")


def prepare_child_io(code_fd: int, out_fd: int, err_fd: int, status_fd: int) -> None:
    """stdin /dev/null, stdout and stderr the call's output files, 3 the status pipe, 4 the code; nothing else."""
    import io

    code_fd, out_fd, err_fd, status_fd = dup_high([code_fd, out_fd, err_fd, status_fd])
    devnull = os.open("/dev/null", os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    os.dup2(status_fd, 3)
    os.dup2(code_fd, 4)
    close_fds_except({3, 4})  # the server's socket, its log and everything else
    streams = []
    for fd in (1, 2):
        raw = io.FileIO(fd, "w", closefd=False)
        streams.append(io.TextIOWrapper(raw, encoding="utf-8", errors="backslashreplace", write_through=True))
    sys.stdout = sys.__stdout__ = streams[0]
    sys.stderr = sys.__stderr__ = streams[1]
    sys.stdin = sys.__stdin__ = open(0, closefd=False)


def mount_call_fs(cfg: dict, libc: ctypes.CDLL, scratch: str) -> bool:
    """Fresh tmpfs for scratch, /tmp and /dev/shm, a fresh devpts; returns whether a fresh /proc was mounted."""
    disk = cfg["disk_bytes"]
    mount(libc, None, "/", None, MS_REC | MS_PRIVATE, None)
    covers = [p for p in PRIVATE_TMPFS if os.path.isdir(p)]
    # Interpreter paths under a fresh tmpfs (a virtualenv in /tmp): O_PATH handles taken before the
    # tmpfs covers them, bound back read-only through /proc/self/fd afterwards.
    late = [(p, os.open(p, os.O_PATH | os.O_CLOEXEC)) for p in cfg["late"]]
    for p in covers:
        mount(libc, "tmpfs", p, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={disk}")
    for p, fd in late:
        bind_ro(libc, fd, p)
        os.close(fd)
    os.makedirs(scratch, exist_ok=True)
    mount(libc, "tmpfs", scratch, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=0755,size={disk}")
    try:  # a pty left open by the code is visible to no other call
        mount(libc, "devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=620")
    except OSError:
        pass
    try:  # fresh /proc: the code sees only its own PID namespace
        mount(libc, "proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
        return True
    except OSError:
        return False


def report_error(fd: int, e: BaseException) -> None:
    try:
        os.write(fd, ("E" + f"{type(e).__name__}: {e}".replace("\n", " ") + "\n").encode())
    except BaseException:
        pass


def call_child(cfg: dict, libc: ctypes.CDLL, fds: list[int], status_fd: int, scratch: str) -> None:
    """A warm call, forked from the server: set up, then run the code read from ``fds[0]`` (never the server's
    memory: the server does not read call data). Writes ``R`` (or ``E<why>``) to the status pipe."""
    report_fd = [status_fd]
    try:
        code = setup_call_child(cfg, libc, fds, status_fd, scratch, report_fd)
    except BaseException as e:
        report_error(report_fd[0], e)
        os._exit(125)
    # One line per write: pipe writes this small are atomic, whichever process writes first.
    os.write(3, b"R\n")
    os.close(3)
    exit_like_interpreter(exec_cell(code))


def setup_call_child(
    cfg: dict, libc: ctypes.CDLL, fds: list[int], status_fd: int, scratch: str, report_fd: list[int]
) -> str:
    import atexit

    join_cgroups(cfg, close=False)  # before the forks below: the code's process starts inside the call's budget
    if cfg["per_call_ns"]:
        # A nested user namespace grants the caps for the others without any privilege; the caller
        # stays outside the new PID namespace.
        uid, gid = os.getuid(), os.getgid()
        prctl(libc, PR_SET_DUMPABLE, 1)
        check(
            libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS),
            "unshare per-call namespaces",
        )
        write_id_maps(uid, gid)
        # The first process made now is PID 1 of the new namespace, the code's process is not: signals without a
        # handler (alarm(), kill(self)) act on it as anywhere else. PID 1 is the init program (an exec-only copy
        # of ``sleep``: a vfork and an exec, no copy of this big process; the code's process is then our second
        # child) or, without one, a fork of this process that stays the code's parent (run_init).
        init_pid = spawn_init(libc, cfg["init_program"], cfg["init_fd"]) if cfg.get("init_fd") is not None else None
        pid = os.fork()
        if pid:
            os.write(status_fd, f"P{pid}\n".encode() + (f"I{init_pid}\n".encode() if init_pid else b""))
            os._exit(0)
        if mount_call_fs(cfg, libc, scratch):
            os.write(status_fd, b"p\n")
        if init_pid is None:
            code_pid = os.fork()
            if code_pid:
                run_init(libc, code_pid, status_fd, drop=True)
    os.setsid()  # own session/group: kill(0, ...) from the code cannot reach the server
    os.chdir(scratch)
    prepare_child_io(fds[0], fds[1], fds[2], status_fd)
    report_fd[0] = 3
    code = read_code(4)
    drop_caps(libc)
    prctl(libc, PR_SET_DUMPABLE, 1)
    atexit._clear()
    reseed(cfg["rngs"])
    apply_limits(cfg)
    install_seccomp(libc, cfg["seccomp"])
    return code


def exec_only_copy(program: str) -> int:
    """A read-only descriptor of an in-memory copy of ``program`` whose mode is 0111: executable, readable by
    nobody. Exec of a file its caller cannot read leaves the new process non-dumpable (the kernel's
    ``would_dump``), so an init started from it cannot be opened through ``/proc/<pid>/mem``, nor traced, by the
    call's code, which runs as the same uid in the same user namespace but holds no capability there. (An exec of
    a readable file, ``/usr/bin/sleep`` itself, made the init dumpable again.) No writable descriptor stays open:
    exec refuses a file open for writing."""
    with open(program, "rb") as f:
        data = f.read()
    rw = os.memfd_create("sandbox-init", os.MFD_CLOEXEC)
    try:
        os.write(rw, data)
        ro = os.open(f"/proc/self/fd/{rw}", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.close(rw)
    os.fchmod(ro, 0o111)
    return ro


def spawn_init(libc: ctypes.CDLL, program: str, exec_fd: int) -> int:
    """Start ``program`` (``sleep``), from its exec-only copy ``exec_fd`` (:func:`exec_only_copy`), as the init of
    the PID namespace just made: it holds the namespace open and, as an init, ignores every signal from inside it.
    It gets no descriptor of ours (close-on-exec for all) and no capability (exec as a non-root user in the
    namespace clears them). It is spawned with no effective capability: with CAP_DAC_READ_SEARCH (ours in the
    new user namespace, which maps the copy's owner) the exec would find the copy readable and leave it dumpable."""
    for name in os.listdir("/proc/self/fd"):  # the server's /proc: we are still outside the new PID namespace
        if int(name) > 2:
            try:
                os.set_inheritable(int(name), False)
            except OSError:
                pass
    devnull = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
    actions = [(os.POSIX_SPAWN_DUP2, devnull, 0), (os.POSIX_SPAWN_DUP2, devnull, 1), (os.POSIX_SPAWN_DUP2, devnull, 2)]
    set_effective_caps(libc, False)
    try:
        return os.posix_spawn(f"/proc/self/fd/{exec_fd}", [program, "2147483647"], {}, file_actions=actions)
    finally:
        set_effective_caps(libc, True)  # for the code's process: its mounts, then it drops them all
        os.close(devnull)


def run_init(libc: ctypes.CDLL, code_pid: int, status_fd: int, drop: bool) -> None:
    """Parent of the code's process (the init of the call's PID namespace where it has one): reap whatever
    is re-parented here until the code's process ends, write its wait status (``X<status>``), exit. Never
    returns. The code cannot signal it (an init ignores signals it has no handler for) nor trace it."""
    import signal

    try:
        for sig in signal.valid_signals():  # Python's own SIGINT handler included
            try:
                if signal.getsignal(sig) not in (signal.SIG_DFL, signal.SIG_IGN, None):
                    signal.signal(sig, signal.SIG_DFL)
            except (OSError, ValueError, TypeError):
                pass
        close_fds_except({status_fd})
        if drop:
            drop_caps(libc)
        prctl(libc, PR_SET_DUMPABLE, 0)
        while True:
            pid, status = os.waitpid(-1, 0)
            if pid == code_pid:
                os.write(status_fd, f"X{status}\n".encode())
                break
    except BaseException:
        pass
    os._exit(0)


def find_rngs() -> list:
    """Every random-number generator the server's imports created (``random``'s, sympy's, numpy's
    legacy global state, ...): each call reseeds them, or every call would draw the same numbers."""
    import gc
    import random

    rngs = []
    for obj in gc.get_objects():
        try:
            if isinstance(obj, random.Random) and not isinstance(obj, random.SystemRandom):
                rngs.append(obj)
            elif type(obj).__name__ == "RandomState" and type(obj).__module__.startswith("numpy"):
                rngs.append(obj)
        except Exception:
            pass
    return rngs


def reseed(rngs: list) -> None:
    seeds = os.urandom(4 * len(rngs))
    for i, rng in enumerate(rngs):
        try:
            rng.seed(int.from_bytes(seeds[4 * i : 4 * i + 4], "little"))
        except Exception:
            pass
    np_random = sys.modules.get("numpy.random")  # its global RandomState is not tracked by gc
    if np_random is not None:
        np_random.seed()


def status_lines(data: bytes) -> list[str]:
    return data.decode(errors="replace").split("\n")[:-1]  # complete lines only


def read_status(fd: int, until, timeout_s: float) -> bytes:
    """What arrives on the status pipe ``fd`` until ``until(lines)`` holds, end of file, or ``timeout_s``."""
    import select
    import time

    data, deadline = b"", time.monotonic() + timeout_s
    while not until(status_lines(data)):
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(fd, 4096) if ready else b""
        if not chunk:
            break
        data += chunk
    return data


def exit_status(lines: list[str]) -> int | None:
    """The code's wait status from its parent's ``X<status>`` line, if it wrote one."""
    return next((int(x[1:]) for x in lines if x.startswith("X") and x[1:].lstrip("-").isdigit()), None)


def reap(statuses: dict[int, int], pids: list[int], deadline: float) -> bool:
    """Reap our children until every one of ``pids`` is reaped or ``deadline`` (``time.monotonic()``) passes; wait
    statuses land in ``statuses``. Returns whether every one was reaped.

    Any child is reaped, not only ``pids``: a process the code cloned with ``CLONE_PARENT`` is a child of the code's
    parent, this server, and the init of the call's PID namespace cannot finish exiting before every process of
    its namespace is reaped, so waiting for the init alone would wait for ever (it waited for us, we for it)."""
    import select
    import time

    poller, watched = select.poll(), {}
    for pid in pids:
        if pid not in statuses:
            try:
                watched[pid] = os.pidfd_open(pid)  # not reaped yet: the pid is still that child's
                poller.register(watched[pid], select.POLLIN)
            except OSError:
                pass
    try:
        while True:
            while True:
                try:
                    pid, st = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    return all(p in statuses for p in pids)
                if pid == 0:
                    break
                statuses[pid] = st
                if pid in watched:
                    fd = watched.pop(pid)
                    poller.unregister(fd)
                    os.close(fd)
            if all(p in statuses for p in pids):
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            # A watched exit wakes us at once; a leftover's (which the init's exit may wait for) within 10 ms.
            poller.poll(max(1, min(10, int(left * 1000) + 1)))
    finally:
        for fd in watched.values():
            os.close(fd)


def serve_one(req: dict, fds: list[int], cfg: dict, libc: ctypes.CDLL, started=None) -> dict:
    """Run one call in a forked child: the code comes from ``fds[0]``, stdout and stderr go to ``fds[1:]``, all
    three the host's, which this process never reads or writes. ``started()`` is called when the code starts.
    Returns the status message for the host: at most ``req["timeout_s"] + cfg["reap_grace_s"]`` after the code
    started, whatever its processes do (``"stuck": True`` when they were not all gone by then)."""
    import shutil
    import signal
    import tempfile
    import time

    r, w = os.pipe()
    scratch, private_dir = cfg["scratch"], None
    if not cfg["per_call_ns"]:
        private_dir = scratch = tempfile.mkdtemp(dir=cfg["scratch"])
    child = os.fork()
    if child == 0:
        try:
            os.close(r)
            call_child(cfg, libc, fds, w, scratch)
        finally:
            os._exit(125)
    os.close(w)
    grace = cfg["reap_grace_s"]
    done = lambda lines: "R" in lines or any(x.startswith("E") for x in lines)  # noqa: E731
    status = read_status(r, done, cfg["setup_grace_s"])
    lines = status_lines(status)
    if cfg["per_call_ns"] and "R" in lines and not any(x.startswith("P") for x in lines):
        # The intermediate writes P<pid> (and I<pid>) right before it exits, possibly after the code's process
        # wrote R (both race after the fork). Lines are written whole, and read whole.
        status += read_status(r, lambda lines: any(x.startswith("P") for x in lines), grace)
        lines = status_lines(status)
    # In bwrap/unshare modes the code's process and the namespace's init are the intermediate's children, ours (a
    # subreaper) once it exits; neither can be reaped by anyone else, so their pids stay theirs until we reap them.
    target = next((int(x[1:]) for x in lines if x.startswith("P")), child)
    init = next((int(x[1:]) for x in lines if x.startswith("I")), None)
    ours = list(dict.fromkeys(p for p in (child, target, init) if p is not None))
    statuses: dict[int, int] = {}
    result = {"fresh_proc": "p" in lines}
    if "R" not in lines:
        for pid in ours:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if not reap(statuses, ours, time.monotonic() + grace):
            result["stuck"] = True
        errors = [x[1:] for x in lines if x.startswith("E")]
        result["error"] = (
            errors[0]
            if errors
            else (f"sandbox set-up did not complete ({lines!r}, wait status {statuses.get(target)})")
        )
    else:
        import select

        pidfd = os.pidfd_open(target)
        if started is not None:
            started()
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        timed_out = not poller.poll(max(0, int(req["timeout_s"] * 1000)))
        if timed_out:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        os.close(pidfd)
        if not cfg["per_call_ns"]:
            try:
                os.killpg(target, signal.SIGKILL)  # leftovers of the code's session
            except (ProcessLookupError, PermissionError):
                pass
        if init is not None:  # its death takes whatever the code left in its namespace
            os.kill(init, signal.SIGKILL)
        if not reap(statuses, ours, time.monotonic() + grace):
            result["stuck"] = True
        # Every writer is gone now (the code closed its copy before it ran): the rest is here. Without an init
        # program the code's parent wrote its wait status (X); otherwise the code's process was ours to wait for.
        tail = read_status(r, lambda lines: False, 0.0 if result.get("stuck") else 2.0)
        code_status = exit_status(status_lines(status + tail))
        if code_status is None:
            code_status = statuses.get(target)
        if timed_out:
            exit_code = -signal.SIGKILL
        else:
            exit_code = None if code_status is None else os.waitstatus_to_exitcode(code_status)
        result.update(exit_code=exit_code, timed_out=timed_out)
    os.close(r)
    if private_dir is not None:
        shutil.rmtree(private_dir, ignore_errors=True)
    while True:  # orphans re-parented to us (we are a child subreaper)
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                break
        except ChildProcessError:
            break
    return result


def serve(cfg: dict, libc: ctypes.CDLL) -> None:
    """Server role (the zygote): import ``warm_imports``, report ready, then answer requests until the host
    closes the socket. A request is a small JSON message (the time limit) carrying three descriptors (code,
    stdout, stderr); the server forks the call with them and sends back only the exit status. Code and output
    never enter its memory, so no later call, forked from it, can find an earlier call's in its own."""
    import gc
    import socket

    sock = socket.socket(fileno=cfg["proto_fd"])

    def started() -> None:  # the host's clock for the limit starts here
        try:
            sock.send(b'{"started": true}')
        except OSError:
            pass  # the host is gone; the call still ends at its limit

    devnull = os.open("/dev/null", os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)  # stray prints of imported modules must not reach anything
    prctl(libc, PR_SET_CHILD_SUBREAPER, 1)  # the call's init (or the code's process) is re-parented to us
    failed = []
    for name in CHILD_MODULES:
        __import__(name)
    for name in cfg["warm_imports"]:
        try:
            __import__(name)
        except Exception as e:
            failed.append(f"{name}: {type(e).__name__}: {e}")
    gc.collect()
    cfg["rngs"] = find_rngs()
    # The server's filter is inherited by every forked call; each call adds one after it has made its namespaces
    # (new ones are banned from there on), with the fallback's memfd/shm denial, which the server must not have.
    install_seccomp(libc, seccomp_program(list(DENIED_ALWAYS), no_namespaces=False))
    per_call = [name for name in seccomp_deny(cfg) if name not in DENIED_ALWAYS]
    cfg["seccomp"] = seccomp_program(per_call, no_namespaces=True)
    cfg["init_fd"], init_note = None, "no init program"
    if cfg["init_program"]:
        try:
            cfg["init_fd"] = exec_only_copy(cfg["init_program"])
        except OSError as e:
            init_note = f"no exec-only copy of {cfg['init_program']} ({e})"
    gc.freeze()  # fewer copy-on-write page faults in the forked children
    why = probe_call(cfg, libc)
    if why is not None and cfg["init_fd"] is not None:  # e.g. vm.memfd_noexec forbids executing the copy
        os.close(cfg["init_fd"])
        cfg["init_fd"], init_note = None, f"the exec-only init failed: {why}"
        why = probe_call(cfg, libc)
    if why is not None:
        sock.send(json.dumps({"ready": False, "error": why}).encode())
        return
    sock.send(
        json.dumps(
            {
                "ready": True,
                "failed_imports": failed,
                "fresh_proc": cfg["fresh_proc"],
                "forked_init": None if cfg["init_fd"] is not None else init_note,
            }
        ).encode()
    )
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(sock, 4096, 3)
        except OSError:
            return
        if not data:  # the host closed its end
            return
        try:
            if len(fds) != 3:
                raise ValueError(f"a request carries 3 descriptors (code, stdout, stderr), got {len(fds)}")
            answer = serve_one(json.loads(data), fds, cfg, libc, started)
        except Exception as e:
            answer = {"error": f"{type(e).__name__}: {e}"}
        finally:
            for fd in fds:
                os.close(fd)
        sock.send(json.dumps(answer).encode())


def probe_call(cfg: dict, libc: ctypes.CDLL) -> str | None:
    """Run ``pass`` as a call; None if it worked (``cfg["fresh_proc"]`` then says whether it got a fresh /proc),
    else why not."""
    probe = [os.memfd_create("probe-code"), os.memfd_create("probe-stdout"), os.memfd_create("probe-stderr")]
    try:
        os.write(probe[0], b"pass")
        os.lseek(probe[0], 0, os.SEEK_SET)
        answer = serve_one({"timeout_s": 30.0}, probe, cfg, libc)
        if answer.get("error") or answer.get("exit_code") != 0:
            return (
                answer.get("error") or read_tail(probe[2], 2000, 1 << 20)[0] or f"exit status {answer.get('exit_code')}"
            )
        cfg["fresh_proc"] = answer["fresh_proc"]
        return None
    finally:
        for fd in probe:
            os.close(fd)


def run_cell(cfg: dict, libc: ctypes.CDLL) -> None:
    """Cell role (cold mode): read the code from its memfd, fork the process that applies the limits, says "R"
    and runs it, and report that process's wait status (``X<status>``). Never returns."""
    status_fd = cfg["status_fd"]
    code = read_code(cfg["code_fd"])
    program = seccomp_program(seccomp_deny(cfg), no_namespaces=True)
    pid = os.fork()
    if pid:
        run_init(libc, pid, status_fd, drop=False)
    try:
        for stream in (sys.stdout, sys.stderr):  # as a warm call's streams: unencodable text is escaped
            stream.reconfigure(errors="backslashreplace")
        apply_limits(cfg)
        install_seccomp(libc, program)
        os.write(status_fd, b"R\n")
        os.close(status_fd)
    except BaseException as e:
        report_error(status_fd, e)
        os._exit(125)
    exit_like_interpreter(exec_cell(code))


def main() -> None:
    # The configuration comes from a descriptor, not the command line: /proc/<pid>/cmdline is readable by the code.
    with os.fdopen(int(sys.argv[1]), "rb") as f:
        cfg = json.loads(f.read())
    close_fds_except(
        {cfg.get("code_fd", -1), cfg.get("status_fd", -1), cfg.get("proto_fd", -1), *cfg.get("cgroup_fds", ())}
    )
    libc = load_libc()
    setup_process(cfg, libc)
    if cfg["role"] == "server":
        serve(cfg, libc)
    else:
        run_cell(cfg, libc)


if __name__ == "__main__":
    main()
