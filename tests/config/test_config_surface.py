"""The config surface is pinned: a key added, renamed or removed, or a default changed, is a
change every command line and preset sees, so it is made on purpose (torchtitan's
test_no_new_cli_options). docs/configuration.md's table is held to the same keys and defaults by
test_config.py's test_the_configuration_reference_lists_every_key_with_the_default_python_run_py_uses."""

from __future__ import annotations

from tests.config.regenerate_surface import REGENERATE, SURFACE, read_surface, surface


def test_every_config_key_and_default_is_the_checked_in_one():
    now, was = surface(), read_surface()
    added = [f"{k}={now[k]}" if now[k] else k for k in now if k not in was]
    removed = [k for k in was if k not in now]
    changed = [f"{k}: {was[k]} -> {now[k]}" for k in now if k in was and now[k] != was[k]]
    assert not (added or removed or changed), (
        f"config keys differ from tests/config/{SURFACE.name}: added {added}, removed {removed}, default changed {changed}; "
        f"if on purpose, run `{REGENERATE}` and update docs/configuration.md's table"
    )
