"""Schedules as specs in one registry (`planner.schedules`): every schedule's name is written in
its spec module only (and may be in the registry), every spec round-trips through Plan JSON,
the CLI offers exactly the registry's names, and each spec's declared warm-up is what its
action lists do (hand-computed depths as the reference).

"String literal" here means a string token whose whole value is the name, as Python's
tokenizer reads the source: `"2bw"` or `f"2bw"` count; a docstring, a comment or a message that
mentions the name in a sentence does not (it names the schedule to a reader, it does not
decide anything)."""
import io
import json
import pathlib
import re
import subprocess
import sys
import tokenize

import pytest

from planner import schedules
from planner.schedules.actions import ScheduleError
from planner.formats.plan import Plan, Stage, straight_plan
from planner.schedules.by_name import build_schedule, first_backward_depths
from planner.schedules.base import Parameter

ROOT = pathlib.Path(__file__).resolve().parents[3]
LIBRARY = ("planner", "graph_rewrite", "dapple", "topology", "reports")
# The names plans and the CLI use, spelled as docs/formats.md spells them.
NAMES = ("gpipe", "1f1b", "interleaved", "zb-h1", "pipedream", "2bw", "avgpipe")


def string_literals(path: pathlib.Path):
    """(value, line) of every string literal of the file whose value is a whole string: plain
    strings (implicitly concatenated pieces apart) and f-strings without placeholders."""
    tokens = list(tokenize.generate_tokens(io.StringIO(path.read_text()).readline))
    fstring_middle = getattr(tokenize, "FSTRING_MIDDLE", None)
    for i, tok in enumerate(tokens):
        if tok.type == tokenize.STRING:
            try:
                value = eval(tok.string, {})        # a literal: eval reads its escapes
            except SyntaxError:
                continue
            if isinstance(value, str):
                yield value, tok.start[0]
        elif fstring_middle is not None and tok.type == fstring_middle and \
                tokens[i - 1].type == tokenize.FSTRING_START and \
                tokens[i + 1].type == tokenize.FSTRING_END:
            yield tok.string, tok.start[0]


def modules_spelling(name):
    found = set()
    for top in LIBRARY:
        for path in sorted((ROOT / top).rglob("*.py")):
            if any(value == name for value, _ in string_literals(path)):
                found.add(path.relative_to(ROOT).as_posix())
    return found


def test_the_literal_scanner_sees_strings_and_plain_f_strings_only(tmp_path):
    source = ('"""gpipe"""\n# "gpipe"\nA = "gpipe"\nB = f"gpipe"\nC = f"{A} gpipe"\n'
              'D = "the gpipe schedule"\n')
    path = tmp_path / "m.py"
    path.write_text(source)
    assert [line for value, line in string_literals(path) if value == "gpipe"] == [1, 3, 4]


def test_the_registry_offers_the_seven_schedules():
    assert schedules.names() == NAMES
    assert schedules.names(legacy=True) == ("gpipe", "1f1b", "A", "B", "interleaved", "zb-h1",
                                            "pipedream", "2bw", "avgpipe")
    assert schedules.names(relaxed=True) == ("pipedream", "2bw", "avgpipe")


@pytest.mark.parametrize("name", NAMES)
def test_each_name_is_spelled_in_its_spec_module_and_the_registry_only(name):
    spec_module = type(schedules.get(name)).__module__.replace(".", "/") + ".py"
    assert spec_module.startswith("planner/schedules/")
    found = modules_spelling(name)
    assert found, name                           # the scanner does find the spec's own
    assert found <= {spec_module, "planner/schedules/registry.py"}, (name, sorted(found))
    assert len(found) <= 2


def a_plan(spec):
    """A valid plan under `spec` on 2 device groups of 2 devices, parameters at defaults."""
    parameters = {p.name: p.default for p in spec.parameters}
    v = parameters.get("virtual_stages", 1)
    stages = [Stage(layers=[c, c], devices=[2 * (c % 2), 2 * (c % 2) + 1]) for c in range(2 * v)]
    return Plan(stages=stages, micro_batches=4, global_batch_size=16, schedule=spec.name,
                **parameters).validate(num_layers=2 * v, num_devices=4)


