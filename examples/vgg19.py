"""VGG-19 (`keras.applications.VGG19`, random weights) for image classification.

    python -m examples.vgg19 --size=tiny --devices=2        # 32x32 images, 10 classes, CPU
    python -m examples.vgg19 --size=full --devices=8        # 224x224, 1000 classes (GPUs)

Its 16 convolutions hold few weights and large activations, its three dense layers the opposite
(the paper's §VI-C: the planner cuts it before the dense layers and replicates the convolutions).
"""
TINY = {"image_size": 32, "classes": 10}
FULL = {"image_size": 224, "classes": 1000}
GLOBAL_BATCH = {"tiny": 8, "full": 256}


def build(image_size=224, classes=1000):
    import keras
    return keras.applications.VGG19(weights=None, input_shape=(image_size, image_size, 3),
                                    classes=classes, classifier_activation=None)


if __name__ == "__main__":
    from examples.run import main_for
    main_for("vgg19")
