"""The install hints name the Python that runs the package, and the checkout it runs from, if any.

An install from an index and one from a checkout are laid out in tmp folders (a `timm_layerscale` package
folder beside a pyproject.toml, or beside a dist-info with pip's direct_url.json) and passed as the package.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from timm_ls.paths import install_hint, source_checkout

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = '[build-system]\nrequires = ["setuptools"]\n\n[project]\nname = "{name}"\nversion = "0.1.0"\n'
PIP = f"{shlex.quote(sys.executable)} -m pip install"


def package_in(folder: Path) -> Path:
    package = folder / "timm_layerscale"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    return package


def checkout(folder: Path, name: str = "timm-layerscale") -> Path:
    folder.mkdir(parents=True)
    (folder / "pyproject.toml").write_text(PYPROJECT.format(name=name))
    return folder


def installed(site: Path, direct_url: dict | None = None) -> Path:
    """A package installed into `site` by pip, with the direct_url.json pip writes for a local folder."""
    package = package_in(site)
    info = site / "timm_layerscale-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: timm-layerscale\nVersion: 0.1.0\n")
    if direct_url is not None:
        (info / "direct_url.json").write_text(json.dumps(direct_url))
    return package


def test_from_an_index_it_installs_the_release_into_this_python(tmp_path):
    package = installed(tmp_path / "site-packages")
    assert source_checkout(package) is None
    assert install_hint("export", package, cwd=tmp_path) == f"{PIP} 'timm-layerscale[export]'"
    assert install_hint(None, package, cwd=tmp_path) == f"{PIP} timm-layerscale"


def test_another_projects_pyproject_beside_the_package_is_no_checkout(tmp_path):
    vendored = package_in(checkout(tmp_path / "app", name="my-app"))
    (vendored.parent / "pyproject.toml").write_text(
        PYPROJECT.format(name="my-app") + 'dependencies = ["timm-layerscale"]\n\n[tool.x]\nname = "timm-layerscale"\n'
    )
    assert install_hint("tools", vendored, cwd=tmp_path) == f"{PIP} 'timm-layerscale[tools]'"


def test_from_a_checkout_it_installs_that_checkout_editable(tmp_path):
    root = checkout(tmp_path / "my clone")
    package = package_in(root)
    assert source_checkout(package) == (root, True)
    assert install_hint("export", package, cwd=tmp_path) == f"{PIP} -e {shlex.quote(f'{root}[export]')}"
    assert install_hint("export", package, cwd=root) == f"{PIP} -e '.[export]'"


@pytest.mark.parametrize("editable", [False, True])
def test_installed_from_a_local_folder_it_names_that_folder(tmp_path, editable):
    root = checkout(tmp_path / "clone")
    package = installed(tmp_path / "site-packages", {"url": root.as_uri(), "dir_info": {"editable": editable}})
    assert source_checkout(package) == (root, editable)
    expected = f"{PIP} {'-e ' if editable else ''}'{root}[tools]'"
    assert install_hint("tools", package, cwd=tmp_path) == expected


def test_a_folder_pip_was_given_that_is_gone_or_foreign_is_no_checkout(tmp_path):
    gone = installed(tmp_path / "a", {"url": (tmp_path / "gone").as_uri(), "dir_info": {}})
    other = checkout(tmp_path / "other", name="other")
    foreign = installed(tmp_path / "b", {"url": other.as_uri(), "dir_info": {"editable": True}})
    archive = installed(tmp_path / "c", {"url": "https://example.org/t.tar.gz", "archive_info": {}})
    for package in (gone, foreign, archive):
        assert install_hint("export", package, cwd=tmp_path) == f"{PIP} 'timm-layerscale[export]'"


def test_this_repository_is_a_checkout_and_the_interpreter_is_quoted(tmp_path, monkeypatch):
    assert source_checkout(REPO / "timm_layerscale") == (REPO, True)  # the real pyproject.toml
    monkeypatch.setattr(sys, "executable", "/opt/my python/bin/python3")
    hint = install_hint("export", REPO / "timm_layerscale", cwd=REPO)
    assert hint == "'/opt/my python/bin/python3' -m pip install -e '.[export]'"


def test_the_commands_help_names_this_python(tmp_path):
    code = "from timm_ls.main import main; main(['export', '--help'])"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert " ".join(install_hint("export", cwd=tmp_path).split()) in " ".join(run.stdout.split())
