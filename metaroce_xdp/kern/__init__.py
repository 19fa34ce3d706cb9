"""Kernel side of the MetaRoCE endpoint, seen from Python.

`layout` mirrors bpf/metaroce_structs.h and bpf/metaroce_drop_reasons.h as
numpy dtypes and enums (one place; tests/kern/test_c_python_agree.py proves they
match the C).  `loader` compiles bpf/metaroce_xdp.c with BCC, attaches it,
mmaps the QP table and pins the maps the CLI reads (attached through a bpf_link,
so the program goes away with the process that owns it).  `bpfsys` is the thin
bpf(2) syscall layer (BPF_PROG_TEST_RUN, BPF_OBJ_PIN/GET, BPF_PROG_LOAD with
BPF_F_XDP_HAS_FRAGS, BPF_LINK_CREATE, object info) used by both.  `bccbuild` is BCC's compile alone,
importing nothing else (metaroced runs it first thing).
"""
import importlib

_FROM = {**dict.fromkeys(("CONFIG_DTYPE", "QP_STATE_DTYPE", "DropReason", "Event", "Profile", "QpFlag", "QpState",
                          "CfgFlag"), "layout"),
         **dict.fromkeys(("PIN_ROOT", "LoaderError", "XdpBusy", "XdpLoader", "XdpMode"), "loader")}

__all__ = list(_FROM)


def __getattr__(name: str):
    """The names above, imported on first use: `kern.bccbuild` (metaroced's first step) must not wait for
    layout.py's imports (numpy, the wire package and numba)."""
    if name in ("layout", "loader", "bpfsys", "bccbuild"):       # `kern.loader` without importing it first
        return importlib.import_module(f".{name}", __name__)
    mod = _FROM.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{mod}", __name__), name)
