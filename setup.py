"""fairseq-normplug: normalization choices of "Transformers without Tears" and
"Transformers without Normalization" as a fairseq user-dir plugin."""
from setuptools import find_packages, setup

setup(
    name="fairseq-normplug",
    version="0.1.0",
    description=(
        "fairseq plugin: PreNorm/PostNorm, ScaleNorm, RMSNorm, DyT, FixNorm, SmallInit "
        "and the learning-rate schedules of Transformers without Tears"
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="MIT",
    python_requires=">=3.8",
    packages=find_packages(include=["fairseq_normplug", "fairseq_normplug.*"]),
    include_package_data=True,
    # the C++ source of the native CPU norm operators, compiled on first use
    package_data={"fairseq_normplug.modules": ["csrc/*.cpp"]},
    install_requires=[
        # torch is deliberately unpinned here: scripts/setup_env.sh installs the CPU
        # build torch==2.13.0 first (or $NORMPLUG_TORCH_SPEC) so this never pulls CUDA.
        "torch>=1.13",
        "fairseq-fixed==0.12.3.1; python_version >= '3.11'",
        "fairseq==0.12.2; python_version < '3.11'",
        "sacrebleu>=2.0",
        "sentencepiece",
        "subword-nmt",
        "sacremoses",
        "matplotlib",
        "tqdm",
    ],
    extras_require={"test": ["pytest>=7"]},
    entry_points={
        "console_scripts": [
            "fairseq-normplug-path=fairseq_normplug.cli:print_user_dir",
        ]
    },
)
