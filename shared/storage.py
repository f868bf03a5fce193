"""Blob and checkpoint stores.

Blobs are content-addressed (sha256): an image stored by many steps lies on disk once. The
``BlobStore`` protocol is what an S3-compatible store would implement; ``LocalBlobStore`` keeps
files under the data folder.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Protocol

from shared.settings import Settings, get_settings

SHA_RE = re.compile(r"^[0-9a-f]{64}$")


class BlobNotFound(KeyError):
    pass


class InvalidBlobId(ValueError):
    pass


class BlobStore(Protocol):
    def put(self, data: bytes) -> str: ...
    def get(self, sha: str) -> bytes: ...
    def exists(self, sha: str) -> bool: ...


def check_sha(sha: str) -> str:
    """A blob id is exactly 64 lowercase hex digits: nothing else can reach the file system."""
    if not isinstance(sha, str) or not SHA_RE.match(sha):
        raise InvalidBlobId("a blob id is 64 lowercase hexadecimal characters (a sha256)")
    return sha


class LocalBlobStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def _path(self, sha: str) -> Path:
        check_sha(sha)
        return self.root / sha[:2] / sha[2:4] / sha

    def put(self, data: bytes) -> str:
        sha = hashlib.sha256(data).hexdigest()
        path = self._path(sha)
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            # Write then rename: readers never see a half-written blob, and racing writers agree.
            fd, tmp = tempfile.mkstemp(dir=path.parent)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        return sha

    def get(self, sha: str) -> bytes:
        path = self._path(sha)
        if not path.exists():
            raise BlobNotFound(sha)
        return path.read_bytes()

    def exists(self, sha: str) -> bool:
        return self._path(sha).exists()


class CheckpointStore:
    """Checkpoints are folders ``run-<id>/update-<idx>``; the database row keeps size and sha256."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def path_for(self, run_id: int, update_idx: int) -> Path:
        name = "init" if update_idx < 0 else f"update-{update_idx:05d}"
        return self.root / f"run-{run_id}" / name

    def resolve(self, rel: str) -> Path:
        path = (self.root / rel).resolve()
        if self.root.resolve() not in path.parents:
            raise InvalidBlobId("checkpoint path escapes the checkpoint store")
        return path

    def relative(self, path: Path) -> str:
        return str(Path(path).resolve().relative_to(self.root.resolve()))

    @staticmethod
    def digest(path: Path) -> tuple[int, str]:
        """Total size and a sha256 over the folder's files (names and bytes, sorted)."""
        h = hashlib.sha256()
        size = 0
        for f in sorted(p for p in Path(path).rglob("*") if p.is_file()):
            data = f.read_bytes()
            h.update(str(f.relative_to(path)).encode())
            h.update(data)
            size += len(data)
        return size, h.hexdigest()

    @staticmethod
    def weights_digest(*folders: Path) -> str:
        """A sha256 over the folders' weight files alone (``*.safetensors``: names and bytes):
        two runs started from the same weights agree on it wherever their folders live (a
        folder's ``digest`` also covers ``policy.json``, which names the base model's path)."""
        h = hashlib.sha256()
        for folder in folders:
            for f in sorted(Path(folder).rglob("*.safetensors")):
                h.update(str(f.relative_to(folder)).encode())
                h.update(f.read_bytes())
        return h.hexdigest()

    def remove(self, path: Path) -> None:
        shutil.rmtree(path, ignore_errors=True)


def blob_store(settings: Settings | None = None) -> LocalBlobStore:
    s = settings or get_settings()
    return LocalBlobStore(s.blobs_path)


def checkpoint_store(settings: Settings | None = None) -> CheckpointStore:
    s = settings or get_settings()
    return CheckpointStore(s.checkpoints_path)
