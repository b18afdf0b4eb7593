"""The bundle: what `dflashctl deploy` ships, its manifest, its release id, and its tar stream.

A bundle is the project's own source (``dflash/``, ``ops/``, ``configs/``, ``pyproject.toml``,
``README.md``) and nothing else: no caches, virtualenvs, ``.git``, run dirs or checkpoints. Its
manifest lists every file sorted by path with sha256, size and mode (0o755 or 0o644: only the
exec bit travels); the release id is the sha256 of the canonical manifest, so the same source
always gives the same release, wherever it is built.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tarfile
import time
import tomllib
import typing as t
from pathlib import Path

import ops
from ops.errors import BundleError
from ops.far import release

logger = logging.getLogger(__name__)

MANIFEST_NAME = release.MANIFEST  # inside every release; the first member of every upload
MANIFEST_FORMAT = release.MANIFEST_FORMAT
ID_LENGTH = release.IDLEN  # hex chars of the id used as a directory name; the manifest keeps all 64

# What a checkout contributes. Tests are left out: the container runs training, not the suite.
INCLUDE = ("dflash", "ops", "configs", "pyproject.toml", "README.md")
SKIP_DIRS = frozenset(
    {
        "__pycache__",
        ".git",
        ".hg",
        ".venv",
        "venv",
        ".dflash",
        ".pytest_cache",
        ".mypy_cache",
        ".ruff_cache",
        ".hypothesis",
        ".ipynb_checkpoints",
        "node_modules",
        "checkpoints",
        "runs",
        "wandb",
    }
)
SKIP_SUFFIXES = (
    ".pyc",
    ".pyo",
    ".egg-info",
    ".swp",
    "~",
    ".safetensors",
    ".pt",
    ".pth",
    ".ckpt",
    ".bin",
    ".partial",
)
SKIP_NAMES = frozenset({".DS_Store", MANIFEST_NAME})

BLOCK = tarfile.BLOCKSIZE
READ_CHUNK = 1 << 20
SEND_CHUNK = 1 << 18


@dataclasses.dataclass(frozen=True, slots=True)
class FileEntry:
    path: str  # relative, '/'-separated
    sha256: str
    size: int
    mode: int  # 0o755 or 0o644

    def row(self) -> list[t.Any]:
        return [self.path, self.sha256, self.size, self.mode]


@dataclasses.dataclass(frozen=True, slots=True)
class Bundle:
    """Files under ``root`` with their digests; ``full_id`` is the sha256 of the canonical manifest."""

    root: Path
    files: tuple[FileEntry, ...]
    full_id: str

    @property
    def id(self) -> str:
        return self.full_id[:ID_LENGTH]

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    def by_path(self) -> dict[str, FileEntry]:
        return {f.path: f for f in self.files}

    def manifest_bytes(self, **extra: t.Any) -> bytes:
        """The manifest file of the release: the canonical part plus ``extra`` facts (not hashed)."""
        doc = {"format": MANIFEST_FORMAT, "id": self.full_id, "files": [f.row() for f in self.files], **extra}
        return json.dumps(doc, indent=None, separators=(",", ":")).encode()


def canonical_manifest(files: t.Iterable[FileEntry]) -> bytes:
    """The bytes the release id hashes: the far side's own rule (ops.far.release.canonical)."""
    return release.canonical([f.row() for f in files])


def release_id(files: t.Iterable[FileEntry]) -> str:
    return release.release_id([f.row() for f in files])


# --------------------------------------------------------------------------------------------
# Building


def source_root() -> Path | None:
    """The checkout dflashctl runs from (the folder holding the imported ``ops`` with our pyproject.toml), or None."""
    root = Path(ops.__file__).resolve().parent.parent
    pyproject = root / "pyproject.toml"
    if not pyproject.is_file():
        return None
    try:
        name = tomllib.loads(pyproject.read_text()).get("project", {}).get("name")
    except (OSError, tomllib.TOMLDecodeError):
        return None
    return root if name == "dflash" else None


def build_bundle(root: str | os.PathLike[str] | None = None) -> Bundle:
    """Hash the project's source: ``root`` (a checkout), else this checkout, else the installed packages."""
    if root is not None:
        base = Path(root).resolve()
        if not (base / "pyproject.toml").is_file():
            raise BundleError(f"{base}: not a checkout of the project (no pyproject.toml)")
        tops = [base / name for name in INCLUDE]
    else:
        checkout = source_root()
        if checkout is not None:
            base = checkout
            tops = [base / name for name in INCLUDE]
        else:
            # Installed (wheel) layout: only the two packages exist; configs come with the checkout.
            import dflash  # here: the operator side imports the training core for this layout only

            pkgs = [Path(str(m.__file__)).resolve().parent for m in (dflash, ops)]
            base = pkgs[0].parent
            if pkgs[1].parent != base:
                raise BundleError(f"dflash ({pkgs[0]}) and ops ({pkgs[1]}) are installed in different places")
            tops = pkgs
    files: list[FileEntry] = []
    for top in tops:
        if top.is_symlink():
            logger.warning("bundle: skipping %s: a symlink", top)
        elif top.is_file():
            files.append(_entry(base, top))
        elif top.is_dir():
            files.extend(_walk(base, top))
    if not any(f.path.startswith("ops/") for f in files):
        raise BundleError(f"{base}: no ops/ package found; nothing to deploy")
    files.sort(key=lambda f: f.path)
    return Bundle(root=base, files=tuple(files), full_id=release_id(files))


