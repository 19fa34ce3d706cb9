#!/usr/bin/python3
"""Does this kernel's verifier accept MetaRoCE's BPF programs?  Run on the kernel to check (Debian 12's 6.1
in the VM of vm/rxe), with Debian's python3-bpfcc and the kernel's headers, nothing else: numpy and
numba are not needed.

    python3 xdp_loads.py DIR      # DIR holds bpf/ and kern/{bccbuild,bpfsys}.py of a checkout or a wheel

Compiles bpf/metaroce_xdp.c with BCC as the loader does (kern/bccbuild.py's flags) and loads it the two
ways the loader may: with BPF_F_XDP_HAS_FRAGS (multi-buffer, the default) and without (single-buffer
drivers); then the tc programs of `metaroce fabric` (bpf/fabric_impair.c) and of the fault injector
(bpf/fault_inject.c).  Prints one line per program, `LOADED ...` or `REFUSED ...` with the verifier log's end, and
exits 1 if any was refused.  tests/conformance/test_rxe_agent.py runs it in the VM; the verifier of
the kernel the tests run on is newer and accepts more (bounds through byte swaps, since 6.7)."""
import importlib.util
import os
import sys
import time


def _module(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod                       # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def main() -> int:
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
    bccbuild = _module("bccbuild", os.path.join(root, "kern", "bccbuild.py"))
    bpfsys = _module("bpfsys", os.path.join(root, "kern", "bpfsys.py"))
    from bcc import BPF
    from bcc.libbcc import lib
    bpf_dir = os.path.join(root, "bpf")
    func = b"xdp_metaroce"
    refused = 0
    print(f"kernel {os.uname().release}", flush=True)
    t = time.monotonic()
    c = bccbuild.compile_program(bccbuild.cflags(max_qps=1024, bpf_dir=bpf_dir), bpf_dir=bpf_dir)
    print(f"compiled in {time.monotonic() - t:.1f} s", flush=True)
    mod = c.bpf.module
    start, size = lib.bpf_function_start(mod, func), lib.bpf_function_size(mod, func)
    for name, flags in (("multi-buffer", bpfsys.BPF_F_XDP_HAS_FRAGS), ("single-buffer", 0)):
        t = time.monotonic()
        try:
            fd = bpfsys.prog_load(bpfsys.BPF_PROG_TYPE_XDP, start, size, lib.bpf_module_license(mod),
                                  kern_version=lib.bpf_module_kern_version(mod), prog_flags=flags, name=func)
        except OSError as e:
            refused += 1
            print(f"REFUSED {name}: {e}", flush=True)
            continue
        os.close(fd)
        print(f"LOADED {name}: {size // 8} instructions, verified in {time.monotonic() - t:.1f} s", flush=True)
    c.close()
    # the tc programs of `metaroce fabric` and the fault injector, with their sources' default parameters
    for src, funcs in (("fabric_impair.c", (b"fab_egress", b"fab_delay")), ("fault_inject.c", (b"fi_tc",))):
        t = time.monotonic()
        b = BPF(src_file=os.path.join(bpf_dir, src).encode(), cflags=[f"-I{bpf_dir}"])
        for fn in funcs:
            try:
                b.load_func(fn, BPF.SCHED_CLS)
                print(f"LOADED {src} {fn.decode()} (with its compile: {time.monotonic() - t:.1f} s)", flush=True)
            except Exception as e:            # BCC raises Exception, the verifier's log on stderr
                refused += 1
                print(f"REFUSED {src} {fn.decode()}: {e}", flush=True)
        b.cleanup()
    return 1 if refused else 0


if __name__ == "__main__":
    sys.exit(main())
