"""The plugin host: hook specs, the plugin manager and its isolation, the contract types plugins
return, the assembled :class:`~qplug_core.registry.backends.Backend` and the reference backend."""
