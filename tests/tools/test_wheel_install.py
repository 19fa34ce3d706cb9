"""The wheel, as an operator installs it (issue 22): `pip wheel .` builds one wheel that holds the package
with its commands, the BPF sources and the specification, and neither tools/ nor daemon/; installed into
a fresh venv outside the checkout it runs metaroced, `metaroce perf` through it, `metaroce qp list`, and an
application (docs/examples/rdma_write.py) on the installed client library.  An install of the package
alone -- the [client] extra: numpy only -- serves applications and says what its commands lack.

No network: the wheel is built without build isolation (the project venv's setuptools), installed with
--no-index --no-deps, and the dependencies of the [daemon] extra come from the project venv's
site-packages through a .pth line added after the install (a path line: that directory's own .pth files,
the checkout's editable install among them, are not processed, so `metaroce_xdp` is the installed one --
each test checks where it was imported from).  numba's cache: the checkout's, copied to where numba looks
for the installed files (the entries are valid for both: jitcache's stamp is the sources' content)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import pytest

import daemon_procs

ROOT = Path(__file__).resolve().parents[2]
PY = "/usr/bin/python3"
EXAMPLE = ROOT / "docs" / "examples" / "rdma_write.py"


def _run(cmd, **kw):
    kw.setdefault("timeout", 180)
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)


def _nsrun(topo, ns: str, argv: list[str], env: dict, cwd: Path, timeout: float = 120):
    p = topo.popen(ns, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=str(cwd))
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        daemon_procs.reap(p)
        raise
    return subprocess.CompletedProcess(argv, p.returncode, out, err)


def _site(env: Path) -> Path:
    return Path(_run([env / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
                     ).stdout.strip())


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    r = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", out,
              ROOT], cwd=str(out))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    wheels = list(out.glob("metaroce_xdp-*.whl"))
    assert len(wheels) == 1, list(out.iterdir())
    return wheels[0]


def _install(tmp: Path, wheel: Path, extra_paths: list[str]) -> Path:
    """A venv from Debian's python (system site packages: BCC), the wheel installed without the network, then
    `extra_paths` appended to its sys.path (a .pth of plain path lines)."""
    env = tmp / "env"
    r = _run([PY, "-m", "venv", "--system-site-packages", env])
    assert r.returncode == 0, r.stderr
    r = _run([env / "bin" / "python", "-m", "pip", "install", "-q", "--no-index", "--no-deps", wheel], cwd=str(tmp))
    assert r.returncode == 0, r.stdout + r.stderr
    if extra_paths:
        (_site(env) / "zz_test_dependencies.pth").write_text("".join(p + "\n" for p in extra_paths))
    return env


@pytest.fixture(scope="module")
def full_install(tmp_path_factory, wheel) -> Path:
    """The wheel in a venv outside the checkout, the [daemon] extra's modules from the project venv."""
    tmp = tmp_path_factory.mktemp("full")
    return _install(tmp, wheel, [sysconfig.get_paths()["purelib"]])


def test_the_wheel_holds_the_package_its_commands_bpf_and_spec_not_the_development_folders(wheel):
    from metaroce_xdp.version import __version__, git_revision
    z = zipfile.ZipFile(wheel)
    names = z.namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"metaroce_xdp", f"metaroce_xdp-{__version__}.dist-info"}, tops      # no tools/, no daemon/
    for f in ("metaroce_xdp.c", "metaroce_maps.h", "fault_inject.c", "fabric_impair.c", "parsing_helpers.h"):
        assert f"metaroce_xdp/bpf/{f}" in names
        assert z.read(f"metaroce_xdp/bpf/{f}") == (ROOT / "bpf" / f).read_bytes()
    assert "metaroce_xdp/conformance/spec/09-conformance.md" in names
    assert "metaroce_xdp/cli/main.py" in names and "metaroce_xdp/entry.py" in names
    assert z.read("metaroce_xdp/_revision.txt").decode().strip() == git_revision(ROOT)
    meta = z.read(f"metaroce_xdp-{__version__}.dist-info/METADATA").decode().splitlines()
    always = [m for m in meta if m.startswith("Requires-Dist:") and "extra ==" not in m]
    assert always == ["Requires-Dist: numpy (>=1.24)"] or always == ["Requires-Dist: numpy>=1.24"], always
    assert "Provides-Extra: client" in meta and "Provides-Extra: daemon" in meta
    eps = z.read(f"metaroce_xdp-{__version__}.dist-info/entry_points.txt").decode()
    for cmd in ("metaroce", "metaroced", "metaroce-conformance"):
        assert f"\n{cmd} = metaroce_xdp.entry:" in eps, eps


