"""``qplug`` commands that need torch, one module per command, each with ``register(app)``.

:data:`qplug_core.cli.app.COMMAND_MODULES` lists them. Modules import torch and the flows inside the
command functions only, so that ``qplug --version`` and ``qplug list-backends --no-load`` stay fast.
"""
