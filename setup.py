"""torch_moe: Mixture-of-Experts layers and ops for PyTorch."""

from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent


def _requirements(name: str) -> list[str]:
    lines = (HERE / name).read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith(("#", "-"))]


# examples/train_moe_lm.py: progress bar and plots
EXAMPLES = ["tqdm>=4.60", "matplotlib>=3.7"]

setup(
    name="torch_moe",
    version="0.1.0",
    description="Mixture-of-Experts layers, ops and kernels for PyTorch",
    long_description=(HERE / "README.md").read_text(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["torch_moe", "torch_moe.*"]),
    # tile configs of the fused decode kernels, per GPU (benchmarks/tune_moe_decode.py)
    package_data={
        "torch_moe._triton": ["moe_decode_configs.json"],
        # the native CPU kernels' sources, compiled on first use (torch_moe/_ops/_native.py)
        "torch_moe": ["csrc/*.cpp", "csrc/*.h"],
    },
    python_requires=">=3.10",
    install_requires=["torch>=2.11", "triton>=3.6"],
    extras_require={
        "test": [
            "pytest>=8",
            "pytest-xdist>=3.5",  # the README's test command runs two workers
            "hypothesis>=6.100",
            "expecttest>=0.2",
            "mutmut==3.8.1",  # benchmarks/run_mutation.sh (not run in CI)
            "numpy",
            "transformers==5.23.0",
            *EXAMPLES,
        ],
        "examples": EXAMPLES,
        "lint": _requirements("requirements-lint.txt"),
    },
    license="BSD-3-Clause",
)
