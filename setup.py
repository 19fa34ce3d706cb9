"""Build hook only (the project's metadata is in pyproject.toml): a wheel records the git revision it was
built from in metaroce_xdp/_revision.txt, which `--version` prints (metaroce_xdp/version.py)."""
import importlib.util
import os

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


def _version_module():
    spec = importlib.util.spec_from_file_location("_metaroce_version", os.path.join(HERE, "metaroce_xdp", "version.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class BuildPyWithRevision(build_py):
    def run(self):
        super().run()
        version = _version_module()
        rev = version.git_revision(HERE)
        if rev is None:                              # an sdist's tree: keep the stamp it carries, if any
            src = os.path.join(HERE, "metaroce_xdp", version.STAMP)
            rev = open(src).read().strip() if os.path.isfile(src) else "unknown"
        out = os.path.join(self.build_lib, "metaroce_xdp", version.STAMP)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w") as f:
            f.write(rev + "\n")


setup(cmdclass={"build_py": BuildPyWithRevision})
