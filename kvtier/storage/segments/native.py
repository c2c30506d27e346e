"""The segment store's batch loops in C (``native_io.c``), built on first use, and their callers.

A batch's runs cost ~2 us of Python each and a page ~1-2 us more (the iovecs, the checksums, the
bookkeeping of results), in the thread that also holds the GIL the other IO thread needs: at
64 KiB pages that was a third of a batch's time (``profiling/results/bench_storage.md``, run L).
Here one ``ctypes`` call moves and hashes a whole batch's runs, on the caller's thread and helper
threads of its own, without the GIL. Those helpers, and a put's write thread, are the library's
worker threads: started when first needed and kept for the process (starting and joining a
thread per call cost 15-35 us each way); a forked child starts its own.

**Built on first use.** ``native_io.c`` is compiled with the system C compiler (``$CC``, else
``cc``) into a cache directory, as Triton builds its launchers: ``$KVTIER_CACHE_DIR``, else
``$XDG_CACHE_HOME/kvtier``, else ``~/.cache/kvtier``. The store builds it when it opens, so no
batch waits for the compiler. The library's name is the hash of its source, flags and machine,
so an edited source builds anew; the compiler command is part of that hash. The directory (and
any parent it needs) is created ``0700`` whatever the umask; one that other users could write
into, owned by another user, or under a directory others could change (unless sticky, as
``/tmp``) is not used: a planted library would run as this process. The build goes to a
temporary name, synced, its SHA-256 written beside it, then renamed into place, under a lock
(``<library>.lock``) that processes starting together take in turn: one compiles, the others
wait for it (up to the build's time limit) and load what it built. A library whose bytes
differ from that digest (cut short: mapping it would kill the process with SIGBUS) is never
mapped but rebuilt, as is one that will not load or fails its self-test, once. Where no
compiler works, the rebuilt library still fails, ``$KVTIER_NATIVE`` is ``0`` / ``false`` /
``no`` / ``off``, or ``xxhash`` lacks a ``ctypes``-callable XXH3, the store runs the same loops
in Python (``available()`` is False); results are identical.

The checksum is the ``xxhash`` binding's own XXH3-64, called by address from C, so a record
written by either path verifies on the other. A record of several parts (``Parts``: a page_first
KV page's K and V ranges) is hashed through the binding's streaming calls as one stream; where
the binding does not export them, such pages run in the Python loops (``takes``).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import shlex
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple, Union

import numpy as np

from kvtier.storage.segments.format import ENTRY_SIZE

__all__ = [
    "ENV_DISABLE",
    "RUN",
    "Parts",
    "available",
    "buffers",
    "encode_entries",
    "library",
    "make_runs",
    "read",
    "takes",
    "write",
]

log = logging.getLogger(__name__)

ENV_DISABLE = "KVTIER_NATIVE"
"""Set to ``0`` (or ``false``, ``no``, ``off``) to run the segment store's loops in Python."""
_SOURCE = Path(__file__).with_name("native_io.c")
_FLAGS = ("-O2", "-shared", "-fPIC", "-pthread", "-std=c11", "-Wall")
_ABI = 5
_BUILD_TIMEOUT_S = 120.0
_IOV_MAX = 1024  # native_io.c's KVT_IOV: iovecs a syscall takes

RUN = np.dtype(
    [("offset", "<i8"), ("fd", "<i4"), ("first", "<i4"), ("count", "<i4"), ("err", "<i4")]
)
"""One run (``kvt_run``): ``count`` records back to back in file ``fd`` from ``offset``; ``err``
comes back 0 or the errno of the run's failed syscall."""

_lock = threading.Lock()
_loaded: list[object] = []  # [library or None] once tried


