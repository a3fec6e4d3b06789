"""Errors raised while building, verifying and loading kernel bundles.

Every refusal is a :class:`BundleError` subclass whose message says what is wrong (which file, which key id,
which field) in one line, so the CLI can print it without a traceback and map it to an exit code.
"""

from __future__ import annotations


class BundleError(Exception):
    """Base class: a bundle could not be built, verified or loaded."""

    exit_code = 1


class ManifestError(BundleError):
    """The manifest (bundle.toml or manifest.json) fails the schema or is inconsistent."""

    exit_code = 3


class BundleNotFoundError(BundleError):
    """The bundle file or directory does not exist or cannot be read."""


class VerificationError(BundleError):
    """The bundle failed verification; no code from it was run."""

    exit_code = 3


class ArchiveFormatError(VerificationError):
    """The file is not a readable bundle archive."""


class UnsafeMemberError(VerificationError):
    """An archive member has an absolute path, ``..``, or is a symlink, hardlink, device or directory."""


class SizeLimitError(VerificationError):
    """A member or the whole archive exceeds the configured size limit."""


class MissingMemberError(VerificationError):
    """A file listed in the manifest is not in the archive."""


class ExtraMemberError(VerificationError):
    """The archive holds a file the manifest does not list."""


class DigestMismatchError(VerificationError):
    """A member's sha256 differs from the manifest (the bundle was tampered with or corrupted)."""


class SignatureError(VerificationError):
    """The signature is missing, malformed or does not match the manifest."""


class UntrustedKeyError(SignatureError):
    """The bundle is signed by a key that is not in the trusted-keys directory."""


class KeyFileError(BundleError):
    """A key file or trusted-keys directory is missing or malformed."""


class BuildError(BundleError):
    """Building a bundle failed (missing kernel module, compile error, wrong Triton version, ...)."""


class LoadError(BundleError):
    """A verified bundle could not be imported (a kernel module failed to import or lacks ``OP``)."""
