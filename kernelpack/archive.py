"""The .kpack container: a deterministic gzip'd tar written and read with safety checks.

Writing: members sorted by name, regular files only, mode 0644, mtime 0, uid/gid 0, empty owner names,
gzip header mtime 0 and no file name, so the same members always give the same bytes. Reading: every header
is checked before its data is read (regular file, relative normalised path without ``..``, no duplicates,
per-member and total size limits, member count), so a hostile archive cannot escape a directory or exhaust
memory. Decompression is streamed through a counter: reading stops with :class:`SizeLimitError` as soon as
the uncompressed stream (tar headers, extended headers, padding and data) passes ``Limits.stream_cap``, so a
gzip bomb costs at most that many bytes of work, whatever its headers claim. Reading never executes anything.
"""

from __future__ import annotations

import gzip
import io
import os
import tarfile
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from kernelpack.errors import ArchiveFormatError, SizeLimitError, UnsafeMemberError

MiB = 1024 * 1024


@dataclass(frozen=True)
class Limits:
    """Size limits applied when reading a bundle (configurable per caller)."""

    max_member_bytes: int = 64 * MiB
    max_total_bytes: int = 512 * MiB
    max_members: int = 20_000
    max_archive_bytes: int = 256 * MiB

    @property
    def stream_cap(self) -> int:
        """Most uncompressed bytes ever read: the content limit plus tar overhead (headers, padding)."""
        return self.max_total_bytes + 2048 * min(self.max_members, 100_000) + MiB


DEFAULT_LIMITS = Limits()


class _CappedStream:
    """A read/seek/tell file over a gzip stream that refuses to decompress past ``cap`` bytes."""

    def __init__(self, blob: bytes, cap: int) -> None:
        self._gz = gzip.GzipFile(fileobj=io.BytesIO(blob), mode="rb")
        self.cap = cap

    def _over(self) -> SizeLimitError:
        return SizeLimitError(f"archive decompresses to more than {self.cap} bytes (the uncompressed limit)")

    def read(self, n: int = -1) -> bytes:
        room = self.cap + 1 - self._gz.tell()
        data = self._gz.read(room if n is None or n < 0 else min(n, room))
        if self._gz.tell() > self.cap:
            raise self._over()
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        target = offset if whence == 0 else self._gz.tell() + offset if whence == 1 else None
        if target is None:
            raise OSError("seeking from the end of a compressed stream is not supported")
        if target > self.cap:
            raise self._over()
        return self._gz.seek(target)

    def tell(self) -> int:
        return self._gz.tell()

    def close(self) -> None:
        self._gz.close()


def check_member_name(name: str) -> str:
    """Refuse names that are absolute, contain ``..``/empty/``.`` parts or backslashes; return it unchanged."""
    if not name or name.startswith("/") or "\\" in name or "\x00" in name:
        raise UnsafeMemberError(f"archive member {name!r} has an absolute or invalid path")
    parts = name.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise UnsafeMemberError(f"archive member {name!r} escapes or is not a normalised relative path")
    if PurePosixPath(name).is_absolute() or (len(name) > 1 and name[1] == ":"):
        raise UnsafeMemberError(f"archive member {name!r} has an absolute path")
    return name


def write_archive(path: Path, members: Mapping[str, bytes]) -> bytes:
    """Write ``members`` deterministically to ``path`` (atomically); return the archive bytes."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name in sorted(members):
            check_member_name(name)
            data = members[name]
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            info.mtime = 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.type = tarfile.REGTYPE
            tar.addfile(info, io.BytesIO(data))
    out = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=out, mtime=0, compresslevel=6) as gz:
        gz.write(raw.getvalue())
    blob = out.getvalue()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(blob)
    os.replace(tmp, path)
    return blob


def read_archive(blob: bytes, limits: Limits = DEFAULT_LIMITS) -> dict[str, bytes]:
    """Read all members of a .kpack from its bytes, checking every header first."""
    if len(blob) > limits.max_archive_bytes:
        raise SizeLimitError(f"archive is {len(blob)} bytes, over the limit of {limits.max_archive_bytes}")
    members: dict[str, bytes] = {}
    total = 0
    try:
        stream = _CappedStream(blob, limits.stream_cap)
        with tarfile.open(fileobj=stream, mode="r:") as tar:  # type: ignore[call-overload]
            for count, info in enumerate(tar, start=1):
                if count > limits.max_members:
                    raise SizeLimitError(f"archive has more than {limits.max_members} members")
                name = info.name
                if info.issym() or info.islnk():
                    raise UnsafeMemberError(f"archive member {name!r} is a link (to {info.linkname!r})")
                if not info.isreg():
                    kind = "directory" if info.isdir() else "device or special file"
                    raise UnsafeMemberError(f"archive member {name!r} is a {kind}, only regular files allowed")
                check_member_name(name)
                if name in members:
                    raise UnsafeMemberError(f"archive member {name!r} appears twice")
                if info.size > limits.max_member_bytes:
                    raise SizeLimitError(
                        f"archive member {name!r} is {info.size} bytes, over the per-file limit of "
                        f"{limits.max_member_bytes}"
                    )
                total += info.size
                if total > limits.max_total_bytes:
                    raise SizeLimitError(f"archive content exceeds the total limit of {limits.max_total_bytes} bytes")
                f = tar.extractfile(info)
                data = f.read(info.size + 1) if f is not None else b""
                if len(data) != info.size:
                    raise ArchiveFormatError(f"archive member {name!r} is truncated")
                members[name] = data
    except (tarfile.TarError, EOFError, gzip.BadGzipFile, OSError, zlib.error) as exc:
        raise ArchiveFormatError(f"not a valid .kpack archive (gzip'd tar): {exc}") from exc
    return members


def read_directory(root: Path, limits: Limits = DEFAULT_LIMITS) -> dict[str, bytes]:
    """Read an extracted bundle directory with the same checks as an archive (no links, no specials)."""
    root = Path(root)
    if not root.is_dir():
        raise ArchiveFormatError(f"{root} is not a directory")
    members: dict[str, bytes] = {}
    total = 0
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for d in dirnames:
            p = Path(dirpath, d)
            if p.is_symlink():
                raise UnsafeMemberError(f"bundle entry {p.relative_to(root).as_posix()!r} is a symlink")
        for fn in filenames:
            p = Path(dirpath, fn)
            rel = p.relative_to(root).as_posix()
            st = p.lstat()
            if p.is_symlink():
                raise UnsafeMemberError(f"bundle entry {rel!r} is a symlink")
            if not p.is_file():
                raise UnsafeMemberError(f"bundle entry {rel!r} is not a regular file")
            if st.st_nlink > 1:
                raise UnsafeMemberError(f"bundle entry {rel!r} is a hardlink")
            if st.st_size > limits.max_member_bytes:
                raise SizeLimitError(f"bundle entry {rel!r} is {st.st_size} bytes, over the per-file limit")
            total += st.st_size
            if total > limits.max_total_bytes:
                raise SizeLimitError(f"bundle content exceeds the total limit of {limits.max_total_bytes} bytes")
            if len(members) >= limits.max_members:
                raise SizeLimitError(f"bundle has more than {limits.max_members} files")
            members[check_member_name(rel)] = p.read_bytes()
    return members