def _cache_dir() -> Path:
    env = os.environ.get("KVTIER_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvtier"


def _private_dir(path: Path) -> Path | None:
    """Create ``path`` if missing (it and any missing parent ``0700``, whatever the umask); its
    resolved form if it is a directory of this user's that nobody else can write into and whose
    every ancestor only its owner (this user or root) can change, or is sticky (``/tmp``); else
    None, with the reason logged. A library placed there would run in this process."""
    try:
        missing = []
        at = path.absolute()
        while not os.path.lexists(at):
            missing.append(at)
            at = at.parent
        for d in reversed(missing):
            os.mkdir(d, 0o700)
            os.chmod(d, 0o700)  # mkdir's mode is cut by the umask; never widened by it
        real = Path(os.path.realpath(path))
        st = os.stat(real)
    except OSError as e:
        log.warning("segment store: cache %s unusable (%s): the Python loops run", path, e)
        return None
    me = os.geteuid()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != me or st.st_mode & 0o022:
        log.warning(
            "segment store: cache %s is not a directory only this user can write (mode %o, "
            "owner %d): the Python loops run",
            real,
            stat.S_IMODE(st.st_mode),
            st.st_uid,
        )
        return None
    for up in real.parents:
        try:
            st = os.stat(up)
        except OSError:
            return None
        if st.st_uid not in (0, me) or (st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX):
            log.warning(
                "segment store: cache %s lies under %s, which others can change: the Python "
                "loops run",
                real,
                up,
            )
            return None
    return real


def _xxh3_address() -> int | None:
    """The address of the ``xxhash`` binding's one-shot XXH3-64 (the dispatching one where it
    is exported), checked against the binding's own digest; None where missing or different."""
    try:
        import xxhash

        lib = ctypes.CDLL(xxhash._xxhash.__file__)
    except (ImportError, OSError, AttributeError):
        return None
    for name in ("XXH3_64bits_dispatch", "XXH3_64bits"):
        fn = getattr(lib, name, None)
        if fn is None:
            continue
        fn.restype, fn.argtypes = ctypes.c_uint64, (ctypes.c_void_p, ctypes.c_size_t)
        ok = True
        for n in (1, 17, 129, 241, 4096, 65536 + 3):
            probe = (ctypes.c_ubyte * n).from_buffer_copy(bytes(i * 11 % 251 for i in range(n)))
            if fn(ctypes.addressof(probe), n) != xxhash.xxh3_64_intdigest(probe):
                ok = False
                break
        if ok:
            return ctypes.cast(fn, ctypes.c_void_p).value
    return None


def _xxh3_stream_table() -> ctypes.Array | None:
    """The binding's streaming XXH3-64 calls as ``kvt_stream`` (create, free, reset, update,
    digest; the dispatching update where exported), checked on uneven pieces against the
    binding's own digest; None where any is missing or differs (large records are then hashed
    whole after they land)."""
    try:
        import xxhash

        lib = ctypes.CDLL(xxhash._xxhash.__file__)
        create, free = lib.XXH3_createState, lib.XXH3_freeState
        reset, digest = lib.XXH3_64bits_reset, lib.XXH3_64bits_digest
        update = getattr(lib, "XXH3_64bits_update_dispatch", None) or lib.XXH3_64bits_update
    except (ImportError, OSError, AttributeError):
        return None
    vp = ctypes.c_void_p
    create.restype, create.argtypes = vp, ()
    free.restype, free.argtypes = ctypes.c_int, (vp,)
    reset.restype, reset.argtypes = ctypes.c_int, (vp,)
    update.restype, update.argtypes = ctypes.c_int, (vp, vp, ctypes.c_size_t)
    digest.restype, digest.argtypes = ctypes.c_uint64, (vp,)
    n = 300_001
    data = (ctypes.c_ubyte * n).from_buffer_copy(bytes(i * 29 % 251 for i in range(n)))
    state = create()
    if not state:
        return None
    try:
        if reset(state) != 0:
            return None
        at = 0
        for step in (1, 100, 65_536, 131_072, n):
            step = min(step, n - at)
            if update(state, ctypes.addressof(data) + at, step) != 0:
                return None
            at += step
        if digest(state) != xxhash.xxh3_64_intdigest(bytes(data)):
            return None
    finally:
        free(state)
    table = (ctypes.c_void_p * 5)(
        *(ctypes.cast(f, ctypes.c_void_p).value for f in (create, free, reset, update, digest))
    )
    return table


def _build(target: Path, cc: list[str]) -> bool:
    """Compile ``native_io.c`` to ``target`` with ``cc`` (through a temporary name, synced,
    its digest written first, then renamed: a crash never leaves a partial library under the
    final name); whether it worked (a failure logged with the compiler's words)."""
    _sweep(target.parent, keep=target)
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        # Its own session: a timeout kills the driver and what it started (cc1, as, ld).
        proc = subprocess.Popen(
            [*cc, *_FLAGS, "-o", tmp, str(_SOURCE)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            _, err = proc.communicate(timeout=_BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            log.warning(
                "segment store: the C loops' build (%s) took over %gs: the Python loops run",
                shlex.join(cc),
                _BUILD_TIMEOUT_S,
            )
            return False
        if proc.returncode != 0:
            log.warning(
                "segment store: the C loops did not build (%s): %s: the Python loops run",
                shlex.join(cc),
                err.strip()[-2000:],
            )
            return False
        os.chmod(tmp, 0o700)
        with open(tmp, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
            os.fsync(f.fileno())
        side = tempfile.NamedTemporaryFile(
            "w", dir=target.parent, prefix=target.name + ".", suffix=".tmp", delete=False
        )
        with side:
            side.write(digest + "\n")
            side.flush()
            os.fsync(side.fileno())
        os.replace(side.name, _digest_path(target))
        os.replace(tmp, target)
        return True
    except (OSError, subprocess.SubprocessError) as e:
        log.warning(
            "segment store: the C loops did not build (%s): %s: the Python loops run",
            shlex.join(cc),
            e,
        )
        return False
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


_STALE_S = 30 * 86400.0
"""A library (of another source, compiler or kvtier version) no process has loaded for this long
is deleted at the next build: each load stamps its library's mtime, so versions in use side by
side keep theirs, and upgrades do not pile libraries up in the cache."""


def _sweep(where: Path, keep: Path | None = None) -> None:
    """Delete temporary files of builds that died (killed mid-build: their process never
    removed them) once they are older than any build could be, and libraries (with their
    digests) no process has loaded for ``_STALE_S``, except ``keep``."""
    now = time.time()
    for tmp in where.glob("native_io-*.so.*.tmp"):
        with contextlib.suppress(OSError):
            if now - tmp.lstat().st_mtime > 2 * _BUILD_TIMEOUT_S:
                tmp.unlink()
    for mark in where.glob("native_io-*.so.failed"):
        with contextlib.suppress(OSError):
            if abs(now - mark.lstat().st_mtime) > _RETRY_S:
                mark.unlink()
    for old in where.glob("native_io-*.so"):
        if old == keep:
            continue
        with contextlib.suppress(OSError):
            if now - old.lstat().st_mtime > _STALE_S:
                old.unlink()
                _digest_path(old).unlink(missing_ok=True)
    # A build's lock goes with the build; one whose holder was killed stays until a build of
    # its library takes it, or, where none follows (its library gone), an hour after.
    for lock in where.glob("native_io-*.so.lock"):
        library = lock.with_name(lock.name[: -len(".lock")])
        with contextlib.suppress(OSError):
            if not os.path.lexists(library) and now - lock.lstat().st_mtime > _RETRY_S:
                lock.unlink()


_LOCK_WAIT_S = _BUILD_TIMEOUT_S + 30.0
"""How long a process waits for another's build of the same library (its lock) before it runs
the Python loops: a build is cut off after ``_BUILD_TIMEOUT_S``."""


@contextlib.contextmanager
def _build_lock(target: Path) -> Iterator[bool]:
    """Hold ``<library>.lock`` (an exclusive ``flock``) around a build, so processes started
    together (the ranks of a TP engine on one host) compile once, not once each, on a busy host
    where each compile then took longer: True once held, False after ``_LOCK_WAIT_S`` waiting
    (or if the lock file cannot be opened: the build goes ahead unlocked, as before)."""
    try:
        fd = os.open(
            _lock_path(target), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
    except OSError as e:
        log.info("segment store: no build lock (%s): building unlocked", e)
        yield True
        return
    try:
        deadline = time.monotonic() + _LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    yield False
                    return
                time.sleep(0.05)  # another process compiles: seconds
        try:
            yield True
        finally:
            # Unlinked while still held: a process waiting on this file then finds the library
            # built (or its failure marked) when it gets the lock, and one arriving later finds
            # the library, or makes a new lock file; the cache keeps no lock files.
            with contextlib.suppress(OSError):
                os.unlink(_lock_path(target))
    finally:
        os.close(fd)  # the lock goes with it


def _lock_path(target: Path) -> Path:
    return target.with_name(target.name + ".lock")


def _compiler() -> list[str]:
    """The compiler command: ``$CC`` (which may carry arguments), else ``cc`` or ``gcc``."""
    return shlex.split(os.environ.get("CC", "")) or [
        shutil.which("cc") or shutil.which("gcc") or ""
    ]


def _load() -> object | None:
    switch = os.environ.get(ENV_DISABLE, "1").strip().lower()
    if switch in ("0", "false", "no", "off"):
        return None
    if switch not in ("", "1", "true", "yes", "on"):
        log.warning("segment store: %s=%r is not 0/1: the C loops stay on", ENV_DISABLE, switch)
    hash_at = _xxh3_address()
    if hash_at is None:
        log.info("segment store: xxhash exports no XXH3 to call from C: the Python loops run")
        return None
    try:
        source = _SOURCE.read_bytes()
    except OSError as e:  # an install without the package's C file
        log.info("segment store: no %s (%s): the Python loops run", _SOURCE.name, e)
        return None
    cc = _compiler()
    # The compiler is part of the name: a library one compiler made is not another's to load.
    tag = hashlib.sha256(
        source + repr((_FLAGS, cc, platform.machine(), platform.libc_ver())).encode()
    ).hexdigest()[:16]
    where = _private_dir(_cache_dir())
    if where is None:
        return None
    target = where / f"native_io-{tag}.so"
    for attempt in range(2):  # a library that will not load or test right is rebuilt once
        if not os.path.lexists(target):
            if not cc[0]:
                log.warning("segment store: no C compiler ($CC, cc, gcc): the Python loops run")
                return None
            if _failed_lately(target):
                log.info(
                    "segment store: the C loops' build failed within %gs (%s): the Python loops"
                    " run",
                    _RETRY_S,
                    _failed_path(target),
                )
                return None
            with _build_lock(target) as held:
                if not held:
                    log.warning(
                        "segment store: another process's build of %s took over %gs: the Python"
                        " loops run",
                        target,
                        _LOCK_WAIT_S,
                    )
                    return None
                # Built, or failed, by the process that held the lock while this one waited.
                if not os.path.lexists(target):
                    if _failed_lately(target):
                        return None
                    if not _build(target, cc):
                        _mark_failed(target)
                        return None  # logged; building again would fail alike
        lib = _open(target, hash_at)
        if lib is not None and _self_test(lib):
            with contextlib.suppress(OSError):
                os.utime(target)  # in use: not stale (_STALE_S)
            return lib
        log.warning(
            "segment store: the C loops at %s %s",
            target,
            "failed to load or test: rebuilt"
            if attempt == 0
            else "failed again: the Python loops run",
        )
        for stale in (target, _digest_path(target)):
            with contextlib.suppress(OSError):
                stale.unlink()
    _mark_failed(target)  # built twice and never loaded or tested right: not again for a while
    return None


_RETRY_S = 3600.0
"""A build that failed is not tried again by any process for this long (a marker beside the
library, ``<library>.failed``): each process start would otherwise pay a compile and log its
failure again. Delete the marker to try at once (after installing a compiler, say)."""


def _failed_path(target: Path) -> Path:
    return target.with_name(target.name + ".failed")


def _failed_lately(target: Path) -> bool:
    """Whether a build of ``target`` failed less than ``_RETRY_S`` ago (a marker dated in the
    future, the clock stepped back since, does not count)."""
    try:
        return 0 <= time.time() - _failed_path(target).lstat().st_mtime < _RETRY_S
    except OSError:
        return False


def _mark_failed(target: Path) -> None:
    """Leave the failure marker (an empty file, this user's alone)."""
    with contextlib.suppress(OSError):
        flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
        fd = os.open(_failed_path(target), flags, 0o600)
        try:
            os.utime(fd)
        finally:
            os.close(fd)


def _digest_path(target: Path) -> Path:
    """Where the SHA-256 of ``target``'s bytes is kept, written at its build: a library whose
    bytes differ (cut short, copied in part) is never mapped, since mapping a file cut short
    kills the process with SIGBUS."""
    return target.with_name(target.name + ".sha256")


def _open(target: Path, hash_at: int) -> object | None:
    """The library at ``target``, its calls declared; None if it is not this user's regular
    file or its bytes differ from its build's digest."""
    try:
        fd = os.open(target, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        log.info("segment store: C loops not opened: %s", e)
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return None
        with open(fd, "rb", closefd=False) as f:
            data = f.read()
        try:
            want = _digest_path(target).read_text().strip()
        except OSError:
            return None
        if hashlib.sha256(data).hexdigest() != want:
            return None
        # By name: only this user can change the private directory it lies in (_private_dir).
        lib = ctypes.CDLL(str(target))
        if lib.kvt_abi() != _ABI:
            return None
    except (OSError, AttributeError) as e:
        log.info("segment store: C loops not loaded: %s", e)
        return None
    finally:
        os.close(fd)
    vp, i32, i64, u64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_uint64
    lib.kvt_read_records.restype = i32
    lib.kvt_read_records.argtypes = (
        vp,
        vp,
        vp,
        vp,
        vp,
        vp,
        vp,
        vp,
        i32,
        ctypes.c_int64,
        i32,
        vp,
        vp,
        vp,
        vp,
    )
    lib.kvt_write.restype = i32
    lib.kvt_write.argtypes = (vp, i32, vp, vp, vp, vp, vp, i32, i64, i32, vp, vp)
    lib.kvt_write_start.restype = vp
    lib.kvt_write_start.argtypes = (vp, i32, vp, vp, vp, vp)
    lib.kvt_write_prepare.restype = vp
    lib.kvt_write_prepare.argtypes = (vp, i32, vp, vp, vp, vp)
    lib.kvt_write_submit.restype = i32
    lib.kvt_write_submit.argtypes = (vp,)
    lib.kvt_workers.restype = i32
    lib.kvt_workers.argtypes = ()
    lib.kvt_write_journal.restype = i32
    lib.kvt_write_journal.argtypes = (
        vp,
        i32,
        ctypes.c_int64,
        vp,
        ctypes.c_int64,
        i32,
        i32,
        ctypes.c_int64,
    )
    lib.kvt_write_ended.restype = i32
    lib.kvt_write_ended.argtypes = (vp,)
    lib.kvt_write_wait.restype = None
    lib.kvt_write_wait.argtypes = (vp, vp)
    lib.kvt_hash_records.restype = i32
    lib.kvt_hash_records.argtypes = (vp, vp, vp, vp, i32, vp, vp, vp)
    lib.kvt_encode_entries.restype = ctypes.c_int64
    lib.kvt_encode_entries.argtypes = (vp, vp, i32, vp, vp, u64, vp, vp, vp)
    lib.hash_at = hash_at
    lib.stream_table = _xxh3_stream_table()  # kept alive with the library
    lib.stream_at = None if lib.stream_table is None else ctypes.addressof(lib.stream_table)
    return lib


def _self_test(lib) -> bool:
    """A write and a read back through a temporary file, and journal entries, against the
    Python loops' results."""
    import xxhash

    from kvtier.storage.segments import format as fmt

    sizes = [5000, 4999, 5001, 0, 70_000]
    total = sum(sizes)
    data = np.frombuffer(bytes(i * 13 % 251 for i in range(total)), dtype=np.uint8).copy()
    back = np.zeros_like(data)
    at = np.cumsum([0, *sizes[:-1]]).astype(np.uint64)
    n = np.asarray(sizes, dtype=np.uint64)
    try:
        with tempfile.TemporaryFile() as f:
            runs = make_runs([f.fileno()] * 2, [0, sum(sizes[:3])], [0, 3], [3, 2])
            sums = write(lib, runs, data.ctypes.data + at, n, 2)
            want = [xxhash.xxh3_64_intdigest(data[a : a + s].tobytes()) for a, s in zip(at, sizes)]
            if runs["err"].any() or sums.tolist() != want:
                return False
            again = make_runs([f.fileno()], [total], [0], [len(sizes)])  # the same, after it
            pending = write_start(lib, again, data.ctypes.data + at, n)
            if pending is not None:  # else no thread now: the writer falls back to kvt_write
                try:
                    if hash_records(lib, data.ctypes.data + at, n).tolist() != want:
                        return False
                finally:
                    pending.wait()
                if again["err"].any() or os.pread(f.fileno(), total, total) != data.tobytes():
                    return False
            fds = np.full(len(sizes), f.fileno(), dtype=np.int32)
            status, err = read(
                lib, fds, at.astype(np.int64), back.ctypes.data + at, n, sums, 4096, 2
            )
            if lib.stream_at is not None and not _parts_test(
                lib, f.fileno(), data, sizes, want, total
            ):
                return False
    except OSError:
        return False
    keys = ["a" * 64, "b" * 70]
    entries = encode_entries(lib, keys, [4096, 0], [65536, 7], 123, [1, 2], [2**64 - 1, 5])
    return (
        status.tolist() == [1] * len(sizes)
        and err == 0
        and bytes(back) == bytes(data)
        and entries == fmt.encode_entries(keys, [4096, 0], [65536, 7], 123, [1, 2], [2**64 - 1, 5])
    )


def _parts_test(lib, fd: int, data: np.ndarray, sizes: list[int], want: list[int], at: int) -> bool:
    """Records of two parts each, their halves swapped in memory, written at file offset ``at``
    (both write calls), hashed and read back into parts (the large one in pieces)."""
    mixed = np.empty_like(data)
    start, paddr, psize = [0], [], []
    pos = 0
    for s in sizes:  # record bytes data[pos:pos+s] = its first half, then its second
        h = s // 2
        mixed[pos : pos + s - h] = data[pos + h : pos + s]  # second half first in memory
        mixed[pos + s - h : pos + s] = data[pos : pos + h]
        paddr += [mixed.ctypes.data + pos + s - h, mixed.ctypes.data + pos]
        psize += [h, s - h]
        start.append(start[-1] + 2)
        pos += s
    parts = Parts(
        np.asarray(start, dtype=np.int64),
        np.asarray(paddr, dtype=np.uint64),
        np.asarray(psize, dtype=np.uint64),
    )
    n = np.asarray(sizes, dtype=np.uint64)
    offsets = at + np.cumsum([0, *sizes[:-1]]).astype(np.int64)
    runs = make_runs([fd], [at], [0], [len(sizes)])
    if write(lib, runs, parts, n, 2).tolist() != want or runs["err"].any():
        return False
    runs = make_runs([fd], [at], [0], [len(sizes)])
    pending = write_start(lib, runs, parts, n)
    if pending is not None:
        try:
            if hash_records(lib, parts, n).tolist() != want:
                return False
        finally:
            pending.wait()
    if runs["err"].any() or os.pread(fd, int(n.sum()), at) != data.tobytes():
        return False
    back = np.zeros_like(mixed)
    into = Parts(parts.start, parts.addr - mixed.ctypes.data + back.ctypes.data, parts.size)
    fds = np.full(len(sizes), fd, dtype=np.int32)
    sums = np.asarray(want, dtype=np.uint64)
    status, err = read(lib, fds, offsets, into, n, sums, 4096, 2)
    return status.tolist() == [1] * len(sizes) and err == 0 and bytes(back) == bytes(mixed)


def _after_fork_in_child() -> None:
    """A child forked while another thread built or loaded the library would inherit ``_lock``
    held, and wait on it forever: it starts with a free lock (and loads for itself if need be)."""
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def library() -> object | None:
    """The loaded library (built first if needed), or None where the loops run in Python."""
    if not _loaded:
        with _lock:
            if not _loaded:
                try:
                    lib = _load()
                except Exception:  # never fatal: the Python loops do the same work
                    log.exception("segment store: native loops off")
                    lib = None
                _loaded.append(lib)
    return _loaded[0]  # type: ignore[return-value]


def available() -> bool:
    """Whether the native loops are in use."""
    return library() is not None


def make_runs(fds, offsets, first, count) -> np.ndarray:
    """``RUN`` records: run ``r`` is ``count[r]`` records from record ``first[r]``, back to back
    in file ``fds[r]`` from ``offsets[r]``."""
    out = np.zeros(len(fds), dtype=RUN)
    out["fd"], out["offset"], out["first"], out["count"] = fds, offsets, first, count
    return out


class Parts(NamedTuple):
    """A batch's records as parts (a page_first KV page: its K range and its V range): record k
    is parts ``start[k]`` .. ``start[k + 1] - 1`` (int64, one more than the records), part p
    ``size[p]`` bytes at ``addr[p]`` (uint64 each). Where every record is one part, the calls
    below take the records' addresses as a plain uint64 array instead."""

    start: np.ndarray
    addr: np.ndarray
    size: np.ndarray


Buffers = Union[np.ndarray, Parts]


def takes(lib, views) -> bool:
    """Whether ``lib`` moves the pages of ``views`` (a ``PageViews``): pages of one part each,
    or, where it has the binding's streaming XXH3 calls to hash them, pages of several parts
    (a page_first KV page's K and V ranges), at most ``IOV_MAX`` parts a page (a syscall's)."""
    return views.single() or (lib.stream_at is not None and max(views.counts()) <= _IOV_MAX)


def buffers(views, pages: Sequence[int]) -> Buffers:
    """The buffers of ``views``' (a ``PageViews``) ``pages``, in that order: their addresses
    where every page is one part, else their ``Parts``."""
    if views.single():
        ptrs = views.address_arrays()[0]
        if isinstance(pages, range) and pages.step == 1:
            return ptrs[pages.start : pages.stop]
        return ptrs[np.asarray(pages, dtype=np.intp)]
    return Parts(*views.part_arrays(pages))


def _records(buffers: Buffers, lengths: np.ndarray) -> tuple[int | None, int, int]:
    """The C calls' (pstart, paddr, plen) pointers for ``buffers`` of records of ``lengths``."""
    if isinstance(buffers, Parts):
        start, addr, size = buffers
        if not (
            start.dtype == np.int64
            and addr.dtype == size.dtype == lengths.dtype == np.uint64
            and len(start) == len(lengths) + 1
            and len(addr) == len(size) == (int(start[-1]) if len(start) else -1)
            and all(a.flags.c_contiguous for a in (start, addr, size))
        ):
            raise ValueError("segment store: parts that do not describe the records")
        return start.ctypes.data, addr.ctypes.data, size.ctypes.data
    if not (buffers.dtype == lengths.dtype == np.uint64 and len(buffers) == len(lengths)):
        raise ValueError("segment store: buffers that do not match the records")
    return None, buffers.ctypes.data, lengths.ctypes.data


def _checked(got: int, what: str) -> None:
    if got == -2:
        raise MemoryError(f"segment store: no memory for a batch's {what}")
    if got == -3:
        raise ValueError(
            f"segment store: records of several parts need the binding's streaming XXH3 ({what})"
        )


def read(
    lib,
    fds: np.ndarray,
    offsets: np.ndarray,
    buffers: Buffers,
    lengths: np.ndarray,
    sums: np.ndarray,
    run_bytes: int,
    threads: int,
    trusted: np.ndarray | None = None,
) -> tuple[np.ndarray, int]:
    """Read records sorted by file and offset (``fds`` int32, ``offsets`` int64; ``lengths``
    bytes each, uint64) into ``buffers`` (their addresses, uint64, or their ``Parts``) and check
    each against ``sums`` (XXH3-64, uint64), on up to ``threads`` threads, in runs of
    back-to-back records cut at about ``run_bytes``: per record 1 (served), 2 (failed
    verification, or cut short by the file's end), 3 (its read failed) or 0 (not read: a
    negative descriptor); and the errno of the first failed read (0 if none). ``trusted``
    (uint8, or None): records served, once read in full, without a check (``verify="once"``)."""
    status = np.zeros(len(lengths), dtype=np.uint8)
    err = ctypes.c_int32(0)
    pstart, paddr, plen = _records(buffers, lengths)
    got = lib.kvt_read_records(
        fds.ctypes.data,
        offsets.ctypes.data,
        lengths.ctypes.data,
        pstart,
        paddr,
        plen,
        sums.ctypes.data,
        status.ctypes.data,
        len(lengths),
        run_bytes,
        threads,
        None if trusted is None else trusted.ctypes.data,
        lib.hash_at,
        lib.stream_at,
        ctypes.byref(err),
    )
    _checked(got, "runs")
    return status, err.value


def write(
    lib,
    runs: np.ndarray,
    buffers: Buffers,
    lengths: np.ndarray,
    threads: int,
    piece: int = 0,
    after: bool = False,
) -> np.ndarray:
    """Hash each record (``lengths`` bytes, uint64, at ``buffers``: their addresses, uint64, or
    their ``Parts``) and write ``runs``, on up to ``threads`` threads; each record's XXH3-64 (a
    run whose write failed has its errno in ``err``). On one thread, a record larger than
    ``piece`` (> 0) that is a run of its own is hashed and written in pieces of that size,
    where the binding has the streaming calls, and with ``after`` each run (piece) is hashed
    right after its write instead of just before it."""
    sums = np.zeros(len(lengths), dtype=np.uint64)
    pstart, paddr, plen = _records(buffers, lengths)
    got = lib.kvt_write(
        runs.ctypes.data,
        len(runs),
        lengths.ctypes.data,
        pstart,
        paddr,
        plen,
        sums.ctypes.data,
        threads,
        piece,
        int(after),
        lib.hash_at,
        lib.stream_at,
    )
    _checked(got, "checksums")
    return sums


class Pending:
    """A write in flight on one of the library's workers (``kvt_write_start``), of ``runs`` from
    records at ``buffers`` (``lengths`` bytes each); ``wait`` ends it (each run's errno, or 0, in
    ``runs["err"]``). The arrays stay referenced here until then; the caller keeps the records'
    buffers alive and calls ``wait`` (in a ``finally``) before they may go. Any number of
    threads may wait: each returns only once the write has ended. One never waited for (an
    interrupt after it is made and before the caller's ``try``) is ended when it is collected,
    which the interrupted frame's unwinding does before it releases the caller's buffers.

    ``journal`` hands the worker the records' journal entries, to write after the runs if every
    run succeeded and they came before the runs ended; ``wait`` then says whether it did."""

    __slots__ = ("__weakref__", "_done", "_ended", "_keep", "_handle", "_lib", "_out")

    def __init__(self, lib, handle: int, keep: tuple) -> None:
        self._keep = keep
        self._lib, self._handle = lib, handle
        self._done = threading.Lock()
        self._out = (ctypes.c_int32 * 2)()  # written by the wait: journal written, its errno
        # The wait, once: by ``wait``, or at collection.
        self._ended = weakref.finalize(self, lib.kvt_write_wait, handle, self._out)

    def journal(
        self, jfd: int, offset: int, entries: bytes, sync: bool, fd: int, time_ns: int
    ) -> bool:
        """Hand the worker ``entries`` to write at ``offset`` of ``jfd`` once every run is
        written (then, with ``sync``, ``fdatasync`` ``fd`` and ``jfd``; then set ``fd``'s times
        to ``time_ns``); whether it took them. It does not once its runs have ended (it never
        waits for them), nor without memory for their copy, nor after ``wait``: the caller
        writes them then. At most once; ``wait`` says whether the worker wrote them."""
        with self._done:
            if not self._ended.alive:
                return False
            got = _hand_over(self._lib, self._handle, (jfd, offset, entries, sync, fd, time_ns))
        return got == 0

    def ended(self) -> bool:
        """Whether the worker has ended (without waiting for it)."""
        with self._done:
            return not self._ended.alive or bool(self._lib.kvt_write_ended(self._handle))

    def wait(self) -> tuple[bool, int]:
        """End the write: (whether the worker wrote the journal, stamped and synced as asked;
        the errno of its journal step that failed, or 0)."""
        with self._done:
            self._ended()  # a no-op after the first call
            self._keep = ()
        return bool(self._out[0]), int(self._out[1])


def _hand_over(lib, handle: int, journal: tuple) -> int:
    """``kvt_write_journal`` with ``Pending.journal``'s arguments: 0 taken, 1 too late, -1 no
    memory for the copy."""
    jfd, offset, entries, sync, fd, time_ns = journal
    return lib.kvt_write_journal(handle, jfd, offset, entries, len(entries), int(sync), fd, time_ns)


def write_start(
    lib,
    runs: np.ndarray,
    buffers: Buffers,
    lengths: np.ndarray,
    journal: tuple | None = None,
) -> Pending | None:
    """Start writing ``runs`` (records of ``lengths`` bytes, uint64, at ``buffers``: their
    addresses, uint64, or their ``Parts``) on one of the library's worker threads, unhashed;
    None if no worker could take it (nothing written). ``journal``: ``Pending.journal``'s
    arguments, handed over before the worker starts (so it takes them whenever its runs
    succeed; the store hands them over later, when they are made)."""
    pstart, paddr, plen = _records(buffers, lengths)
    args = (runs.ctypes.data, len(runs), lengths.ctypes.data, pstart, paddr, plen)
    if journal is None:
        handle = lib.kvt_write_start(*args)
        return None if handle is None else Pending(lib, handle, (runs, buffers, lengths))
    handle = lib.kvt_write_prepare(*args)
    if handle is None:
        return None
    _hand_over(lib, handle, journal)  # refused only without memory: then none is written
    if lib.kvt_write_submit(handle) != 0:
        return None  # the handle is freed
    return Pending(lib, handle, (runs, buffers, lengths))


def hash_records(lib, buffers: Buffers, lengths: np.ndarray) -> np.ndarray:
    """Each record's XXH3-64 (records of ``lengths`` bytes, uint64, at ``buffers``: their
    addresses, uint64, or their ``Parts``), on the calling thread without the GIL."""
    sums = np.zeros(len(lengths), dtype=np.uint64)
    pstart, paddr, plen = _records(buffers, lengths)
    got = lib.kvt_hash_records(
        lengths.ctypes.data,
        pstart,
        paddr,
        plen,
        len(lengths),
        sums.ctypes.data,
        lib.hash_at,
        lib.stream_at,
    )
    _checked(got, "checksums")
    return sums


def encode_entries(lib, keys, offsets, lengths, time_ns: int, algorithms, checksums) -> bytes:
    """``format.encode_entries``, in one C call: the same bytes."""
    n = len(keys)
    if not n:
        return b""
    raw = "".join(keys).encode("ascii")
    starts = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, keys), dtype=np.int64, count=n), out=starts[1:])
    out = bytearray(len(raw) + n * ENTRY_SIZE)
    off = np.asarray(offsets, dtype=np.uint64)
    size = np.asarray(lengths, dtype=np.uint64)
    alg = np.asarray(algorithms, dtype=np.uint8)
    sums = np.asarray(checksums, dtype=np.uint64)
    buf = (ctypes.c_char * len(out)).from_buffer(out)
    got = lib.kvt_encode_entries(
        raw,
        starts.ctypes.data,
        n,
        off.ctypes.data,
        size.ctypes.data,
        time_ns,
        alg.ctypes.data,
        sums.ctypes.data,
        ctypes.addressof(buf),
    )
    del buf
    assert got == len(out)
    return bytes(out)
