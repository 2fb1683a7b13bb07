"""BackendConfig: every pattern a backend can fuse or quantize, keyed by its complex pattern.

Unlike torch.ao, registering a pattern twice is an error (a silent overwrite hides a plugin
conflict) unless ``replace=True`` says it is meant.
"""

from __future__ import annotations

from typing import Any

from qplug_core.config.codec import call_at, child, expect, read_fields, unversioned, versioned
from qplug_core.config.pattern_config import BackendPatternConfig
from qplug_core.errors import ConfigValidationError, DuplicatePatternError, PatternError
from qplug_core.patterns import Pattern, format_pattern

__all__ = ["BackendConfig"]

NAME_KEY = "name"
CONFIGS_KEY = "configs"


def _key(config: Any, path: str) -> Pattern:
    """The complex pattern under which ``config`` is registered."""
    if not isinstance(config, BackendPatternConfig):
        raise ConfigValidationError(f"{path} must be a BackendPatternConfig, got {config!r}",
                                    field=path, value=config)
    pattern = config.validate().pattern_complex_format
    try:
        hash(pattern)
    except TypeError as exc:
        raise PatternError(f"{path}: pattern {format_pattern(pattern)} contains an unhashable "
                           "element", pattern=pattern) from exc
    return pattern


class BackendConfig:
    """Builder of a backend's pattern configs; ``configs`` keeps insertion order."""

    def __init__(self, name: str = ""):
        self._name = ""
        self._configs: dict[Pattern, BackendPatternConfig] = {}
        self.set_name(name)

    @property
    def name(self) -> str:
        return self._name

    def set_name(self, name: str) -> BackendConfig:
        if not isinstance(name, str):
            raise ConfigValidationError(f"name must be a string, got {name!r}", field="name", value=name)
        self._name = name
        return self

    def set_backend_pattern_config(self, config: BackendPatternConfig, *,
                                   replace: bool = False) -> BackendConfig:
        """Register ``config``; a pattern already registered needs ``replace=True``.

        A replaced config keeps its original position (matchers break ties by that order).
        """
        pattern = _key(config, child(CONFIGS_KEY, len(self._configs)))
        if pattern in self._configs and not replace:
            index = list(self._configs).index(pattern)
            raise DuplicatePatternError(
                f"Pattern {format_pattern(pattern)} is already registered in backend config "
                f"{self._name!r} (configs[{index}]); pass replace=True to override it",
                field=child(CONFIGS_KEY, index), value=pattern)
        self._configs[pattern] = config
        return self

    def set_backend_pattern_configs(self, configs: list[BackendPatternConfig], *,
                                    replace: bool = False) -> BackendConfig:
        for config in expect(configs, (list, tuple), "configs", "a list of BackendPatternConfig"):
            self.set_backend_pattern_config(config, replace=replace)
        return self

    @property
    def configs(self) -> list[BackendPatternConfig]:
        """A copy of the registered configs, in insertion order."""
        return list(self._configs.values())

    def pattern_to_config(self) -> dict[Pattern, BackendPatternConfig]:
        """Complex pattern -> config, in insertion order."""
        return dict(self._configs)

    def validate(self) -> BackendConfig:
        """Re-check every config, including patterns changed after registration."""
        seen: dict[Pattern, int] = {}
        for index, config in enumerate(self._configs.values()):
            pattern = _key(config, child(CONFIGS_KEY, index))
            if pattern in seen:
                raise DuplicatePatternError(
                    f"configs[{index}] and configs[{seen[pattern]}] both have pattern "
                    f"{format_pattern(pattern)}", field=child(CONFIGS_KEY, index), value=pattern)
            seen[pattern] = index
        return self

    def to_dict(self) -> dict[str, Any]:
        return versioned({NAME_KEY: self._name,
                          CONFIGS_KEY: [c.to_data(child(CONFIGS_KEY, i)) for i, c in enumerate(self.configs)]})

    @classmethod
    def from_dict(cls, doc: Any) -> BackendConfig:
        data = read_fields(unversioned(doc), "", (NAME_KEY, CONFIGS_KEY))
        backend = cls(expect(data.get(NAME_KEY, ""), str, NAME_KEY, "a string"))
        for index, item in enumerate(expect(data.get(CONFIGS_KEY, []), list, CONFIGS_KEY, "a JSON list")):
            path = child(CONFIGS_KEY, index)
            config = BackendPatternConfig.from_data(item, path)
            if config.pattern_complex_format is None:
                raise ConfigValidationError(f"{path}: has no 'pattern' or 'pattern_complex_format'",
                                            field=child(path, "pattern"))
            call_at(path, backend.set_backend_pattern_config, config)
        return backend

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, BackendConfig) and self._name == other._name
                and list(self._configs.items()) == list(other._configs.items()))

    __hash__ = None  # type: ignore[assignment]  # mutable builder

    def __repr__(self) -> str:
        parts = [f"name={self._name!r}"] if self._name else []
        if self._configs:
            parts.append(f"configs=[{', '.join(repr(c) for c in self._configs.values())}]")
        return f"BackendConfig({', '.join(parts)})"
