"""Content-addressed bundle cache of the agent: ``<cache>/bundles/<digest>.kpack``, verified on entry.

A download enters the cache only after ``kernelpack.verify`` has checked its digest, signature, trusted key
and every member (no byte of it is extracted or imported before); a file that fails is deleted and the
reason raised as :class:`BundleRefused`. Stable and candidate versions sit side by side, so a rollback is a
switch of the published active version, not a download. Loading for trials and serving goes through
``kernelpack.loader`` which verifies again.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from kernelctl.wire import BundleRef
from kernelpack.errors import BundleError
from kernelpack.runtime import ActiveRef, publish_active, unpublish_active
from kernelpack.verify import verify_path

log = logging.getLogger("kernelctl.agent.cache")


class BundleRefused(Exception):
    """A bundle failed verification (digest, signature, trusted key, manifest, members) and was deleted."""

    def __init__(self, ref: BundleRef, reason: str) -> None:
        super().__init__(f"bundle {ref.name}@{ref.version} ({ref.digest[:12]}) refused: {reason}")
        self.ref = ref
        self.reason = reason


class BundleCache:
    """Verified .kpack files by digest, plus a scratch directory for downloads and loader extraction."""

    def __init__(self, root: Path, trusted_keys_dir: Path) -> None:
        self.root = Path(root)
        self.trusted_keys_dir = Path(trusted_keys_dir)
        self.bundles = self.root / "bundles"
        self.downloads = self.root / "downloads"
        self.loader_dir = self.root / "loader"  # kernelpack.loader cache_dir (extractions, Triton cache)
        for d in (self.bundles, self.downloads, self.loader_dir):
            d.mkdir(parents=True, exist_ok=True)
        for stale in self.downloads.glob(".dl-*"):  # a previous run's files; its partial downloads are resumed
            if not stale.name.endswith(".part"):
                stale.unlink(missing_ok=True)

    def path_of(self, digest: str) -> Path:
        return self.bundles / f"{digest}.kpack"

    def has(self, ref: BundleRef) -> bool:
        return self.path_of(ref.digest).is_file()

    def install(self, downloaded: Path, ref: BundleRef) -> Path:
        """Verify ``downloaded`` against ``ref`` and the trusted keys, then move it into the cache.

        On any failure the file is deleted and :class:`BundleRefused` raised with the verifier's reason.
        """
        downloaded = Path(downloaded)
        try:
            bundle = verify_path(downloaded, self.trusted_keys_dir, digest=ref.digest)
            if (bundle.name, bundle.version) != (ref.name, ref.version):
                raise BundleRefused(
                    ref, f"archive holds {bundle.name}@{bundle.version}, not {ref.name}@{ref.version}"
                )
        except BundleError as exc:
            downloaded.unlink(missing_ok=True)
            log.error("refusing bundle %s@%s: %s", ref.name, ref.version, exc)
            raise BundleRefused(ref, str(exc)) from exc
        except BundleRefused:
            downloaded.unlink(missing_ok=True)
            raise
        target = self.path_of(ref.digest)
        os.chmod(downloaded, 0o444)
        os.replace(downloaded, target)
        log.info("staged %s@%s (%s)", ref.name, ref.version, ref.digest[:12])
        return target

    def reverify(self, ref: BundleRef) -> Path:
        """Check a cached file again (before a trial uses it); a file changed on disk is deleted and refused."""
        path = self.path_of(ref.digest)
        if not path.is_file():
            raise BundleRefused(ref, "not in the cache")
        try:
            verify_path(path, self.trusted_keys_dir, digest=ref.digest)
        except BundleError as exc:
            os.chmod(path, 0o644)
            path.unlink(missing_ok=True)
            raise BundleRefused(ref, f"cached copy no longer verifies: {exc}") from exc
        return path

    def digests(self) -> set[str]:
        return {p.name[: -len(".kpack")] for p in self.bundles.glob("*.kpack")}

    def gc(self, keep: Iterable[str]) -> list[str]:
        """Delete cached bundles whose digest is not in ``keep``; returns the removed digests."""
        keep_set = set(keep)
        removed = []
        for digest in sorted(self.digests() - keep_set):
            p = self.path_of(digest)
            try:
                os.chmod(p, 0o644)
                p.unlink()
                removed.append(digest)
            except OSError as exc:
                log.warning("could not remove cached bundle %s: %s", p, exc)
        for part in self.downloads.glob(".dl-*.part"):  # partial downloads of versions no longer wanted
            if part.name[len(".dl-"):-len(".part")] not in keep_set:
                part.unlink(missing_ok=True)
        # the loader's read-only extractions and per-bundle Triton caches of versions no longer kept
        for sub in ("bundles", "triton"):
            root = self.loader_dir / sub
            for d in root.glob("*") if root.is_dir() else []:
                if len(d.name) == 64 and d.name not in keep_set and d.is_dir():
                    for dirpath, _dirs, _files in os.walk(d):
                        os.chmod(dirpath, 0o700)
                    shutil.rmtree(d, ignore_errors=True)
        return removed

    def publish(self, runtime_dir: Path, active: dict[str, BundleRef], stable: dict[str, BundleRef]) -> None:
        """Publish each bundle's active (and stable) version for serving code (``kernelpack.runtime``).

        Only staged (verified) versions are published; each bundle is one atomic write+rename. A bundle's
        entry names its stable version only when ``stable`` has one (a withdrawn stable is no fallback).
        """
        for name, ref in sorted(active.items()):
            if not self.has(ref):
                log.error("not publishing %s@%s: it is not staged", ref.name, ref.version)
                continue
            st = stable.get(name)
            st_ref = (
                ActiveRef(version=st.version, path=str(self.path_of(st.digest)), digest=st.digest)
                if st is not None and self.has(st) else None
            )
            publish_active(runtime_dir, name, ref.version, self.path_of(ref.digest), ref.digest, st_ref)

    @staticmethod
    def unpublish(runtime_dir: Path, name: str) -> bool:
        """Remove ``name`` from the published versions (withdrawn); False when it was not published."""
        return unpublish_active(runtime_dir, name)
