"""The package's metadata agrees with itself: one version, the license, the typing marker.

(That the sdist and the wheel build, install into a fresh environment and run the demo is
checked by .ci/run, which needs the network for the build's own dependencies.)
"""
import importlib.metadata
import pathlib
import re
import subprocess
import sys

import pytest

import synk

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_version_is_the_installed_distributions():
    assert synk.__version__ == importlib.metadata.version("synk")
    from synk import __version__

    assert __version__ == synk.__version__


def test_version_is_written_in_pyproject_only():
    """No second copy of the version string in the package's code."""
    version = importlib.metadata.version("synk")
    copies = [str(p.relative_to(ROOT)) for p in (ROOT / "synk").rglob("*.py")
              if re.search(rf"""["']{re.escape(version)}["']""", p.read_text())]
    assert not copies, f"the version {version} is hard-coded in {copies}"


def test_version_of_a_source_tree_that_was_never_installed():
    script = (
        "import importlib.metadata as m\n"
        "def missing(name):\n"
        "    raise m.PackageNotFoundError(name)\n"
        "m.version = missing\n"
        "import synk\n"
        "print(synk.__version__)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "0+unknown"


def test_unknown_attributes_still_raise():
    with pytest.raises(AttributeError, match="no_such_name"):
        synk.no_such_name


def test_license_file_matches_the_metadata():
    meta = importlib.metadata.metadata("synk")
    assert meta["License-Expression"] == "MIT"
    assert "LICENSE" in meta.get_all("License-File")
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License\n") and "the synk authors" in text


def test_python_classifiers_start_at_requires_python():
    meta = importlib.metadata.metadata("synk")
    versions = sorted(
        tuple(map(int, c.rsplit(":: ", 1)[1].split(".")))
        for c in meta.get_all("Classifier")
        if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)
    )
    assert versions, "no Python version classifiers"
    assert meta["Requires-Python"] == ">={}.{}".format(*versions[0])
    assert versions == [(3, minor) for minor in range(versions[0][1], versions[-1][1] + 1)]


def test_package_is_marked_typed():
    assert (ROOT / "synk" / "py.typed").is_file()
