"""The artifacts directory on disk: `manifest.yaml` plus content-addressed graph and weight files.

Written atomically (a staging directory renamed into place) by the compiler; verified by the
runtime before anything is loaded: signature (when a trusted key is given), format version,
graphc and torch versions, and the sha256 of every file. Import-light (no torch at import).

Layout:
    manifest.yaml
    manifest.sig                 with `compile --sign-key`
    graphs/<sha256>.<ext>        one file per distinct compiled graph
    weights/<sha256>.safetensors one file per distinct per-rank weight set
    tokenizer.json               when the checkpoint has one
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import yaml

from graphc import __version__
from graphc.artifacts.manifest import FORMAT_VERSION, MANIFEST, ArtifactError, Manifest
from graphc.artifacts.schema import parse_manifest
from graphc.artifacts.signing import SIGNATURE, verify

WRITE_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}
"""What the device holding the artifacts can answer a write with (a full disk, a quota, a file too
large for it, a read-only mount): refused in one line, the staging directory removed."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


ARTIFACT_ENTRIES = {MANIFEST, SIGNATURE, "graphs", "weights", "tokenizer.json"}
"""Everything `graphc compile` writes into an artifacts directory."""


def check_replaceable(out: Path, force: bool) -> None:
    """Refuse to write `out` unless it is absent, or `force` is set and it holds graphc artifacts
    and nothing else (`--force` never deletes anything graphc did not write).

    Raises:
        ArtifactError: naming what is in the way.
    """
    if not out.exists() and not out.is_symlink():
        return
    if not force:
        raise ArtifactError(f"output {str(out)!r} already exists; pass --force to replace it")
    if out.is_symlink() or not out.is_dir():
        raise ArtifactError(f"output {str(out)!r} is not a directory of graphc artifacts; --force only replaces those")
    foreign = sorted(p.name for p in out.iterdir() if p.name not in ARTIFACT_ENTRIES)
    try:
        manifest = yaml.safe_load((out / MANIFEST).read_text()) if (out / MANIFEST).is_file() else None
    except (yaml.YAMLError, UnicodeDecodeError):
        manifest = None
    if not isinstance(manifest, dict) or "graphc_version" not in manifest or foreign:
        held = f" (it holds {', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''})" if foreign else ""
        raise ArtifactError(f"output {str(out)!r} is not a directory of graphc artifacts{held}; --force only replaces "
                            "those: choose another -o")


@contextmanager
def _exclusive(out: Path) -> Iterator[None]:
    """Hold the lock of writing `out` (a lock file beside it), or fail at once: two compiles into
    one directory would each replace the other's result."""
    lock_path = out.parent / f".{out.name}.graphc-lock"
    lock = open(lock_path, "a")
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ArtifactError(f"output {str(out)!r} is being written by another graphc compile; "
                                "wait for it or choose another -o") from None
        if not lock_path.exists() or os.stat(lock_path).st_ino != os.fstat(lock.fileno()).st_ino:
            # The holder finished and removed the file between our open and our lock.
            raise ArtifactError(f"output {str(out)!r} was just written by another graphc compile; "
                                "compile again to replace it")
        try:
            yield
        finally:
            lock_path.unlink()  # while still holding it, so a waiter sees the inode change
    finally:
        lock.close()


@contextmanager
def atomic_directory(out: Path, force: bool) -> Iterator[Path]:
    """Yield a staging directory beside `out`; on success it becomes `out`, on any error it goes.
    One writer at a time (another gets an error at once).

    Raises:
        ArtifactError: `out` cannot be replaced (`check_replaceable`), or is being written.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(out):
        check_replaceable(out, force)
        yield from _staged(out)


def _staged(out: Path) -> Iterator[Path]:
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.staging-", dir=out.parent))
    try:
        try:
            yield staging
        except OSError as e:
            if e.errno not in WRITE_ERRORS:
                raise
            raise ArtifactError(f"{out}: writing the artifacts failed: {e.strerror} ({e.filename or out.parent}); "
                                f"nothing was written{' and the old artifacts are kept' if out.exists() else ''}") \
                from None
        _follow_umask(staging)
        if out.exists():
            retired = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.rename(out, retired / "old")
            os.rename(staging, out)
            shutil.rmtree(retired)
        else:
            os.rename(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _follow_umask(folder: Path) -> None:
    """Give `folder` and everything in it the modes the umask asks for: mkdtemp makes 0700 and
    some writers (safetensors) 0600, which would hide artifacts from the users meant to serve them."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [folder, *folder.rglob("*")]:
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


