"""The `dapple` command line: `dapple <command> [--flags]`.

Each command lives in its own module, `dapple/commands/<command>.py`, which defines its absl
flags and a `main(argv)`. Only the chosen command's module is imported, so `dapple plan` and
`dapple simulate` never import TensorFlow (planner-only installs have none).
"""
import importlib
import sys
from typing import Sequence

from absl import app, flags

COMMANDS = {
    "plan": "plan a model on a topology; print or write the Plan and the strategy report",
    "simulate": "replay a plan's schedule with the cost model; timeline picture",
    "profile": "measure a Keras model's per-layer profile (needs TensorFlow)",
    "verify": "check a plan's gradients against the plain model (needs TensorFlow)",
    "launch": "run a training script under horovodrun for a plan",
    "demo": "profile, plan, report and train a small model on local logical devices",
    "emulate": "run a command's Horovod ranks (or TensorFlow cluster) on an emulated cluster: "
               "a network namespace per host, links shaped to a rate (needs root)",
    "topology": "measure the links between Horovod ranks; write the topology JSON the planner "
                "reads (needs TensorFlow, Horovod)",
}
PLANNER_ONLY_COMMANDS = ("plan", "simulate")
# Commands that never touch TensorFlow: `import dapple` skips setting up its devices for them.
COMMANDS_WITHOUT_TENSORFLOW = PLANNER_ONLY_COMMANDS + ("emulate",)
HELP = ("-h", "--help", "help")
COMMAND_HELP = ("-h", "--help", "--helpshort")     # after a command: its usage and flags


def needs_tensorflow(args: Sequence[str]) -> bool:
    """Whether `dapple <args>` runs a command that uses TensorFlow: not plan, simulate or
    emulate, and not a request for help (a command module defines flags, nothing more)."""
    return bool(args) and args[0] in COMMANDS and args[0] not in COMMANDS_WITHOUT_TENSORFLOW \
        and not any(a in COMMAND_HELP for a in args[1:])


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: dapple <command> [--flags]   (dapple <command> --help for its flags)", ""]
    lines += [f"  {name:<{width}}  {text}" for name, text in COMMANDS.items()]
    return "\n".join(lines)


def run(argv=None) -> None:
    argv = list(sys.argv if argv is None else argv)
    if len(argv) < 2 or argv[1] in HELP:
        print(usage())
        sys.exit(0 if len(argv) >= 2 else 2)
    command = argv[1]
    if command not in COMMANDS:
        print(f"dapple: unknown command {command!r}\n\n{usage()}", file=sys.stderr)
        sys.exit(2)
    try:
        module = importlib.import_module(f"dapple.commands.{command}")
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] in ("tensorflow", "horovod"):
            print(f"dapple {command} needs {e.name.split('.')[0]}, which is not installed: "
                  f"install dapple with its training extras (see README)", file=sys.stderr)
            sys.exit(2)
        raise
    if any(a in COMMAND_HELP for a in argv[2:]):
        print(command_help(module))
        sys.exit(0)
    app.run(module.main, argv=[f"dapple {command}"] + argv[2:])


def command_help(module) -> str:
    """A command's usage (its module's docstring) and the flags it defines, with their help.
    (absl's own --help lists the flags of `__main__` only, which defines none.)"""
    return f"{module.__doc__.strip()}\n\nflags:\n" + \
        flags.FLAGS.module_help(module.__name__).split("\n", 2)[-1]


if __name__ == "__main__":
    run()
