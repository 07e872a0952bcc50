"""`dapple demo`: the whole flow on this machine, in about a minute.

profile a small Keras CNN on the local CPU -> plan it for N local logical devices -> print the
strategy report -> train a pipelined plan for a few steps, printing the loss of every step.
Everything it writes goes to --output_dir (profile.json, plan.json, report.md, weights).
"""
import os

from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_integer("devices", 2, "local logical devices to plan for and train on")
flags.DEFINE_integer("global_batch_size", 64, "samples per optimizer step")
flags.DEFINE_integer("steps", 10, "training steps")
flags.DEFINE_string("output_dir", "out/demo", "where the profile, plan, report and weights go")


def main(argv):
    del argv
    import dapple  # configures logical devices (DAPPLE_NUM_CPU_DEVICES) before TF initializes
    import keras

    from dapple import demo_model
    from planner.formats.profile_readers import load_profile
    from reports.text_report import strategy_report
    from planner.search.baselines import best_straight_plan
    from planner.search.plan_space import plan_dapple
    from topology import local_topology

    os.makedirs(FLAGS.output_dir, exist_ok=True)
    gbs = FLAGS.global_batch_size
    model = demo_model.build()
    x, y = demo_model.synthetic_data(gbs * 2)   # two batches, cycled: the loss visibly falls

    print(f"== 1. profile {model.name} ({len(model.layers) - 1} layers) at batch {gbs} on this CPU")
    profile_path = os.path.join(FLAGS.output_dir, "profile.json")
    dapple.profile(model, x[:gbs], y[:gbs], output=profile_path)
    profile = load_profile(profile_path)
    for i, layer in enumerate(profile.layers):
        print(f"   {i:2d} {layer.name:<10} fwd {layer.forward_ms:7.3f} ms  bwd {layer.backward_ms:7.3f} ms")

    print(f"\n== 2. plan for {FLAGS.devices} local logical devices")
    topology = local_topology(FLAGS.devices)
    best = plan_dapple(profile, topology, gbs)
    report = strategy_report(best, profile, topology)
    with open(os.path.join(FLAGS.output_dir, "report.md"), "w") as f:
        f.write(report)
    print(report)
    plan = best
    if best.num_stages < 2:
        plan = best_straight_plan(profile, topology, gbs)
        print(f"The planner prefers {best.shape()} here ({best.estimate.latency_ms:.2f} ms); to "
              f"show pipelining the demo trains the best straight pipeline instead "
              f"({plan.estimate.latency_ms:.2f} ms estimated).")
    plan_path = os.path.join(FLAGS.output_dir, "plan.json")
    plan.save(plan_path)
    print(f"\nplan ({plan.shape()}, {plan.micro_batches} micro-batches, schedule "
          f"{plan.schedule}, warm-up K = {plan.warmup_depths()}) written to {plan_path}:")
    for i, stage in enumerate(plan.stages):
        print(f"   stage {i}: layers {stage.first}-{stage.last} ({stage.layer_names[0]} .. "
              f"{stage.layer_names[-1]}) on devices {stage.devices}")

    print(f"\n== 3. train {plan.num_stages} stages x {plan.micro_batches} micro-batches "
          f"({plan.schedule} schedule) for {FLAGS.steps} steps")
    pm = dapple.PipelinedModel(model, plan_path)
    pm.compile(optimizer=keras.optimizers.Adam(3e-3),
               loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
               metrics=["accuracy"])

    losses = []
    for step in range(FLAGS.steps):
        batch = slice((step % 2) * gbs, (step % 2 + 1) * gbs)
        losses.append(float(pm.train_step(x[batch], y[batch])))
        print(f"   step {step + 1}: loss {losses[-1]:.4f}")
    weights = os.path.join(FLAGS.output_dir, "demo.weights.h5")
    pm.save_weights(weights)
    print(f"\ntrained {FLAGS.steps} steps: loss {losses[0]:.4f} -> {losses[-1]:.4f}; "
          f"weights in {weights}")
