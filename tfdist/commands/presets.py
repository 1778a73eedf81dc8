"""`tfdist presets`: the registered strategy presets, their options, needs and features."""

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
        if preset.fixes:
            print(f"  its factory uses: {', '.join(preset.fixes)}")
        for feature in preset.features:
            print(f"  adds {feature.name} ({feature.when}; fixes {', '.join(feature.fixes)}): "
                  f"{feature.summary}")
        if name == "auto":
            print("  adds what the preset it chooses adds")
        elif name == "default":
            print("  adds nothing: TensorFlow's default strategy is never changed")
    return 0
