"""The kernel sources ship inside the wheel and an installed copy finds them.

Builds a wheel from this checkout into a temporary folder, installs it with ``pip install
--target`` and, in a subprocess whose working directory is outside the repository and whose
``PYTHONPATH`` is the target only, asks the installed ``cupyflash.core.jit.kernels_dir()`` where the
sources are. Also checks the source-checkout path.
"""
import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _can_build_offline() -> bool:
    """setuptools >= 64 and wheel importable: build without an isolated (networked) env."""
    if importlib.util.find_spec("setuptools") is None or importlib.util.find_spec("wheel") is None:
        return False
    import setuptools
    return int(setuptools.__version__.split(".")[0]) >= 64


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """Build from a copy of the packaged files, so the checkout gets no build/ or egg-info."""
    src = tmp_path_factory.mktemp("src")
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        if (REPO / name).is_file():
            shutil.copy2(REPO / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in ("cupyflash", "kernels_cu"):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    out = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir", "-q",
           "-w", str(out), str(src)]
    if _can_build_offline():
        cmd.insert(4, "--no-build-isolation")
    subprocess.run(cmd, check=True, cwd=out)
    wheels = list(out.glob("cupyflash-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.mark.slow
def test_wheel_contains_kernel_sources(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "cupyflash/kernels_cu/common/params.cuh" in names
    assert {"cupyflash/core/jit.py", "cupyflash/forward/kernels.py", "cupyflash/decode/plan.py",
            "cupyflash/backward/run.py"} <= names
    src = {p.relative_to(REPO).as_posix() for p in (REPO / "kernels_cu").rglob("*.cu*")}
    shipped = {n.replace("cupyflash/", "", 1) for n in names
               if n.startswith("cupyflash/kernels_cu/")}
    assert src <= shipped, f"missing from the wheel: {sorted(src - shipped)}"


@pytest.mark.slow
def test_installed_wheel_finds_kernel_sources(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-cache-dir", "-q",
                    "--target", str(target), str(wheel)], check=True, cwd=tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CUPYFLASH_KERNELS_DIR")}
    env["PYTHONPATH"] = str(target)
    code = ("import cupyflash, cupyflash.core.jit as j; d = j.kernels_dir(); "
            "print(cupyflash.__file__); print(d); print((d / 'common' / 'params.cuh').is_file())")
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, check=True,
                         capture_output=True, text=True)
    pkg_file, kdir, found = run.stdout.split()
    assert Path(pkg_file).resolve().is_relative_to(target.resolve()), pkg_file
    assert Path(kdir).resolve() == (target / "cupyflash" / "kernels_cu").resolve(), kdir
    assert found == "True"


def test_source_checkout_finds_kernel_sources():
    env = {k: v for k, v in os.environ.items() if k != "CUPYFLASH_KERNELS_DIR"}
    env["PYTHONPATH"] = str(REPO)
    code = "import cupyflash.core.jit as j; print(j.kernels_dir())"
    run = subprocess.run([sys.executable, "-c", code],
                         cwd=REPO, env=env, check=True, capture_output=True, text=True)
    kdir = Path(run.stdout.strip())
    assert kdir.resolve() == (REPO / "kernels_cu").resolve()
    assert (kdir / "common" / "params.cuh").is_file()


def test_installed_cupyflash_finds_kernel_sources(tmp_path):
    """Whatever is installed in this environment (``pip install -e .`` in ``.ci/run`` and the
    README: an editable install) finds the sources from a working directory outside the
    checkout, with no PYTHONPATH. Skipped where cupyflash is not installed at all."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CUPYFLASH_KERNELS_DIR")}
    probe = subprocess.run([sys.executable, "-c", "import cupyflash"], cwd=tmp_path, env=env,
                           capture_output=True)
    if probe.returncode != 0:
        pytest.skip("cupyflash is not installed in this environment (source checkout only)")
    code = ("import cupyflash, cupyflash.core.jit as j; d = j.kernels_dir(); "
            "print(cupyflash.__file__); print(d); print((d / 'common' / 'params.cuh').is_file())")
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, check=True,
                         capture_output=True, text=True)
    pkg_file, kdir, found = run.stdout.split()
    assert found == "True", (pkg_file, kdir)
