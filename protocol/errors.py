"""Exception classes of the protocol core.

Each error says what was wrong in terms a caller can act on; none of them is raised for a
condition the caller caused by misusing the API (those are TypeError/ValueError).
"""

from __future__ import annotations


class PatchswarmError(Exception):
    """Base class of every error patchswarm raises for bad input or failed verification."""


class FormatError(PatchswarmError):
    """Bytes that do not follow the format (corrupt, truncated, re-ordered, non-canonical)."""


class UnsupportedFormatError(FormatError):
    """A format version or feature this implementation does not know."""


class TruncatedError(FormatError):
    """Input ended before the format said it would."""


class LimitExceededError(FormatError):
    """Input declares or would produce more data than its bounds allow (e.g. a decompression bomb)."""


class UnsupportedDtypeError(FormatError):
    """A tensor dtype patchswarm does not handle."""


class UnservableError(FormatError, ValueError):
    """Weights the chosen served format cannot hold faithfully (inf/NaN under fp8, finite values past
    fp16's range): the publisher's input, so one line for the user, never an internal error.  A
    ValueError too, for the callers that caught it as one."""


class LayoutMismatchError(PatchswarmError):
    """Two served versions do not have the same tensor names, dtypes and shapes."""


class DigestMismatchError(PatchswarmError):
    """A tensor or state digest is not the one the manifest promises."""

    def __init__(self, what: str, expected: bytes, actual: bytes) -> None:
        super().__init__(f"{what}: digest {actual.hex()[:16]}… does not match expected {expected.hex()[:16]}…")
        self.what = what
        self.expected = expected
        self.actual = actual


class BaseMismatchError(DigestMismatchError):
    """The base a patch is applied to is not the base it was made from."""


class TargetMismatchError(DigestMismatchError):
    """Applying a patch did not produce the promised target (never left visible)."""


class ChunkError(PatchswarmError):
    """A chunk whose size or hash is not the one its manifest lists."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(f"chunk {index}: {reason}")
        self.index = index
        self.reason = reason


class SignatureError(PatchswarmError):
    """A signature that is missing, malformed, or does not verify."""


class UntrustedKeyError(SignatureError):
    """Signed by a key that is not trusted (unknown, uncertified, expired or revoked)."""


class ExpiredError(PatchswarmError):
    """A signed document past its expiry (beyond the allowed clock skew), or not yet valid.

    ``document`` names the kind that expired ("head" for a signed head) where the caller must tell
    a stale head from a certificate outside its validity."""

    def __init__(self, message: str, document: str = "") -> None:
        super().__init__(message)
        self.document = document


class RollbackError(PatchswarmError):
    """A signed document older than one already trusted (a replay or rewind)."""


class EquivocationError(PatchswarmError):
    """Two different signed documents claim the same place in a chain (a forked signer)."""

    def __init__(self, what: str, first: bytes, second: bytes) -> None:
        super().__init__(f"{what}: two different signed documents for the same position")
        self.what = what
        self.first = first
        self.second = second


class NoPathError(PatchswarmError):
    """No chain of retained versions leads from what a host holds to the wanted version."""


class PublisherBehindError(PatchswarmError):
    """The background publisher's queue is full: publishing cannot keep up with training."""


class MissingError(PatchswarmError):
    """A file the head or a manifest names is not on the board (or no source has it)."""


class PlanError(PatchswarmError):
    """A layout plan that cannot be applied: a tensor unmapped, regions that overlap or leave a hole,
    sizes that do not divide, a plan file that is malformed.  One line, raised before anything is written."""
