"""fairseq-normplug: normalization choices of "Transformers without Tears" and
"Transformers without Normalization" as a fairseq user-dir plugin."""
import os
import runpy

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))
# versions and requirements live in one file, shared with scripts/setup_env.sh
PLAN = runpy.run_path(os.path.join(HERE, "fairseq_normplug", "install_plan.py"))

setup(
    name="fairseq-normplug",
    version="0.1.0",
    description=(
        "fairseq plugin: PreNorm/PostNorm, ScaleNorm, RMSNorm, DyT, FixNorm, SmallInit "
        "and the learning-rate schedules of Transformers without Tears"
    ),
    long_description=open(os.path.join(HERE, "README.md"), encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="MIT",
    python_requires=">=3.8",
    packages=find_packages(include=["fairseq_normplug", "fairseq_normplug.*"]),
    include_package_data=True,
    # the C++ source of the native CPU norm operators, compiled on first use
    package_data={"fairseq_normplug.modules": ["csrc/*.cpp"]},
    # torch: a floor only, so an installed torch (CPU or CUDA build) is kept;
    # scripts/setup_env.sh chooses the build. fairseq is NOT listed: its metadata requires
    # torchaudio, which would replace torch; it is built with --no-deps (setup_env.sh, or the
    # command the plugin names when fairseq is missing), and its runtime requirements are here.
    install_requires=[f"torch>={PLAN['MIN_TORCH']}", *PLAN["RUNTIME_REQUIREMENTS"]],
    extras_require={"test": ["pytest>=7"]},
    entry_points={
        "console_scripts": [
            "fairseq-normplug-path=fairseq_normplug.cli:print_user_dir",
        ]
    },
)
