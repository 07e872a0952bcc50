"""The Plan: JSON round trip, validation messages, atomic save. No TensorFlow."""
import json
import os

import pytest

from planner.formats.plan import Plan, PlanError, straight_plan


def test_json_round_trip_keeps_everything():
    plan = straight_plan([3], 6, 4, 64, replicas=[2, 1], schedule="B")
    plan.stages[0].layer_names = ["a", "b", "c"]
    text = plan.to_json()
    data = json.loads(text)
    assert data["version"] == 2
    assert data["schedule"] == {"name": "B"}
    assert data["stages"][0] == {"layers": [0, 2], "devices": [0, 1], "layer_names": ["a", "b", "c"]}
    assert Plan.from_json(text) == plan


def test_the_schedule_is_an_object_with_its_parameters():
    plan = straight_plan([3], 6, 4, 64, schedule="A")
    plan.warmup = [2, 1]
    assert json.loads(plan.to_json())["schedule"] == {"name": "A", "warmup": [2, 1]}
    assert Plan.from_json(plan.to_json()) == plan


def test_transfers_are_written_only_when_planned_for_horovodrun():
    plan = straight_plan([3], 6, 4, 64)
    assert plan.transfers == "async" and "transfers" not in plan.to_dict()
    plan.transfers = "horovod"
    assert json.loads(plan.to_json())["transfers"] == "horovod"
    assert Plan.from_json(plan.to_json()) == plan


def test_version_1_plans_still_load():
    # A version 1 file, as dapple wrote it before the schedule became an object.
    v1 = {"version": 1, "stages": [{"layers": [0, 2], "devices": [0]},
                                   {"layers": [3, 5], "devices": [1]}],
          "micro_batches": 4, "global_batch_size": 64, "schedule": "B", "warmup": [3, 1]}
    plan = Plan.from_dict(v1).validate(num_layers=6)
    assert (plan.schedule, plan.warmup, plan.version) == ("B", [3, 1], 2)
    assert json.loads(plan.to_json())["schedule"] == {"name": "B", "warmup": [3, 1]}


def test_shapes_in_the_papers_notation():
    assert straight_plan([], 4, 2, 16, replicas=[8]).shape() == "DP"
    assert straight_plan([2], 4, 2, 8).shape() == "straight"
    assert straight_plan([2], 4, 2, 32, replicas=[8, 8]).shape() == "8:8"


@pytest.mark.parametrize("edit,message", [
    (lambda d: d["stages"][1].update(devices=[0]), "device 0 is used by stage 0 and stage 1"),
    (lambda d: d["stages"][1].update(layers=[4, 5]), "leaves out layers 3..3"),
    (lambda d: d["stages"][1].update(layers=[2, 5]), "repeats layers 2..2"),
    (lambda d: d.update(micro_batches=0), "micro_batches must be >= 1"),
    (lambda d: d.update(schedule={"name": "zigzag"}), "schedule 'zigzag'"),
    (lambda d: d.update(schedule="A"), "must be an object with a name and parameters"),
    (lambda d: d.update(schedule={"name": "A", "depth": 3}), r"unknown parameter\(s\) \['depth'\]"),
    (lambda d: d.update(warmup=[2, 1]), "'warmup' belongs inside the schedule object"),
    (lambda d: d.update(global_batch_size=30), "does not divide into 4 equal micro-batches"),
    (lambda d: d.update(global_batch_size=4), "stage 0 has 2 replicas but a micro-batch has only 1"),
    (lambda d: d.pop("version"), "no 'version'"),
    (lambda d: d.update(version=99), "version 99 is not supported"),
    (lambda d: d.update(colour="red"), "unknown field"),
    (lambda d: d.update(transfers="mpi"), "'transfers' must be one of .* got 'mpi'"),
])
def test_hand_edited_plan_errors_name_the_problem(edit, message):
    data = straight_plan([3], 6, 4, 64, replicas=[2, 1]).to_dict()
    edit(data)
    with pytest.raises(PlanError, match=message):
        Plan.from_dict(data).validate(num_layers=6)


