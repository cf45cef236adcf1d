"""`ktd plan --world N [--json PATH] [--step fake|real|no] SCRIPT
[ARGS]`."""

import os

USAGE = (
    "usage: ktd plan --world N [--json PATH] [--step fake|real|no] "
    "SCRIPT [ARGS]"
)


def parse(argv):
    """(options, script, script args); a ValueError names a bad argument."""
    options = {"world": None, "json": None, "step": "auto"}
    i = 0
    while i < len(argv) and argv[i].startswith("--"):
        name, _, value = argv[i][2:].partition("=")
        if name not in options:
            raise ValueError(
                f"ktd plan: unknown option --{name}: expected --world, "
                f"--json or --step before the script.\n{USAGE}"
            )
        if not value:
            if i + 1 >= len(argv):
                raise ValueError(f"ktd plan: --{name} needs a value.\n{USAGE}")
            value = argv[i + 1]
            i += 1
        options[name] = value
        i += 1
    if options["world"] is None:
        raise ValueError(
            f"ktd plan: give the world size to plan for: --world N.\n{USAGE}"
        )
    if i >= len(argv):
        raise ValueError(f"ktd plan: give the script to plan.\n{USAGE}")
    return options, argv[i], argv[i + 1 :]


def run(argv):
    """Run `ktd plan`: (exit status, what to print). The plan as text
    (written to `--json` too), or status 2 and the error naming a bad
    argument or script."""
    from keras_torch_distribution.plan import _world

    try:
        options, script, args = parse(argv)
        _world.check_world(options["world"])
    except ValueError as error:
        return 2, str(error)
    os.environ.setdefault("KERAS_BACKEND", "torch")
    from keras_torch_distribution.plan import _output
    from keras_torch_distribution.plan import _runner

    try:
        plan = _runner.plan(
            options["world"], script, args, step=options["step"]
        )
    except (_runner.PlanError, ValueError) as error:
        return 2, str(error)
    if options["json"]:
        _output.write_json(plan, options["json"])
    return 0, _output.format_text(plan)
