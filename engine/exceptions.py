"""The engine's errors, in one place: what callers of the engine (the server, the LLM class,
tests) catch.

- ``ValueError`` (built in): a bad request or configuration; the message names the field.
- :class:`RequestRejected`: an admission plugin refused a request (a ``ValueError``).
- :class:`AdmissionPluginFailed`: an admission plugin raised.
- :class:`EngineDeadError`: the engine cannot serve (not started, shut down, or it gave up
  on its worker).
- :class:`StepError`: a step failed in the worker; the requests in it were failed.
- :class:`WorkerDiedError`: the worker process exited or could not start (the engine
  restarts it within its budget; callers see EngineDeadError once that is spent).
- :class:`RequestInterrupted`: the engine's owner ended every running request
  (``interrupt_all``: a server whose shutdown timeout ran out).
"""

from __future__ import annotations


class RequestRejected(ValueError):
    """An admission plugin turned the request away; the message says why.

    Attributes:
        retry_after: Seconds after which the same request may be accepted (a plugin's
            ``RetryLater``), or None for a permanent refusal.
    """

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class AdmissionPluginFailed(RuntimeError):
    """An admission plugin raised; the request was refused, since letting it through could
    break a quota."""


class EngineDeadError(RuntimeError):
    """The engine cannot serve any more requests (or has not been started)."""


class EngineSleepingError(EngineDeadError):
    """The engine is asleep (``sleep()``): it takes requests again after ``wake_up()``."""


class EngineBusyError(RuntimeError):
    """The engine cannot do this while requests run (``sleep()`` with requests in flight)."""


class StepError(RuntimeError):
    """A step failed in the worker; the requests in it were failed."""


class WorkerDiedError(RuntimeError):
    """The worker process exited or could not start."""


class RequestInterrupted(RuntimeError):
    """The request was ended before it finished by the engine's owner (a server stopping
    past its shutdown timeout); its engine request is aborted."""
