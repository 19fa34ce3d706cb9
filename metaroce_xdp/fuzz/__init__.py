"""Fuzzers that look for the next hole (issue 19, "Keep finding them"); docs/fuzzing.md says how to run them.

    python -m metaroce_xdp.fuzz ctl --duration 60 --seed 1      # control protocol, against a live metaroced
    python -m metaroce_xdp.fuzz pkt --duration 60 --seed 1      # packets, against the compiled plane
    python -m metaroce_xdp.fuzz replay fuzz-crashes/<file>.json # one saved crash again

Modules: known.py (the findings still open: signatures a crash may match), store.py (crashes saved as
replayable JSON), harness.py (namespaces, metaroced processes, the watched endpoint), ctl.py (control
messages, fds, hostile ring entries), pkt.py (mutated RoCEv2/MetaRoCE packets from a scripted peer),
endpoint.py (the compiled plane in a child process, its MRs between guard pages).  Every case derives
from (seed, case number) alone, so a saved crash is the seed, the number and the input it produced.
"""
