"""A recipe's `--set` overrides judged on the controller exactly as the recipe judges them on the hosts
(mnft.recipes.config.load_config): a typo (`max_stepz=5`) or a bad value is bad input, one line, exit 2, before any
host is checked, synced or started, instead of torchrun's traceback on every host ~20 s later."""

from __future__ import annotations

from pathlib import Path

from mnft.core.errors import InputError


def check_overrides(recipe: str, overrides: tuple[str, ...], src: Path | None = None) -> None:
    """Refuse what the recipe would refuse: an unknown key (with the close one it meant), a value of the wrong type
    or out of range. A `config=PATH` override names a file of the synced tree (or the hosts'): read from `src` when
    it is there, else the other overrides are judged against the recipe's own config file."""
    from mnft.recipes import config

    if recipe not in config.SCHEMAS:
        return  # an unknown recipe is refused where recipes are named
    argv = list(overrides)
    chosen = [a for a in argv if a.partition("=")[0] == "config"]
    if chosen:
        path = Path(chosen[-1].partition("=")[2])
        local = path if path.is_absolute() else (src or Path.cwd()) / path
        argv = [a for a in argv if a not in chosen] + ([f"config={local}"] if local.is_file() else [])
    try:
        config.load_config(recipe, argv)
    except config.ConfigError as exc:
        raise InputError(f"--set: recipe {recipe}: {exc} (nothing was changed on any host)") from None
