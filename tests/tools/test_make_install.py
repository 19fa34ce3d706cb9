"""`make install`, an upgrade over it and `make uninstall`, every path moved into a temporary folder by the
Makefile's own variables (PREFIX, SYSCONFDIR, UNITDIR, SYSUSERSDIR, INSTALL_VENV, CACHEDIR), from a wheel
built from this checkout and handed over as WHEELHOUSE (so pip installs with --no-index: no network).

What stays outside the temporary folder, as on a host: the runtime's set-up (`scripts/setup.sh --runtime`:
it only checks here, everything is installed), and systemd-sysusers making the user metaroce and the group
metaroce-users.  Two things prepared beforehand, for the test's sake: the install venv exists already with
the [daemon] extra's modules on a .pth line from the project venv (pip sees them installed and fetches
nothing; test_wheel_install.py says why a path line keeps the checkout's editable install out), and numba's
cache for the installed files is the checkout's, copied (so the install's warm-up loads, not compiles:
6 minutes on 2 CPUs otherwise).  Not here: the service restart of an upgrade (`systemctl restart` when
metaroced is active; PID 1 is not systemd on these machines)."""
from __future__ import annotations

import grp
import os
import pwd
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from test_wheel_install import PY, ROOT, _numba_cache_for, _run, _site

pytestmark = pytest.mark.root


@pytest.fixture(scope="module")
def layout(tmp_path_factory) -> dict:
    t = tmp_path_factory.mktemp("inst")
    house = t / "house"
    house.mkdir()
    r = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", house,
              ROOT], cwd=str(house))
    assert r.returncode == 0, r.stderr[-3000:]
    venv = t / "opt"
    assert _run([PY, "-m", "venv", "--system-site-packages", venv]).returncode == 0
    (_site(venv) / "zz_test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    v = {"PREFIX": t / "usr", "SYSCONFDIR": t / "etc", "UNITDIR": t / "unit", "SYSUSERSDIR": t / "sysusers",
         "INSTALL_VENV": venv, "CACHEDIR": t / "cache", "WHEELHOUSE": house}
    _numba_cache_for(t / "cache" / "numba")
    return {k: str(p) for k, p in v.items()}


def _make(target: str, layout: dict, **more) -> subprocess.CompletedProcess:
    args = [f"{k}={v}" for k, v in {**layout, **more}.items()]
    return _run(["make", "--no-print-directory", "-C", ROOT, target, *args], timeout=900)


def test_install_upgrade_and_uninstall(layout):
    from metaroce_xdp import __version__
    from metaroce_xdp.version import git_revision
    if os.geteuid() != 0:
        pytest.skip("needs root (make install)")
    r = _make("install", layout)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    out = r.stdout
    assert "ok: the runtime's packages, kernel headers and bpffs" in out, out            # setup.sh --runtime
    assert f"installed metaroced {__version__} (revision {git_revision(ROOT)})" in out, out
    assert re.search(r"metaroce warmup: 0 of \d+ entry points compiled", out), out      # the warm cache, loaded
    binp, venv = Path(layout["PREFIX"]) / "bin", Path(layout["INSTALL_VENV"])
    for cmd in ("metaroced", "metaroce"):
        assert os.readlink(binp / cmd) == str(venv / "bin" / cmd)
    v = _run([binp / "metaroce", "--version"], cwd="/")
    assert v.stdout.strip() == f"metaroce {__version__} (revision {git_revision(ROOT)})", v.stdout + v.stderr
    pkg = _run([venv / "bin" / "python", "-c", "import metaroce_xdp; print(metaroce_xdp.__file__)"], cwd="/").stdout
    assert pkg.startswith(str(_site(venv))), pkg                                          # the wheel, not a copy
    assert not (venv / "src").exists()
    unit = (Path(layout["UNITDIR"]) / "metaroced.service").read_text()
    assert f"ExecStart={binp}/metaroced --config {layout['SYSCONFDIR']}/metaroce/metaroced.toml" in unit
    assert f"NUMBA_CACHE_DIR={layout['CACHEDIR']}/numba" in unit
    conf = Path(layout["SYSCONFDIR"]) / "metaroce" / "metaroced.toml"
    assert re.search(r'^socket_group = "metaroce-users"', conf.read_text(), re.M)
    grp.getgrnam("metaroce-users")
    user = pwd.getpwnam("metaroce")
    assert os.stat(Path(layout["CACHEDIR"]) / "numba").st_uid == user.pw_uid
    # the installed configuration is valid as it stands (its group exists)
    pc = _run([binp / "metaroced", "--config", conf, "--print-config"], cwd="/")
    assert pc.returncode == 0 and 'socket_group = "metaroce-users"' in pc.stdout, pc.stdout + pc.stderr

    # an upgrade: a module the old version had and the new one has not must go; the configuration stays
    site = _site(venv)
    stale = site / "metaroce_xdp" / "removed_in_this_version.py"
    stale.write_text("x = 1\n")
    record = next(site.glob("metaroce_xdp-*.dist-info")) / "RECORD"
    with open(record, "a") as f:
        f.write("metaroce_xdp/removed_in_this_version.py,,\n")
    conf.write_text(conf.read_text() + "# an operator's edit\n")
    r = _make("install", layout)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert f"(was {__version__})" in r.stdout and "keeping the existing" in r.stdout, r.stdout
    assert not stale.exists()
    assert conf.read_text().endswith("# an operator's edit\n")

    # uninstall: everything but the configuration
    r = _make("uninstall", layout)
    assert r.returncode == 0, r.stdout + r.stderr
    for p in (venv, Path(layout["CACHEDIR"]), binp / "metaroced", binp / "metaroce",
              Path(layout["UNITDIR"]) / "metaroced.service", Path(layout["SYSUSERSDIR"]) / "metaroce.conf"):
        assert not os.path.lexists(p), p
    assert conf.exists() and "PURGE=1" in r.stdout


def test_staged_install_and_purge(tmp_path):
    """DESTDIR stages the unit, the users file and the configuration (no venv); uninstall PURGE=1 there
    removes them, the configuration too."""
    stage = tmp_path / "stage"
    r = _run(["make", "--no-print-directory", "-C", ROOT, "install", f"DESTDIR={stage}"], timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    for p in ("etc/systemd/system/metaroced.service", "usr/lib/sysusers.d/metaroce.conf",
              "etc/metaroce/metaroced.toml"):
        assert (stage / p).is_file(), p
    assert "g metaroce-users" in (stage / "usr/lib/sysusers.d/metaroce.conf").read_text()
    assert not (stage / "opt").exists()
    r = _run(["make", "--no-print-directory", "-C", ROOT, "uninstall", f"DESTDIR={stage}", "PURGE=1"], timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not (stage / "etc/metaroce").exists() and not (stage / "etc/systemd/system/metaroced.service").exists()