def read_manifest(artifacts: Path, trusted_key: Path | None = None) -> Manifest:
    """Load and verify a manifest: its signature under `trusted_key` first (when given: before
    the manifest is parsed), then versions, then every file's presence and hash.

    Raises:
        ArtifactError: naming what differs and what to do about it.
        SignatureError: with `trusted_key`, unsigned or not signed by it.
    """
    import torch  # the version check needs the runtime's torch; imported here to keep this module light

    artifacts = Path(artifacts)
    path = artifacts / MANIFEST
    if not path.is_file():
        raise ArtifactError(f"{artifacts}: no {MANIFEST}; is this a `graphc compile` output directory?")
    raw = path.read_bytes()  # read once: what is verified is what is parsed
    if trusted_key is not None:
        verify(artifacts, raw, Path(trusted_key))
    try:
        data = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise ArtifactError(f"{path}: not valid YAML ({str(e).splitlines()[0]}); recompile") from None
    if not isinstance(data, dict) or data.get("format_version") != FORMAT_VERSION:
        found = data.get("format_version") if isinstance(data, dict) else None
        raise ArtifactError(
            f"{path}: format version {found!r}, this graphc reads version {FORMAT_VERSION}; "
            f"recompile with graphc {__version__} (`graphc compile`)"
        )
    try:
        manifest = parse_manifest(data, Manifest, ArtifactError)
    except ArtifactError as e:
        raise ArtifactError(f"{path}: malformed manifest: {e}; recompile") from None
    mismatches = [(what, built, running) for what, built, running in (
        ("graphc", manifest.graphc_version, __version__), ("torch", manifest.torch_version, str(torch.__version__)),
    ) if built != running]
    if mismatches:
        compiled = " and ".join(f"{what} {built}" for what, built, _ in mismatches)
        running = " and ".join(f"{what} {now}" for what, _, now in mismatches)
        raise ArtifactError(f"{path}: compiled with {compiled}, running {running}; "
                            f"recompile with this installation or run with {compiled}")
    files = [(r.weights, r.weights_sha256, f"rank {r.rank}") for r in manifest.ranks]
    files += [(g.file, g.sha256, f"rank {r.rank}") for r in manifest.ranks for g in r.graphs]
    if manifest.tokenizer is not None or manifest.tokenizer_sha256 is not None:
        files.append((manifest.tokenizer, manifest.tokenizer_sha256, "tokenizer"))
    verified: set[str] = set()  # ranks share files; hash each once
    for name, expected, owner in files:
        if name in verified:
            continue
        file = artifact_file(artifacts, name, owner)
        if not file.is_file():
            raise ArtifactError(f"{artifacts}: {name} ({owner}) is missing; recompile")
        if sha256_file(file) != expected:
            raise ArtifactError(
                f"{artifacts}: {name} ({owner}) does not match its sha256 in {MANIFEST}; "
                "the file was modified or corrupted: recompile"
            )
        verified.add(name)
    return manifest


def artifact_file(artifacts: Path, name: object, owner: str) -> Path:
    """The file a manifest names, confined to the artifacts directory: a relative path without
    '..' that, symlinks resolved, stays inside it (a manifest is input: it may come from another
    host)."""
    if not isinstance(name, str) or not name or Path(name).is_absolute() or ".." in Path(name).parts:
        raise ArtifactError(f"{artifacts}: {owner} file {name!r} is not a path inside the artifacts directory "
                            "(relative, no '..'); recompile")
    resolved = (artifacts / name).resolve()
    if not resolved.is_relative_to(artifacts.resolve()):
        raise ArtifactError(f"{artifacts}: {owner} file {name!r} resolves to {resolved}, outside the artifacts "
                            "directory; recompile")
    return resolved
