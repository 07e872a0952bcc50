"""The pipeline step whose units read working copies of their stage's weights on their own
device, where the weights live on another, refreshed at the start of every step
(`graph_rewrite.working_copies`).

Without copies a unit's every call reads each weight from the variable's device: once per
micro-batch unrolled, and in a pipeline loop once per iteration in the forward and again in the
backward (the split backward reads the kernels itself), each a transfer between devices. With
copies each weight crosses once a step. The local runtime uses it for looped pipelines (Keras
makes every variable on the default device, so every stage but the first reads across
devices); the TensorFlow-cluster runtime for every step (its weights live on the chief).
"""
from __future__ import annotations

import tensorflow as tf

from graph_rewrite.pipeline import PipelineStep


class CopyingStep(PipelineStep):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for s, r in self.transport.local_units():
            self.functions[s].copies.make(self.device(s, r))

    @tf.autograph.experimental.do_not_convert
    def run(self, *args, **kwargs):
        for function in self.functions:
            function.copies.refresh()
        return super().run(*args, **kwargs)
