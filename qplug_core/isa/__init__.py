"""What this CPU's instruction set means for a backend: the prepare-time saturation check and the
``qplug doctor`` finding. The CPU fact and the arithmetic rule themselves live in
:mod:`qplug_core.kernels.cpu` and :mod:`qplug_core.kernels.arithmetic` (kernels read them too)."""
