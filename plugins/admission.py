"""What an admission plugin may answer besides a plain reason: a rejection to retry later."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RetryLater:
    """A rejection that is temporary: a rate limit, a quota that refills.

    Return it from ``pagoda_admit_request`` instead of a reason string when the same
    request would be accepted later. The HTTP server answers 429 with ``Retry-After``
    (which OpenAI clients retry after the pause); a plain reason string is a permanent
    refusal (403, which clients do not retry).

    Attributes:
        reason: Why, for the client.
        retry_after: Seconds after which a retry may succeed (at least 0).
    """

    reason: str
    retry_after: float = 1.0

    def __post_init__(self) -> None:
        if not self.retry_after >= 0:
            raise ValueError(f"retry_after must be >= 0, got {self.retry_after!r}")
