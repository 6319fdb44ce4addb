"""Loading plugins: built-ins, then installed packages, then --plugin module:object."""

from __future__ import annotations

import importlib
import logging
import types

import pluggy

from pagoda.environment import read_flag
from pagoda.plugins import PROJECT_NAME, hookspecs
from pagoda.engine.core.snapshot import STEP_LOG_SPEC
from pagoda.plugins.builtin import BuiltinPolicies
from pagoda.plugins.scheduling import PolicyFactory

logger = logging.getLogger(__name__)

#: Set to a non-empty value to skip plugins installed under the `pagoda` entry-point group.
DISABLE_AUTOLOAD_ENV = "PAGODA_DISABLE_PLUGIN_AUTOLOAD"
BUILTIN_NAME = "pagoda-builtin"
#: Plugins Pagoda registers for itself (the console's step log): not listed as the user's.
INTERNAL_NAMES = frozenset({BUILTIN_NAME, STEP_LOG_SPEC})
#: Hooks of the scheduling API before policies were objects, for the error that says what replaced them.
_REMOVED_HOOKS = ("pagoda_request_sort_key", "pagoda_select_victim", "pagoda_sort_keys_change")


def _import_object(spec: str) -> object:
    """Imports ``module:object`` (or a bare module) for --plugin.

    Raises:
        ValueError: The module or attribute does not exist.
    """
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"plugin {spec!r}: cannot import {module_name!r}: {exc}") from exc
    if not attr:
        return module
    try:
        obj = module
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError as exc:
        raise ValueError(f"plugin {spec!r}: {module_name!r} has no attribute {attr!r}") from exc
    return obj


def create_plugin_manager(plugins: list[str] | tuple[str, ...] = (), load_entry_points: bool = True,
                          extra: list[object] | tuple[object, ...] = ()) -> pluggy.PluginManager:
    """Builds the plugin manager of one engine.

    Args:
        plugins: ``module:object`` specs, registered last.
        load_entry_points: Load packages under the ``pagoda`` entry-point group (unless
            the PAGODA_DISABLE_PLUGIN_AUTOLOAD variable is set).
        extra: Plugin objects to register as they are (tests, embedding).

    Raises:
        ValueError: A plugin cannot be loaded or implements an unknown hook.
    """
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    pm.register(BuiltinPolicies(), name=BUILTIN_NAME)
    if load_entry_points and not read_flag(DISABLE_AUTOLOAD_ENV):
        pm.load_setuptools_entrypoints(PROJECT_NAME)
    for spec in plugins:
        obj = _import_object(spec)
        registered = _registered_as(pm, obj)
        if registered is not None:
            # NOTE: an installed plugin named again with --plugin (or a spec given twice)
            # is the same plugin; registering it twice would run each hook twice.
            logger.info("plugin %s is already loaded (as %r); --plugin %s adds nothing", spec, registered, spec)
            continue
        # A class is instantiated, so a plugin may keep state per engine.
        pm.register(obj() if isinstance(obj, type) else obj, name=spec)
    for obj in extra:
        if _registered_as(pm, obj) is None:
            pm.register(obj)
    _refuse_removed_hooks(pm)
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise ValueError(f"a plugin implements a hook Pagoda does not have: {exc}") from exc
    return pm


def _refuse_removed_hooks(pm: pluggy.PluginManager) -> None:
    """Raises ValueError, saying what replaced them, for plugins written to the old scheduling hooks."""
    for hook in _REMOVED_HOOKS:
        caller = getattr(pm.hook, hook, None)
        if caller is not None and caller.get_hookimpls():
            plugins = ", ".join(sorted({impl.plugin_name for impl in caller.get_hookimpls()}))
            raise ValueError(
                f"plugin {plugins} implements {hook}, which Pagoda no longer calls: a scheduling policy is "
                f"now an object (pagoda.plugins.scheduling.SchedulingPolicy, with sort_key and select_victim) "
                f"that pagoda_scheduling_policies() returns as {{name: factory}} (docs/plugins.md)")


def _registered_as(pm: pluggy.PluginManager, obj: object) -> str | None:
    """The name under which ``obj`` (a module, an object, or a class one of whose instances
    is registered) is already registered, or None."""
    for name, plugin in pm.list_name_plugin():
        if plugin is obj or (isinstance(obj, type) and type(plugin) is obj):
            return name
    return None


def plugin_names(pm: pluggy.PluginManager) -> list[str]:
    """The loaded plugins other than the built-ins, in registration order, each by one name
    however it was loaded (entry point, --plugin or an object handed in): its module, and for
    an object its class (``mypkg.policies:Lottery``)."""
    return [_display_name(plugin) for name, plugin in pm.list_name_plugin() if name not in INTERNAL_NAMES]


def _display_name(plugin: object) -> str:
    if isinstance(plugin, types.ModuleType):
        return plugin.__name__
    kind = plugin if isinstance(plugin, type) else type(plugin)
    return f"{kind.__module__}:{kind.__qualname__}"


def scheduling_policy_factories(pm: pluggy.PluginManager) -> dict[str, PolicyFactory]:
    """Every registered scheduling policy's factory, by name.

    Raises:
        ValueError: A plugin answers something other than ``{name: factory}`` (a list of names,
            as the hook returned before policies were objects), or two plugins register one name.
    """
    factories: dict[str, PolicyFactory] = {}
    owners: dict[str, str] = {}
    for impl in pm.hook.pagoda_scheduling_policies.get_hookimpls():  # in registration order
        # NOTE: an object registered without a name (extra=) is named by its id.
        owner = impl.plugin_name if not impl.plugin_name.isdigit() else type(impl.plugin).__name__
        answer = impl.function()
        if not isinstance(answer, dict) or not all(isinstance(k, str) and callable(v) for k, v in answer.items()):
            raise ValueError(
                f"plugin {owner}: pagoda_scheduling_policies() must return {{name: factory}} "
                f"(a SchedulingPolicy subclass is a factory), not {answer!r} (docs/plugins.md)")
        for name, factory in answer.items():
            if name in factories:
                raise ValueError(f"scheduling policy {name!r} is registered by both {owners[name]} and {owner}")
            factories[name], owners[name] = factory, owner
    return factories


def known_policies(pm: pluggy.PluginManager) -> tuple[list[str], list[str]]:
    """(scheduling policy names, eviction policy names) registered with ``pm``."""
    scheduling = sorted(scheduling_policy_factories(pm))
    eviction = sorted({name for names in pm.hook.pagoda_eviction_policies() for name in names})
    return scheduling, eviction


def check_policy_names(pm: pluggy.PluginManager, scheduling_policy: str, eviction_policy: str) -> None:
    """Raises ValueError listing the known names when a chosen policy is unknown."""
    scheduling, eviction = known_policies(pm)
    if scheduling_policy not in scheduling:
        raise ValueError(f"unknown scheduling policy {scheduling_policy!r}; known: {', '.join(scheduling)}")
    if eviction_policy not in eviction:
        raise ValueError(f"unknown eviction policy {eviction_policy!r}; known: {', '.join(eviction)}")
