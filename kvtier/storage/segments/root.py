"""A file store's root directory: creating or checking it, and opening only its own files.

Shared by both file stores (the segment store and the per-page one). The root's permissions are
the security boundary: checksums detect corruption, not forgery, so a root that other users can
write into is refused unless the caller accepts the risk.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import time
from pathlib import Path

__all__ = ["RootLock", "create_file", "open_regular", "open_root"]

log = logging.getLogger(__name__)

# Never follow a symlink, never block opening a FIFO or a device.
_SAFE = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _chmod_dir(path: Path, mode: int) -> None:
    """``chmod`` the directory ``path`` names, never a symlink's target (Linux: an ``O_PATH``
    descriptor, changed through ``/proc/self/fd``; elsewhere, by path)."""
    o_path = getattr(os, "O_PATH", 0)
    if not o_path or not os.path.isdir("/proc/self/fd"):
        os.chmod(path, mode)
        return
    fd = os.open(path, o_path | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.chmod(f"/proc/self/fd/{fd}", mode)
    finally:
        os.close(fd)


def open_root(root: Path, dir_mode: int, allow_unsafe_root: bool) -> int:
    """Create ``root`` (mode ``dir_mode`` exactly) or check the existing one; its descriptor.

    An existing root that other users could write into (write bits beyond ``dir_mode``, or
    another owner) raises ``ValueError``, or only logs a warning with ``allow_unsafe_root``; so
    does a root that cannot be made or opened as a directory (a file, a path under a file, no
    permission), naming it and why.
    """
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(root, 0o700)  # the umask may narrow it (even to nothing) until the chmod
            created = True
        except FileExistsError:
            created = False
        return _open_root(root, dir_mode, allow_unsafe_root, created)
    except OSError as e:
        if e.errno not in _NOT_A_ROOT:  # out of descriptors, disk full, IO error: not the input
            raise
        raise ValueError(
            f"root {str(root)!r}: cannot be made or opened as a directory ({e.strerror or e})"
        ) from e


# What the path given as a root can cause (a file, a file on the way, a symlink, no access, a
# read-only file system, a name too long); other errors are the system's and stay OSError.
_NOT_A_ROOT = frozenset(
    (
        errno.ENOTDIR,
        errno.EEXIST,
        errno.ELOOP,
        errno.EACCES,
        errno.EPERM,
        errno.EROFS,
        errno.ENAMETOOLONG,
        errno.ENOENT,
    )
)


def _open_root(root: Path, dir_mode: int, allow_unsafe_root: bool, created: bool) -> int:
    nofollow = 0
    if created:
        # The mode before the open: under a umask such as 0o400 or 0o777 the new directory
        # lacks the owner's read or search bit that opening it needs. Through an O_PATH
        # descriptor of the directory itself, not the path, so that a symlink swapped in
        # after the mkdir (a parent others can write to) does not pass the chmod on.
        nofollow = os.O_NOFOLLOW
        _chmod_dir(root, dir_mode)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | nofollow)
    try:
        if created:
            os.fchmod(fd, dir_mode)  # the directory opened is the one that has the mode
            return fd
        # fstat of the descriptor, not a stat of the path: what is checked is what is used.
        st = os.fstat(fd)
        loose = stat.S_IMODE(st.st_mode) & 0o022 & ~dir_mode
        problems = []
        if loose:
            problems.append(f"mode {stat.S_IMODE(st.st_mode):#o} lets others write ({loose:#o})")
        if st.st_uid != os.geteuid():
            problems.append(f"owned by uid {st.st_uid}, not {os.geteuid()}")
        if problems:
            msg = (
                f"root {str(root)!r}: {' and '.join(problems)}, so they could plant or "
                f"alter pages (checksums detect corruption, not forgery)"
            )
            if not allow_unsafe_root:
                raise ValueError(f"{msg}; fix the directory or set allow_unsafe_root=True")
            log.warning("%s; accepted because allow_unsafe_root=True", msg)
        return fd
    except BaseException:
        os.close(fd)
        raise


def open_regular(dirfd: int, name: str, flags: int = os.O_RDONLY) -> int | None:
    """A descriptor of the regular file ``name`` in the root, or None for anything else (absent,
    a symlink, FIFO, directory or device, or an IO error): what is checked is what is used."""
    try:
        fd = os.open(name, flags | _SAFE, dir_fd=dirfd)
    except OSError:
        return None
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def create_file(dirfd: int, name: str, mode: int) -> int:
    """Create ``name`` (it must not exist: ``O_EXCL`` refuses even a dangling symlink) with
    permission bits ``mode`` exactly, whatever the umask; open for reading and writing."""
    fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode, dir_fd=dirfd)
    try:
        os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


class RootLock:
    """An exclusive ``flock`` on the root's lock file, shared by every process using the root.

    Taken only to create or delete segments (never around page IO), so it is held briefly; a
    holder that hangs makes ``acquire`` give up after ``timeout_s`` instead of blocking forever.
    """

    _POLL_S = 0.002

    def __init__(self, dirfd: int, name: str, mode: int, timeout_s: float) -> None:
        self._dirfd, self._name, self._mode, self._timeout_s = dirfd, name, mode, timeout_s
        self._fd: int | None = None
        self._seen: int | None = None  # requests for room acted on (see ask_for_room)

    def _open(self) -> int:
        if self._fd is None:
            flags = os.O_RDWR | os.O_CREAT
            try:
                fd = os.open(self._name, flags | _SAFE, self._mode, dir_fd=self._dirfd)
            except OSError as e:
                raise OSError(e.errno, f"lock file {self._name!r}: {e.strerror}") from None
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                os.close(fd)
                raise OSError(errno.EINVAL, f"lock file {self._name!r} is not a regular file")
            if stat.S_IMODE(st.st_mode) != self._mode and st.st_uid == os.geteuid():
                os.fchmod(fd, self._mode)
            self._fd = fd
        return self._fd

    def acquire(self) -> None:
        """Take the lock; ``TimeoutError`` after ``timeout_s``, ``OSError`` if the lock file is
        not usable (e.g. something else than a regular file stands at its name)."""
        fd = self._open()
        deadline = time.monotonic() + self._timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if self._current(fd):
                    return
                # The file was deleted or replaced (an operator cleaning the root): a process
                # started since locks the new one, so this lock excludes nobody. Lock that one.
                fcntl.flock(fd, fcntl.LOCK_UN)
                self.close()
                fd = self._open()
                continue
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"root lock {self._name!r} held elsewhere for {self._timeout_s} s"
                    ) from None
                time.sleep(self._POLL_S)  # another process holds it for a few syscalls

    def _current(self, fd: int) -> bool:
        """Whether ``fd`` is still the file at the lock's name in the root."""
        try:
            at = os.stat(self._name, dir_fd=self._dirfd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (at.st_dev, at.st_ino) == (mine.st_dev, mine.st_ino)

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    # The lock file's first 8 bytes count the times a writer found the root short of room (a
    # roll granted less than a whole segment, or nothing). Each process reads the count at its
    # calls and gives back the preallocated room of its idle writers when it changed
    # (Writer.give_back); ``_seen`` is the count this process has acted on.

    def ask_for_room(self) -> None:
        """Count one more request for room (the lock held). Best effort: a count that cannot be
        written (a full disk: the lock file's first block) fails nothing else. This process's
        own request is no news to it: where nobody asked since it last looked, it is seen."""
        try:
            n = (self.room_asked() or 0) + 1
            os.pwrite(self._open(), n.to_bytes(8, "little"), 0)
        except OSError as e:
            log.debug("lock file %r: cannot count a request for room: %s", self._name, e)
            return
        if self._seen == n - 1:
            self._seen = n

    def room_asked(self) -> int | None:
        """The requests for room so far in the lock file at the lock's name (an operator may
        have replaced it: ``acquire`` follows that too); None if it cannot be read."""
        try:
            fd = self._open()
            if self._current(fd):
                raw = os.pread(fd, 8, 0)
            else:
                other = os.open(self._name, os.O_RDONLY | _SAFE, dir_fd=self._dirfd)
                try:
                    raw = os.pread(other, 8, 0)
                finally:
                    os.close(other)
        except OSError:
            return None
        return int.from_bytes(raw, "little") if len(raw) == 8 else 0

    def room_started(self) -> None:
        """A segment of this process starts (the lock held): on the first, the requests made
        before this process held any room are seen (the count outlives processes)."""
        if self._seen is None:
            self._seen = self.room_asked()

    def new_room_request(self) -> int | None:
        """The count, where it changed since this process last acted on it; else None."""
        asked = self.room_asked()
        return None if asked is None or asked == self._seen else asked

    def room_request_served(self, asked: int) -> None:
        """Every request up to ``asked`` was acted on."""
        self._seen = asked

    def __enter__(self) -> RootLock:  # noqa: PYI034 - py3.10 has no typing.Self
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