def test_plan_must_cover_the_model():
    plan = straight_plan([3], 6, 2, 8)
    with pytest.raises(PlanError, match="has 7 layers"):
        plan.validate(num_layers=7)


def test_save_is_atomic_and_loads_back(tmp_path):
    path = tmp_path / "plan.json"
    plan = straight_plan([1], 2, 2, 8)
    plan.save(str(path))
    assert Plan.load(str(path)) == plan
    assert [p for p in os.listdir(tmp_path) if p.startswith(".plan-")] == []


def test_load_names_the_file(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(PlanError, match="broken.json: plan is not valid JSON"):
        Plan.load(str(path))


def interleaved_dict(devices=((0, 1), (2, 3)), v=2, chunks=None):
    """A hand-written interleaved plan: 2 device groups of 2, 4 chunks of 2 layers, chunk c on
    the devices of chunk c % 2."""
    chunks = chunks if chunks is not None else [list(devices[c % 2]) for c in range(2 * v)]
    return {"version": 2, "micro_batches": 4, "global_batch_size": 32,
            "schedule": {"name": "interleaved", "virtual_stages": v},
            "stages": [{"layers": [2 * c, 2 * c + 1], "devices": d} for c, d in enumerate(chunks)]}


def test_interleaved_plans_list_their_chunks_and_say_how_many_per_device():
    plan = Plan.from_dict(interleaved_dict()).validate(num_layers=8, num_devices=4)
    assert (plan.schedule, plan.virtual_stages) == ("interleaved", 2)
    assert (plan.num_stages, plan.num_positions, plan.num_devices) == (4, 2, 4)
    assert plan.shape() == "2:2"
    assert json.loads(plan.to_json())["schedule"] == {"name": "interleaved", "virtual_stages": 2}
    assert Plan.from_json(plan.to_json()) == plan
    # Chunk forwards before the first backward per group (Megatron: 2(S-s-1) + (v-1)S, + 1).
    assert plan.warmup_depths() == [5, 3]


def test_every_schedule_name_round_trips_and_old_names_still_load():
    for name in ("gpipe", "1f1b", "zb-h1", "A", "B"):
        plan = straight_plan([3], 6, 4, 64, schedule=name)
        assert Plan.from_json(plan.to_json()).schedule == name
    assert straight_plan([3], 6, 4, 64).schedule == "1f1b"
    assert straight_plan([3], 6, 4, 64, schedule="zb-h1").warmup_depths() == [2, 1]


@pytest.mark.parametrize("edit,message", [
    (lambda d: d["schedule"].pop("virtual_stages"), "needs virtual_stages"),
    (lambda d: d["schedule"].update(virtual_stages=3), "lists S x 3 chunks"),
    (lambda d: d["stages"][3].update(devices=[2]), "chunk 3 has 1 replica"),
    (lambda d: d["stages"][2].update(devices=[1, 0]), r"give chunk 2 the devices \[0, 1\]"),
    (lambda d: d["stages"][2].update(devices=[2, 3]), "chunk 2 runs on devices"),
    (lambda d: d["schedule"].update(name="zb-h1"), "virtual_stages = 2 needs schedule"),
    (lambda d: d["schedule"].update(name="1f1b"), "virtual_stages = 2 needs schedule"),
    (lambda d: d["schedule"].update(warmup=[2, 1]), "fixes its own warm-up"),
])
def test_interleaved_plan_errors_name_the_problem(edit, message):
    data = interleaved_dict()
    edit(data)
    with pytest.raises(PlanError, match=message):
        Plan.from_dict(data).validate(num_layers=8)


def test_a_zb_h1_plan_takes_the_warmup_of_early_backward():
    plan = straight_plan([3], 6, 4, 64, schedule="zb-h1")
    plan.warmup = [3, 1]
    assert json.loads(plan.to_json())["schedule"] == {"name": "zb-h1", "warmup": [3, 1]}
    assert Plan.from_json(plan.to_json()).warmup_depths() == [3, 1]
