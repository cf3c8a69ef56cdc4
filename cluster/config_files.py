"""Where a cluster config comes from: a YAML file given by path, or one shipped inside the package, read to a mapping.

Why its own module: finding and reading the file is separate from what the file must say (the sections and their
validation, ``cluster/config.py``), and it sits below that module so ``cluster.config`` can offer both. Flow:
``find_config`` (a path, or a shipped config's name) -> ``read_config_file`` (YAML to a mapping of sections) ->
``cluster.config.parse_config`` (validation). ``load_config`` in ``cluster/config.py`` runs all three.

``configs/`` is package data, found through importlib.resources, so an installed wheel works outside the source tree.
``ConfigError`` lives here because this is the lowest module that raises it; ``cluster.config`` re-exports it.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

SHIPPED_CONFIGS = "configs"  # the package that holds the shipped YAML files (package data)


class ConfigError(ValueError):
    """A config file that cannot be used; the message names the file and the field."""


def shipped_configs() -> list[str]:
    """The names of the YAML files shipped in the ``configs`` package."""
    return sorted(entry.name for entry in resources.files(SHIPPED_CONFIGS).iterdir() if entry.name.endswith(".yaml"))


def find_config(name_or_path: str | Path) -> Path | Traversable:
    """A config file: ``name_or_path`` when it is a file, else the shipped config of that name (``local`` or
    ``local.yaml``), found through importlib.resources wherever the package is installed. ConfigError if neither."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    name = str(name_or_path)
    if name and "/" not in name and "\\" not in name:  # a bare name: look among the shipped configs
        shipped = resources.files(SHIPPED_CONFIGS)
        for candidate in (name, f"{name}.yaml"):
            entry = shipped.joinpath(candidate)
            if candidate.endswith(".yaml") and entry.is_file():
                return entry
    raise ConfigError(
        f"{name_or_path}: config file not found (shipped configs, by name: {', '.join(shipped_configs())})"
    )


def read_config_file(name_or_path: str | Path) -> tuple[dict | None, str]:
    """The sections of a config file (``find_config``), not yet validated, and the file's name for error messages.
    None for an empty file; ConfigError if it is not YAML or its top level is not a mapping."""
    source = find_config(name_or_path)
    try:
        data = yaml.safe_load(source.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections")
    return data, str(source)
