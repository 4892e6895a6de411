"""Generates the gRPC stubs from ../../protos whenever the package is built (wheel or editable)."""

import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


class BuildWithStubs(build_py):
    def run(self) -> None:
        subprocess.run([sys.executable, str(HERE / "gen_protos.py")], check=True)
        super().run()


setup(cmdclass={"build_py": BuildWithStubs})
