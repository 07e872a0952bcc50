"""ResNet-50 (`keras.applications.ResNet50`, random weights) for image classification.

    python -m examples.resnet50 --size=tiny --devices=2     # 32x32 images, 10 classes, CPU
    python -m examples.resnet50 --size=full --devices=8     # 224x224, 1000 classes (GPUs)

Residual connections cross stage cuts (the pipeline relays them). BatchNormalization normalizes
each micro-batch on its own in a pipeline, as in GPipe and the DAPPLE paper, so this model is NOT
micro-batch transparent: its gradients differ from the unpipelined model's when a plan has more
than one micro-batch or a replicated stage (`dapple verify` reports it). Training works; only
the bit-exact equivalence does not hold.
"""
TINY = {"image_size": 32, "classes": 10}
FULL = {"image_size": 224, "classes": 1000}
GLOBAL_BATCH = {"tiny": 8, "full": 256}


def build(image_size=224, classes=1000):
    import keras
    return keras.applications.ResNet50(weights=None, input_shape=(image_size, image_size, 3),
                                       classes=classes, classifier_activation=None)


if __name__ == "__main__":
    from examples.run import main_for
    main_for("resnet50")
