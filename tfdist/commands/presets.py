"""`tfdist presets`: the registered strategy presets, their options and needs."""

from __future__ import annotations

import dataclasses

from tfdist import strategies


def main(argv: list[str]) -> int:
    del argv
    for name in strategies.available_presets():
        preset = strategies.get_preset(name)
        print(f"{name}: {preset.summary}\n  needs: {preset.needs}")
        for field in preset.options.option_fields():
            default = field.default if field.default is not dataclasses.MISSING else "(required)"
            print(f"  --{field.name} (default {default!r}): {field.metadata.get('help', '')}")
    return 0
