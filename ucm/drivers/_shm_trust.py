"""Where the shared-memory arena may live: a directory and files that only this user (or, when
sharing is asked for, one named group) can write.

Every process that maps an arena trusts its bytes: it serves the blocks in it, writes its own
cache into it, and is killed (SIGBUS) if the file is truncated under it. So a directory or file
that another user created or can write is refused, never adopted: the directory is opened
with `O_NOFOLLOW` and checked with `fstat`, and the files are opened through it
(`openat`, `O_NOFOLLOW`, `O_CREAT | O_EXCL` to create; a racing creator's file is re-checked).
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
from dataclasses import dataclass

from ucm.errors import ConfigError

DEFAULT_MODE = 0o600
DEFAULT_GROUP_MODE = 0o660


def default_shm_dir(gid: int | None = None) -> str:
    """The per-user directory (`/dev/shm/ucm-<uid>`), or one per group when sharing."""
    return f"/dev/shm/ucm-{os.geteuid()}" if gid is None else f"/dev/shm/ucm-group-{gid}"


def group_id(group: str | int) -> int:
    if isinstance(group, int) or group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ConfigError(f"group: no group named {group!r} on this host") from None


@dataclass(frozen=True, slots=True)
class Sharing:
    """Who may write the arena: this user alone (`gid` None), or also the members of `gid`."""

    mode: int = DEFAULT_MODE  # the files' mode; the directory's adds x where r is given
    gid: int | None = None

    @property
    def dir_mode(self) -> int:
        setgid = stat.S_ISGID if self.gid is not None else 0  # new files join the group
        return self.mode | ((self.mode & 0o444) >> 2) | setgid

    def _trusted_owner(self, uid: int) -> bool:
        if uid in (os.geteuid(), 0):
            return True
        if self.gid is None:
            return False
        try:  # a member of the sharing group (primary or listed)
            user = pwd.getpwuid(uid)
            return user.pw_gid == self.gid or user.pw_name in grp.getgrgid(self.gid).gr_mem
        except KeyError:
            return False

    def check(self, st: os.stat_result, path: str, what: str) -> None:
        """Raises ConfigError unless `st` is a `what` this process may trust."""
        is_dir = what == "directory"
        if not (stat.S_ISDIR(st.st_mode) if is_dir else stat.S_ISREG(st.st_mode)):
            raise ConfigError(f"{path}: not a {what}: refusing it")
        if not self._trusted_owner(st.st_uid):
            raise ConfigError(
                f"{path}: the {what} is owned by uid {st.st_uid}, not by this process's uid "
                f"{os.geteuid()}: refusing a {what} another user controls (remove it, or set "
                "shm_dir)")
        if st.st_mode & stat.S_IWOTH:
            raise ConfigError(f"{path}: the {what} is writable by every user "
                              f"(mode {stat.S_IMODE(st.st_mode):o}): refusing it")
        if st.st_mode & stat.S_IWGRP and st.st_gid != self.gid:
            raise ConfigError(
                f"{path}: the {what} is writable by group {st.st_gid} (mode "
                f"{stat.S_IMODE(st.st_mode):o}), which the options do not share with: "
                "refusing it (set group to share deliberately)")

    def open_dir(self, path: str) -> int:
        """Creates `path` (mode `dir_mode`) if absent and opens it; the fd of a trusted
        directory, never one reached through a symlink."""
        parent = os.path.dirname(path)
        if parent:
            os.makedirs(parent, mode=0o700, exist_ok=True)
        try:
            os.mkdir(path, 0o700)  # opened to the group below, once it has the group
            created = True
        except FileExistsError:
            created = False
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            if os.path.islink(path):
                raise ConfigError(f"{path}: the directory is a symlink: refusing it") from None
            if isinstance(exc, NotADirectoryError):
                raise ConfigError(f"{path}: not a directory: refusing it") from None
            raise
        try:
            if created:
                self._adopt(fd, self.dir_mode)
            self.check(os.fstat(fd), path, "directory")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def open_file(self, dir_fd: int, dir_path: str, name: str) -> int:
        """Opens (creating if absent) the regular file `name` in the directory `dir_fd`."""
        path = os.path.join(dir_path, name)
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
        for _ in range(8):  # a file removed between our two opens is created again
            try:
                fd = os.open(name, flags | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=dir_fd)
            except FileExistsError:
                pass
            else:
                try:
                    self._adopt(fd, self.mode)
                except BaseException:
                    os.close(fd)
                    raise
                return fd
            try:
                fd = os.open(name, flags | os.O_NONBLOCK, dir_fd=dir_fd)
            except FileNotFoundError:
                continue
            except OSError as exc:
                if stat.S_ISLNK(os.lstat(name, dir_fd=dir_fd).st_mode):
                    raise ConfigError(f"{path}: the file is a symlink: refusing it") from None
                raise ConfigError(f"{path}: cannot open it ({exc.strerror})") from None
            try:  # another creator's file (a racing process of ours, or not): checked
                self.check(os.fstat(fd), path, "file")
                os.set_blocking(fd, True)
            except BaseException:
                os.close(fd)
                raise
            return fd
        raise ConfigError(f"{path}: removed and created again while opening it")

    def _adopt(self, fd: int, mode: int) -> None:
        """Gives a file or directory this process created its group, then its mode (both
        independent of the umask)."""
        if self.gid is not None:
            try:
                os.fchown(fd, -1, self.gid)
            except PermissionError:
                raise ConfigError(f"group: this process (uid {os.geteuid()}) is not a member "
                                  f"of group {self.gid}") from None
        os.fchmod(fd, mode)


PRIVATE = Sharing()  # this user alone, files 0600
