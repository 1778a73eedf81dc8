"""The `tfdist` command: `tfdist <command> [flags] [-- args]`.

Each command lives in its own module under tfdist/commands/ with absl flags
and a `main(argv) -> int`; only the chosen command's module is imported, so
commands never clash over flag names and start without TensorFlow unless
they need it.
"""

from __future__ import annotations

import importlib
import sys

# command -> (module, one-line summary)
COMMANDS: dict[str, tuple[str, str]] = {
    "presets": ("tfdist.commands.presets", "List the strategy presets, their options and needs."),
    "tf-config": ("tfdist.commands.tf_config",
                  "Check $TF_CONFIG, or generate TF_CONFIGs (local, hosts, SLURM, Kubernetes)."),
    "launch": ("tfdist.commands.launch",
               "Run a script as N local tasks, each with its own TF_CONFIG; supervise, restart."),
    # cost model / planner
    "plan": ("tfdist.commands.plan",
             "Cost a model on a machine or cluster (memory, communication) and pick a preset."),
}


def _usage() -> str:
    width = max(len(c) for c in COMMANDS)
    lines = ["usage: tfdist <command> [flags]  (tfdist <command> --help for its flags)", "",
             "commands:"]
    lines += [f"  {name:<{width}}  {summary}" for name, (_, summary) in COMMANDS.items()]
    return "\n".join(lines)


# What follows the flags on a command's usage line (default: nothing).
_USAGE_ARGS = {"launch": " -- COMMAND [ARGS...]"}


def command_usage(command: str, module, *, prog: str | None = None) -> str:
    """The usage text absl prints for `tfdist COMMAND --help` (its `__main__` docstring)."""
    doc = (module.__doc__ or "").strip()
    prog = prog or f"tfdist {command}"
    text = f"USAGE: {prog} [flags]{_USAGE_ARGS.get(command, '')}\n\n{doc}\n"
    return "\n" + text.replace("%", "%%")  # absl %-formats the docstring with argv[0]


def run(argv: list[str] | None = None, *, prog: str | None = None) -> None:
    """Console-script entry point.

    Args:
      argv: ["tfdist", COMMAND, ...] (default: sys.argv).
      prog: how the command was called, for messages (default: "tfdist COMMAND").
    """
    from absl import app

    argv = list(sys.argv if argv is None else argv)
    if len(argv) < 2 or argv[1] in ("-h", "--help", "help"):
        print(_usage())
        sys.exit(0 if len(argv) >= 2 else 2)
    command = argv[1]
    if command not in COMMANDS:
        print(f"tfdist: unknown command {command!r}.\n\n{_usage()}", file=sys.stderr)
        sys.exit(2)
    module = importlib.import_module(COMMANDS[command][0])
    # absl's --help prints __main__'s docstring as the usage (else "USAGE:
    # argv[0] [flags]", which named the `tfdist` script without the command)
    # and then the key flags of the module named sys.argv[0]. This process is
    # the `tfdist` command itself, so both may be set to the subcommand's.
    from absl import flags

    name = prog or f"tfdist {command}"
    sys.argv[0] = name
    sys.modules["__main__"].__doc__ = command_usage(command, module, prog=name)
    for flag in flags.FLAGS.get_flags_for_module(module.__name__):
        flags.FLAGS.register_key_flag_for_module(name, flag)
    app.run(module.main, argv=[name] + argv[2:])


if __name__ == "__main__":
    run()
