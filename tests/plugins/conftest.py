"""``fake_dist``: real, discoverable plugin distributions written into ``tmp_path``
(see :class:`qplug_core.testing.distributions.FakeDists`). Tests of ``QPLUG_LOAD_PLUGINS`` set it
themselves afterwards.
"""

from qplug_core.testing.distributions import fake_dist

__all__ = ["fake_dist"]
