"""dapple: synchronous pipeline + data parallel training for TensorFlow/Keras (after DAPPLE).

Planner-only users:  pip install .            (topology + planner + CLI; numpy, no TensorFlow)
Training users:      pip install .[tf]        (adds TensorFlow 2.15.1 CPU; Horovod is built
                                               separately, see scripts/setup_env.sh)
"""
from setuptools import setup

setup(
    name="dapple",
    version="0.1.0",
    description="Planner, graph rewriter and runtime for synchronous pipeline + data parallel "
                "training of Keras models (after the DAPPLE paper)",
    python_requires=">=3.9",
    packages=["topology", "planner", "reports", "graph_rewrite", "dapple", "examples"],
    install_requires=["absl-py", "numpy<2"],   # numpy: the planner's PipeDream DP
    extras_require={
        "tf": ["tensorflow-cpu==2.15.1", "numpy<2"],
        "gpu": ["tensorflow[and-cuda]==2.15.1", "numpy<2"],
        "report": ["matplotlib<3.10"],
        "test": ["pytest", "pytest-timeout"],
    },
    entry_points={"console_scripts": ["dapple=dapple.cli:run"]},
)