def _walk(base: Path, top: Path) -> t.Iterator[FileEntry]:
    for dirpath, dirnames, filenames in os.walk(top):
        # Pruned in place so os.walk never descends into caches or run dirs.
        dirnames[:] = sorted(d for d in dirnames if not _skipped(d) and not os.path.islink(os.path.join(dirpath, d)))
        for name in sorted(filenames):
            if _skipped(name):
                continue
            path = Path(dirpath, name)
            if path.is_symlink() or not path.is_file():
                logger.warning("bundle: skipping %s: not a regular file", path)
                continue
            yield _entry(base, path)


def _skipped(name: str) -> bool:
    return name in SKIP_DIRS or name in SKIP_NAMES or name.endswith(SKIP_SUFFIXES)


def _entry(base: Path, path: Path) -> FileEntry:
    rel = path.relative_to(base).as_posix()
    try:
        rel.encode("utf-8")
    except UnicodeEncodeError:
        raise BundleError(f"{path}: file name is not valid UTF-8; rename it") from None
    digest = hashlib.sha256()
    size = 0
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            while chunk := f.read(READ_CHUNK):
                digest.update(chunk)
                size += len(chunk)
    except OSError as e:
        raise BundleError(f"{path}: cannot read: {e.strerror}") from e
    return FileEntry(rel, digest.hexdigest(), size, 0o755 if mode & 0o100 else 0o644)


# --------------------------------------------------------------------------------------------
# The upload stream


class TarStream:
    """A tar of the manifest then ``entries``, produced in chunks (never the whole thing in memory).

    A local read problem (a file changed or vanished since it was hashed) is not raised from the
    iterator, because that would leave the transport's writer half-way: the stream just ends early
    (the remote side then refuses the truncated tar) and ``error`` says what happened.
    """

    def __init__(self, bundle: Bundle, entries: t.Sequence[FileEntry], manifest: bytes) -> None:
        self.bundle = bundle
        self.entries = tuple(entries)
        self.manifest = manifest
        self.sent = 0
        self.error: str | None = None
        self.on_chunk: t.Callable[[int], None] | None = None
        now = int(time.time())
        self._mtime = now

    @property
    def expected_size(self) -> int:
        """The exact number of bytes the stream yields (header + padded data per member + end blocks)."""
        total = 2 * BLOCK
        for name, size in [(MANIFEST_NAME, len(self.manifest))] + [(e.path, e.size) for e in self.entries]:
            total += len(self._header(name, size, 0o644)) + _padded(size)
        return total

    def _header(self, name: str, size: int, mode: int, mtime: int | None = None) -> bytes:
        info = tarfile.TarInfo(name)
        info.size = size
        info.mode = mode
        info.mtime = self._mtime if mtime is None else mtime
        info.type = tarfile.REGTYPE
        # PAX handles long and non-ASCII names; ownership is ignored on the far side.
        return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")

    def _pieces(self) -> t.Iterator[bytes]:
        yield self._header(MANIFEST_NAME, len(self.manifest), 0o644)
        yield self.manifest + _pad(len(self.manifest))
        for entry in self.entries:
            path = self.bundle.root / entry.path
            try:
                f = open(path, "rb")
                mtime = int(os.fstat(f.fileno()).st_mtime)
            except OSError as e:
                self.error = f"{path}: cannot read: {e.strerror}"
                return
            with f:
                yield self._header(entry.path, entry.size, entry.mode, mtime)
                left = entry.size
                digest = hashlib.sha256()
                while left:
                    chunk = f.read(min(SEND_CHUNK, left))
                    if not chunk:
                        self.error = f"{path}: changed while deploying (shorter than when it was hashed)"
                        return
                    digest.update(chunk)
                    left -= len(chunk)
                    yield chunk
                if digest.hexdigest() != entry.sha256 or f.read(1):
                    self.error = f"{path}: changed while deploying; run deploy again"
                    return
                yield _pad(entry.size)
        yield b"\0" * (2 * BLOCK)

    def __iter__(self) -> t.Iterator[bytes]:
        # Headers and small files coalesced into large chunks: one ssh write per 256 KiB, not per member.
        buf = bytearray()
        for piece in self._pieces():
            buf += piece
            if len(buf) >= SEND_CHUNK:
                yield from self._emit(bytes(buf))
                buf.clear()
        if buf:
            yield from self._emit(bytes(buf))

    def _emit(self, chunk: bytes) -> t.Iterator[bytes]:
        self.sent += len(chunk)
        if self.on_chunk is not None:
            self.on_chunk(self.sent)
        yield chunk


def _padded(size: int) -> int:
    return size + (-size % BLOCK)


def _pad(size: int) -> bytes:
    return b"\0" * (-size % BLOCK)
