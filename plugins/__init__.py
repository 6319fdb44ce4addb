"""Pagoda's plugin API: hook specifications, read-only views and the built-in policies.

Write a plugin with ``hookimpl``; see docs/plugins.md.
"""

import pluggy

from pagoda.plugins.admission import RetryLater
from pagoda.plugins.hookspecs import PROJECT_NAME

hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

__all__ = ["PROJECT_NAME", "RetryLater", "hookimpl"]
