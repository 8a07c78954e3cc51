from pathlib import Path

from setuptools import find_packages, setup


def requirements(name: str) -> list[str]:
    lines = Path(__file__).with_name("requirements").joinpath(name).read_text().splitlines()
    return [line.split("#")[0].strip() for line in lines if line.split("#")[0].strip()]


setup(
    name="meshboost",
    version="0.1.0",
    description="Hybrid data x pipeline x tensor parallel training for unmodified HuggingFace models",
    long_description=Path(__file__).with_name("README.md").read_text() if Path("README.md").exists() else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["meshboost", "meshboost.*"]),
    python_requires=">=3.10",
    install_requires=requirements("requirements.txt"),
    # lora: booster.enable_lora; fp8: float8 training (Float8Config / use_fp8=True, torchao's float8 linears)
    extras_require={"lora": ["peft>=0.13"], "fp8": ["torchao>=0.10"]},
    license="Apache-2.0",
)