@pytest.mark.parametrize("spec", schedules.specs(legacy=True), ids=str)
def test_every_registered_spec_round_trips_through_plan_json(spec):
    plan = a_plan(spec)
    assert plan.schedule is spec and plan.schedule == spec.name
    text = plan.to_json()
    assert json.loads(text)["schedule"]["name"] == spec.name        # on disk: the name
    again = Plan.from_json(text)
    assert again.schedule is spec and again == plan and again.to_json() == text


def test_names_become_specs_and_unknown_names_fail_validation_clearly():
    plan = straight_plan([1], 2, 4, schedule="2bw")
    assert plan.schedule is schedules.get("2bw") and str(plan.schedule) == "2bw"
    assert f"{plan.schedule:>5}" == "  2bw"
    plan.schedule = "dualpipe"                   # from a newer dapple, say: kept by name
    assert plan.schedule == "dualpipe" and not plan.schedule.known
    assert json.loads(plan.to_json())["schedule"] == {"name": "dualpipe"}
    with pytest.raises(ValueError, match="schedule 'dualpipe' is not one of"):
        plan.validate()
    with pytest.raises(ScheduleError, match="unknown schedule 'dualpipe'; use one of"):
        schedules.get("dualpipe")


def test_a_version_1_plan_names_a_policy_and_loads_as_early_backward():
    d = {"version": 1, "stages": [{"layers": [0, 0], "devices": [0]},
                                  {"layers": [1, 1], "devices": [1]}],
         "micro_batches": 4, "schedule": "B", "warmup": [3, 1]}
    plan = Plan.from_dict(d).validate()
    assert plan.schedule.early_backward and plan.schedule.canonical == "1f1b"
    assert json.loads(plan.to_json())["schedule"] == {"name": "B", "warmup": [3, 1]}


def test_register_refuses_a_second_spec_of_one_name_and_parameters_plans_cannot_hold():
    gpipe_class = type(schedules.get("gpipe"))
    with pytest.raises(ValueError, match="schedule 'gpipe' is registered already"):
        schedules.register(gpipe_class())

    class Deep(gpipe_class):
        name = "deep"
        parameters = (Parameter("depth", 1, lambda value: None, "how deep"),)
    with pytest.raises(ValueError, match="takes \\['depth'\\], which plans cannot hold"):
        schedules.register(Deep())
    assert "deep" not in schedules.names()


# K_i for S = 4 stages, M = 8 micro-batches, by the papers' formulas (hand-computed).
DEPTHS = {"gpipe": [8, 8, 8, 8], "1f1b": [4, 3, 2, 1], "A": [4, 3, 2, 1], "B": [7, 5, 3, 1],
          "zb-h1": [4, 3, 2, 1], "pipedream": [4, 3, 2, 1], "2bw": [4, 3, 2, 1]}


@pytest.mark.parametrize("spec", schedules.specs(legacy=True), ids=str)
def test_declared_warmup_is_what_the_action_lists_do(spec):
    declared = spec.default_warmup(4, 8)
    assert declared == DEPTHS.get(spec.name)             # None: it fixes its own
    assert spec.takes_warmup == (declared is not None)
    if declared is not None:
        batches = 1 if spec.relaxed else None
        assert first_backward_depths(build_schedule(spec.name, 4, 8, batches=batches)) == \
            declared


def cli_choices(command):
    done = subprocess.run([sys.executable, "-m", "dapple.cli", command, "--help"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    match = re.search(r"--schedule: <([^>]*)>", done.stdout)
    assert match, done.stdout[-2000:]
    return tuple(match.group(1).split("|"))


@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_the_cli_offers_the_registry_names(command):
    assert cli_choices(command) == ("auto",) + schedules.names()
