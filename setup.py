"""What pyproject.toml cannot say: the Gradio app's top-level folder ``webui/`` (DESIGN.md's layout) installs as
the package ``chattts_velocity.webui`` (a bare top-level ``webui`` would clash with other distributions). A
``packages.find`` table in pyproject.toml cannot add a package that lives outside its parent's folder, so the
package list is made here (the same discovery as pyproject.toml's `find`); the rest stays there."""

from setuptools import find_namespace_packages, setup

setup(
    packages=[*find_namespace_packages(include=["chattts_velocity*"]), "chattts_velocity.webui"],
    package_dir={"chattts_velocity.webui": "webui"},
)
