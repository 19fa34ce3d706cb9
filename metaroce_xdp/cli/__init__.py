"""The `metaroce` command (main.py) and its parts, installed with the package.

    main.py          the typer app: decode, perf, pingpong, fabric, warmup, and daemon_cli's commands
    daemon_cli.py    dev show, qp list/show (and the kernel view `qp -d DEV`), stat, top
    perf.py          perftest-style tests (write-bw, write-lat, read-bw, send-bw)
    pingpong.py      ibv_rc_pingpong's exchange and test
    engine_choice.py metaroced when it serves the interface, else the plane in process
    qpstat.py        the kernel's view of QPs: the pinned BPF maps
    decode.py        packets from a capture or hex, with the ICRC verdict
    fabric.py        metaroce fabric up|set|show|down (the emulated fabric)

`python -m metaroce_xdp.cli ARGS` is `metaroce ARGS`.  Development scripts (benchmarks, soak, the demo,
the Soft-RoCE VM driver) stay in the checkout's tools/, which is not installed."""