def test_client_extra_alone_serves_applications_and_the_commands_say_what_is_missing(tmp_path, wheel):
    """numpy and nothing else of PyPI (numpy linked from the project venv): the client library imports
    without numba, `--version` answers, and the endpoint's commands name the missing module in one line."""
    import numpy
    npdir = Path(numpy.__file__).parent
    only = tmp_path / "numpy-only"
    only.mkdir()
    for d in [npdir, *npdir.parent.glob("numpy.libs"), *npdir.parent.glob("numpy-*.dist-info")]:
        (only / d.name).symlink_to(d)
    env = _install(tmp_path, wheel, [str(only)])
    r = _run([env / "bin" / "python", "-c",
              "import sys, metaroce_xdp, metaroce_xdp.daemon.client as c, metaroce_xdp.verbs_types;"
              "print(metaroce_xdp.__file__); print(sorted({m.split('.')[0] for m in sys.modules} & "
              "{'numba', 'llvmlite', 'pyroute2', 'bcc', 'typer', 'scapy'}))"], cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    where, loaded = r.stdout.splitlines()
    assert where.startswith(str(env)) and loaded == "[]", r.stdout
    from metaroce_xdp import __version__
    v = _run([env / "bin" / "metaroced", "--version"], cwd=str(tmp_path))
    assert v.returncode == 0 and v.stdout.startswith(f"metaroced {__version__} (revision "), v.stdout + v.stderr
    for cmd in (["metaroce", "qp", "list"], ["metaroce-conformance", "--list"]):
        r = _run([env / "bin" / cmd[0], *cmd[1:]], cwd=str(tmp_path))
        assert r.returncode == 1, (cmd, r.stdout, r.stderr)
        assert "this install has no module" in r.stderr and "metaroce-xdp[daemon]" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def _numba_cache_for(dst: Path) -> None:
    """The checkout's numba cache (__pycache__ beside its sources) in the NUMBA_CACHE_DIR layout, which is the
    path inside the package: it serves the installed copy, whose files are the same."""
    from metaroce_xdp.jitcache import export_in_tree
    assert export_in_tree(str(dst)) > 0


def test_installed_commands_answer_version_from_outside_the_checkout(full_install, tmp_path):
    from metaroce_xdp import __version__
    from metaroce_xdp.version import git_revision
    for cmd in ("metaroce", "metaroced", "metaroce-conformance"):
        r = _run([full_install / "bin" / cmd, "--version"], cwd=str(tmp_path))
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == f"{cmd} {__version__} (revision {git_revision(ROOT)})", r.stdout
    r = _run([full_install / "bin" / "python", "-c", "import metaroce_xdp, metaroce_xdp.kern.bccbuild as b;"
              "print(metaroce_xdp.__file__); print(b.BPF_DIR)"], cwd=str(tmp_path))
    pkg, bpf = r.stdout.split()
    assert pkg.startswith(str(full_install)) and bpf.startswith(str(full_install)), r.stdout + r.stderr


@pytest.mark.netns
def test_installed_metaroced_serves_perf_qp_list_and_an_application(full_install, tmp_path):
    """Both hosts run the installed metaroced (bpffs and socket of their own); the installed `metaroce perf
    write-bw` runs through them with the peer's bytes verified; the example application, on the installed
    client library, writes 1 MiB with immediate and both sides hold the same bytes; meanwhile the installed
    `metaroce qp list -j` shows the server's QP in RTS facing the client's; then the README's client
    example, as written, completes its WRITE."""
    from metaroce_xdp.topo import two_hosts
    bin_ = full_install / "bin"
    cache = tmp_path / "numba"
    _numba_cache_for(cache)
    envv = {**os.environ, "NUMBA_CACHE_DIR": str(cache), "PYTHONUNBUFFERED": "1"}
    topo, pair = two_hosts()
    procs, mounts = [], []
    try:
        socks = {}
        for ns, ifname, h in ((topo[0], pair.a.ifname, "A"), (topo[1], pair.b.ifname, "B")):
            bpffs = tmp_path / f"bpf{h}"
            bpffs.mkdir()
            subprocess.run(["mount", "-t", "bpf", "bpf", str(bpffs)], check=True)
            mounts.append(bpffs)
            socks[h] = str(tmp_path / f"{h}.sock")
            conf = tmp_path / f"{h}.toml"
            conf.write_text(f'interfaces = ["{ifname}"]\nsocket_path = "{socks[h]}"\nprogress = "sleep"\n'
                            f'bpffs_prefix = "{bpffs}/metaroce"\nwatchdog = false\n')
            log = open(tmp_path / f"{h}.log", "w")
            procs.append(topo.popen(ns, [str(bin_ / "metaroced"), "--config", str(conf)], stdout=log,
                                    stderr=subprocess.STDOUT, cwd=str(tmp_path), env=envv,
                                    preexec_fn=daemon_procs.die_with_parent))
        for h, p in zip("AB", procs):
            for _ in range(240):                                 # ready: its log says so (bounded: 120 s)
                if "ready in" in (tmp_path / f"{h}.log").read_text() or p.poll() is not None:
                    break
                time.sleep(0.5)
            text = (tmp_path / f"{h}.log").read_text()
            assert "ready in" in text, text[-3000:]
            assert "compiling the data path" not in text, text[-3000:]   # the copied cache served it

        # metaroce perf through both daemons
        perf = [str(bin_ / "metaroce"), "perf", "write-bw", "--json", "-n", "200", "-s", "16384", "-p", "19811"]
        srv = topo.popen(topo[1], [*perf, "-d", pair.b.ifname, "--socket", socks["B"]], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=str(tmp_path), env=envv)
        procs.append(srv)
        for _ in range(60):
            c = _nsrun(topo, topo[0], [*perf, "-d", pair.a.ifname, "--socket", socks["A"], pair.b.ipv4], envv,
                       tmp_path)
            if "start `metaroce perf" not in c.stderr or srv.poll() is not None:
                break
            time.sleep(0.5)
        out, err = srv.communicate(timeout=60)
        assert c.returncode == 0 and srv.returncode == 0, (c.stdout, c.stderr, out, err)
        r = json.loads(c.stdout.strip().splitlines()[-1])
        assert r["peer_verified"] is True and r["gbps"] > 0, r
        assert "metaroce perf: engine: metaroced" in c.stderr and "metaroce perf: engine: metaroced" in err

        # an application on the installed client library, and qp list while it holds its QP
        app = [str(bin_ / "python"), str(EXAMPLE)]
        server = topo.popen(topo[1], [*app, "--ifname", pair.b.ifname, "--socket", socks["B"], "--hold", "server"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=str(tmp_path), env=envv)
        procs.append(server)
        first = server.stdout.readline()
        assert json.loads(first or "{}").get("listening") == 18515, (first, server.stderr.read()
                                                                     if server.poll() is not None else "")
        cl = _nsrun(topo, topo[0], [*app, "--ifname", pair.a.ifname, "--socket", socks["A"], "client", pair.b.ipv4],
                    envv, tmp_path)
        assert cl.returncode == 0, cl.stdout + cl.stderr
        got_c = json.loads(cl.stdout.strip().splitlines()[-1])
        got_s = json.loads(server.stdout.readline())
        assert got_c["ok"] and got_s["ok"] and got_c["sha256"] == got_s["sha256"], (got_c, got_s)
        assert got_c["package"].startswith(str(full_install)) and got_s["package"].startswith(str(full_install))
        ql = _nsrun(topo, topo[1], [str(bin_ / "metaroce"), "qp", "list", "-j", "--socket", socks["B"]], envv,
                    tmp_path)
        assert ql.returncode == 0, ql.stderr
        q = next(q for q in json.loads(ql.stdout)["qps"] if q["qpn"] == got_s["qpn"])
        assert q["state"] == "RTS" and q["remote_qpn"] == got_c["qpn"] and q["remote_addr"] == pair.a.ipv4, q
        server.stdin.write("\n")
        server.stdin.flush()
        assert server.wait(30) == 0

        # the README's "Connect an application" block, as written, as the client of another such server
        # (it WRITEs without immediate: the server's receive stays pending and the server is stopped after)
        block = (ROOT / "README.md").read_text().split("## Connect an application", 1)[1]
        block = block.split("```python\n", 1)[1].split("```", 1)[0]
        assert block.count('"eth1"') == 1 and block.count('"10.0.0.2"') == 1
        block = block.replace('"eth1"', repr(pair.a.ifname)).replace('"10.0.0.2"', repr(pair.b.ipv4))
        block += "print(wc.status.name, wc.opcode.name, wc.wr_id)\n"
        server = topo.popen(topo[1], [*app, "--ifname", pair.b.ifname, "--socket", socks["B"], "server"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(tmp_path), env=envv)
        procs.append(server)
        assert json.loads(server.stdout.readline() or "{}").get("listening") == 18515
        rd = _nsrun(topo, topo[0], [str(bin_ / "python"), "-c", block], {**envv, "METAROCE_SOCKET": socks["A"]},
                    tmp_path)
        assert rd.returncode == 0 and rd.stdout.split() == ["SUCCESS", "RDMA_WRITE", "1"], rd.stdout + rd.stderr
    finally:
        for p in procs:
            daemon_procs.reap(p)
        topo.close()
        for m in mounts:
            subprocess.run(["umount", str(m)], check=False)
