# MetaRoCE top-level targets.  `make demo` and `make test` install what is missing first.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup test demo bench soak fuzz clean conformance conformance-rxe vm-endpoint wheel wheelhouse install uninstall

setup:
	@VENV=$(VENV) ./scripts/setup.sh

test: setup
	$(PY) -m pytest -q -rs --durations=25 $(PYTEST_ARGS)

demo: setup
	$(PY) -m tools.demo

# The table on stdout; docs/bench/: bench.json (schema in tools/bench.py), RESULTS.md, the plots;
# then goodput against loss on the emulated fabric: fabric.json, goodput_loss.png (tools/bench_fabric.py);
# then goodput against the number of RX queues one QP's packets are spread over: queues.json (tools/bench_queues.py).
# BENCH_ARGS passes options (python -m tools.bench --help), e.g. "--placement same".
BENCH_ARGS ?=
bench: setup
	$(PY) -m tools.bench --json docs/bench/bench.json $(BENCH_ARGS)
	$(PY) -m tools.bench_fabric --json docs/bench/fabric.json
	$(PY) -m tools.bench_queues --json docs/bench/queues.json

# The long checks (about 40 minutes): the fault matrix at 200,000 packets a case and a
# 10-minute soak at 1 % loss, on the compiled plane in process and on metaroced (--plane);
# SOAK_ARGS passes options (python -m tools.soak --help).
SOAK_ARGS ?=
soak: setup
	$(PY) -m tools.soak $(SOAK_ARGS)

# The fuzzers' long form (docs/fuzzing.md): the control protocol against a live metaroced, then packets
# against the compiled plane, FUZZ_DURATION seconds in all (default 1800), then FUZZ_BC_CASES packet cases
# with numba's bounds checking (its own cache in FUZZ_BC_CACHE, which setup warms beside the plain one).
# Crashes land in FUZZ_OUT/, one replayable JSON file each (python -m metaroce_xdp.fuzz replay FILE); the
# summary in FUZZ_OUT/summary.json.  FUZZ_SEED repeats a run; FUZZ_ARGS=--strict fails on known-open findings
# too.  The short form runs in `make test` (tests/dp/test_fuzz_live.py).
FUZZ_DURATION ?= 1800
FUZZ_SEED     ?= $(shell date +%s)
FUZZ_OUT      ?= fuzz-crashes
FUZZ_BC_CACHE ?= .cache/numba-boundscheck
FUZZ_BC_CASES ?= 0:400
FUZZ_ARGS     ?=
fuzz: setup
	$(PY) -m metaroce_xdp.fuzz all --duration $(FUZZ_DURATION) --seed $(FUZZ_SEED) --out $(FUZZ_OUT) \
		--json $(FUZZ_OUT)/summary.json $(FUZZ_ARGS); a=$$?; \
	$(PY) -m metaroce_xdp.fuzz pkt --cases $(FUZZ_BC_CASES) --seed $(FUZZ_SEED) --out $(FUZZ_OUT) \
		--boundscheck $(FUZZ_BC_CACHE) --json $(FUZZ_OUT)/summary-boundscheck.json $(FUZZ_ARGS); \
	exit $$(( a | $$? ))

# The conformance suite (spec 09) against what ships, in namespaces it builds: the compiled plane in the
# agent's process (--iut compiled) and metaroced through its client library (--iut daemon); reports in
# conformance-report/<iut>/ (JSON Lines, JUnit XML, Markdown, HTML, pcaps), each naming its IUT.
# docs/conformance.md says how to run it against another implementation.
CONFORMANCE_ARGS ?=
# The claim: compat + native with ATOMICS, MULTIPATH and CREDITS (+ DCQCN in process): the agent's options.
conformance: export METAROCE_AGENT_PROFILES ?= compat,native
conformance: export METAROCE_AGENT_CAPS ?= MULTIPATH,CREDITS
conformance: setup
	$(PY) -m metaroce_xdp.conformance --self-test --iut compiled --report conformance-report/compiled $(CONFORMANCE_ARGS); \
	a=$$?; $(PY) -m metaroce_xdp.conformance --self-test --iut daemon --report conformance-report/daemon \
		$(CONFORMANCE_ARGS); exit $$(( a | $$? ))

# The same suite against Linux Soft-RoCE (rdma_rxe) in the QEMU VM of vm/rxe, through the
# rdma-core agent (metaroce_xdp/conformance/pyverbs_agent.py): tools/rxe_conformance.py builds and boots
# the VM, starts the agent in it and runs the tester in netns rxeh<ID>; it always tears down.
# Reports in conformance-report-rxe/.  RXE_VM_ARGS: e.g. "-i 3" for another VM instance.
RXE_VM_ARGS ?=
conformance-rxe: setup
	$(PY) -m tools.rxe_conformance $(RXE_VM_ARGS) -- $(abspath $(PY)) -m metaroce_xdp.conformance \
		--agent {agent} --iface {iface} --peer-ip {lt_ip} --report conformance-report-rxe $(CONFORMANCE_ARGS)

# A stock distribution kernel and a real NIC driver: Debian 12's own kernel (6.1) in a QEMU VM with a
# virtio-net NIC of 4 queue pairs (driver-mode XDP; the host's multi-queue tap spreads flows over them),
# the project installed inside from its wheelhouse by `make install`, metaroced on every RX queue, and
# `metaroce perf` write/read/send (compat) and native write, 4 QPs, verified both ways, against this host
# (vm/endpoint/run.sh; report in /tmp/rxevm/endpoint/report.txt).  Not in `make test`: TCG makes the
# guest ~12x slower (it runs ~15 minutes); its result is in docs/endpoint.md.
vm-endpoint: setup
	./vm/endpoint/run.sh

# The wheel: the package with its commands (metaroce, metaroced, metaroce-conformance), the BPF sources
# and the specification (pyproject.toml; setup.py stamps the git revision for --version); built without
# the network with the venv's setuptools.  `make wheelhouse` adds every dependency of the [daemon] extra
# as wheels beside it (needs the package index once), for `make install WHEELHOUSE=...` on hosts without.
# Built with the project venv's python when there is one, else Debian's (python3-setuptools, -wheel).
DIST       ?= dist
WHEELHOUSE ?=
WHEEL_PY   ?= $(if $(wildcard $(PY)),$(PY),/usr/bin/python3)
wheel:
	rm -f $(DIST)/metaroce_xdp-*.whl
	$(WHEEL_PY) -m pip wheel -q --no-deps --no-build-isolation --no-index -w $(DIST) .
	@ls $(DIST)/metaroce_xdp-*.whl

wheelhouse: wheel
	$(WHEEL_PY) -m pip wheel -q -w $(DIST)/wheelhouse "$$(ls $(DIST)/metaroce_xdp-*.whl)[daemon]"
	cp $(DIST)/metaroce_xdp-*.whl $(DIST)/wheelhouse/
	@echo "$(DIST)/wheelhouse: copy it to the host, then: make install WHEELHOUSE=<that folder>"

# metaroced as a systemd service (docs/daemon.md, "Installing and running the service"):
#   - the runtime's set-up (scripts/setup.sh --runtime: python3-bpfcc, kernel headers, bpffs; not the
#     test tools);
#   - the wheel -- WHEEL=path, else the one in WHEELHOUSE, else one built from this checkout -- with the
#     [daemon] extra into a venv of its own at INSTALL_VENV (system site packages, for BCC), from
#     WHEELHOUSE alone when given (no network), else from the package index; an upgrade replaces the
#     package whole (pip removes the old version's files) and restarts a running service;
#   - metaroced and metaroce linked into BINDIR, the unit into UNITDIR (ExecStart pointed at BINDIR), the
#     user metaroce and the group metaroce-users, whose members may use the daemon's socket
#     (SYSUSERSDIR/metaroce.conf, systemd-sysusers), the default configuration into SYSCONFDIR/metaroce/
#     with socket_group = "metaroce-users" unless a configuration is there (never overwritten);
#   - numba's cache warmed where the unit points it (CACHEDIR), so the first start compiles nothing.
# DESTDIR stages the unit, the users and the configuration only (a venv cannot be moved).
# `make uninstall` stops the service and removes all of it but the configuration (PURGE=1: that too,
# and the user and group).
PREFIX       ?= /usr/local
BINDIR       ?= $(PREFIX)/bin
SYSCONFDIR   ?= /etc
UNITDIR      ?= /etc/systemd/system
SYSUSERSDIR  ?= /usr/lib/sysusers.d
INSTALL_VENV ?= /opt/metaroce
CACHEDIR     ?= /var/cache/metaroce
DESTDIR      ?=
WHEEL        ?=
PURGE        ?= 0
SOCKET_GROUP := metaroce-users
install:
	@[ "$$(id -u)" -eq 0 ] || [ -n "$(DESTDIR)" ] || { echo "make install: run as root (or stage with DESTDIR=...)" >&2; exit 1; }
	install -d "$(DESTDIR)$(UNITDIR)" "$(DESTDIR)$(SYSCONFDIR)/metaroce"
	sed 's|/usr/local/bin/metaroced|$(BINDIR)/metaroced|; s|/etc/metaroce/metaroced.toml|$(SYSCONFDIR)/metaroce/metaroced.toml|; s|/var/cache/metaroce/numba|$(CACHEDIR)/numba|' \
		daemon/metaroced.service > "$(DESTDIR)$(UNITDIR)/metaroced.service"
	chmod 644 "$(DESTDIR)$(UNITDIR)/metaroced.service"
	install -D -m 644 daemon/metaroce.sysusers "$(DESTDIR)$(SYSUSERSDIR)/metaroce.conf"
	@if [ -e "$(DESTDIR)$(SYSCONFDIR)/metaroce/metaroced.toml" ]; then \
		echo "keeping the existing $(DESTDIR)$(SYSCONFDIR)/metaroce/metaroced.toml (the defaults: daemon/metaroced.toml)"; \
	else sed 's|^# socket_group = "rdma" .*|socket_group = "$(SOCKET_GROUP)"      # its members may use the socket (make install made it)|' \
		daemon/metaroced.toml > "$(DESTDIR)$(SYSCONFDIR)/metaroce/metaroced.toml"; \
		chmod 644 "$(DESTDIR)$(SYSCONFDIR)/metaroce/metaroced.toml"; fi
	@if [ -n "$(DESTDIR)" ]; then echo "DESTDIR set: unit, users and configuration staged; the package venv is not built"; exit 0; fi; \
	set -e; \
	./scripts/setup.sh --runtime; \
	systemd-sysusers "$(SYSUSERSDIR)/metaroce.conf"; \
	whl="$(WHEEL)"; \
	if [ -z "$$whl" ] && [ -n "$(WHEELHOUSE)" ]; then whl="$$(ls "$(WHEELHOUSE)"/metaroce_xdp-*.whl | sort -V | tail -n1)"; fi; \
	if [ -z "$$whl" ]; then $(MAKE) --no-print-directory wheel; whl="$$(ls $(DIST)/metaroce_xdp-*.whl)"; fi; \
	[ -f "$$whl" ] || { echo "make install: no wheel at '$$whl'" >&2; exit 1; }; \
	index=""; [ -z "$(WHEELHOUSE)" ] || index="--no-index --find-links $(WHEELHOUSE)"; \
	install -d "$(BINDIR)" "$(CACHEDIR)/numba"; \
	[ -x "$(INSTALL_VENV)/bin/python" ] || /usr/bin/python3 -m venv --system-site-packages "$(INSTALL_VENV)"; \
	old="$$("$(INSTALL_VENV)/bin/python" -m pip show metaroce-xdp 2>/dev/null | sed -n 's/^Version: //p')"; \
	rm -rf "$(INSTALL_VENV)/src"; \
	"$(INSTALL_VENV)/bin/python" -m pip install -q $$index --force-reinstall --no-deps "$$whl"; \
	"$(INSTALL_VENV)/bin/python" -m pip install -q $$index "$$whl[daemon]"; \
	ln -sfn "$(INSTALL_VENV)/bin/metaroced" "$(BINDIR)/metaroced"; \
	ln -sfn "$(INSTALL_VENV)/bin/metaroce" "$(BINDIR)/metaroce"; \
	NUMBA_CACHE_DIR="$(CACHEDIR)/numba" "$(INSTALL_VENV)/bin/metaroce" warmup -q; \
	chown -R metaroce:metaroce "$(CACHEDIR)"; \
	if [ -d /run/systemd/system ]; then \
		systemctl daemon-reload; \
		if systemctl is-active -q metaroced; then systemctl restart metaroced; echo "metaroced restarted"; fi; \
	fi; \
	echo "installed $$("$(BINDIR)/metaroced" --version)$${old:+ (was $$old)}: $(BINDIR)/metaroced and metaroce," \
		"$(UNITDIR)/metaroced.service, $(SYSCONFDIR)/metaroce/metaroced.toml; set interfaces there, add" \
		"users to the group $(SOCKET_GROUP), then: systemctl enable --now metaroced"

uninstall:
	@[ "$$(id -u)" -eq 0 ] || [ -n "$(DESTDIR)" ] || { echo "make uninstall: run as root" >&2; exit 1; }
	@if [ -z "$(DESTDIR)" ] && [ -d /run/systemd/system ]; then systemctl disable --now metaroced 2>/dev/null || true; fi
	rm -f "$(DESTDIR)$(UNITDIR)/metaroced.service" "$(DESTDIR)$(SYSUSERSDIR)/metaroce.conf"
	@for l in "$(DESTDIR)$(BINDIR)/metaroced" "$(DESTDIR)$(BINDIR)/metaroce"; do \
		if [ -L "$$l" ] && [ "$$(readlink "$$l")" = "$(INSTALL_VENV)/bin/$$(basename "$$l")" ]; then rm -f "$$l"; fi; done
	rm -rf "$(DESTDIR)$(INSTALL_VENV)" "$(DESTDIR)$(CACHEDIR)"
	@if [ -z "$(DESTDIR)" ] && [ -d /run/systemd/system ]; then systemctl daemon-reload; fi
	@if [ "$(PURGE)" = 1 ]; then rm -rf "$(DESTDIR)$(SYSCONFDIR)/metaroce"; \
		if [ -z "$(DESTDIR)" ]; then userdel metaroce 2>/dev/null || true; groupdel $(SOCKET_GROUP) 2>/dev/null || true; \
		groupdel metaroce 2>/dev/null || true; fi; \
		echo "purged: the configuration, the user metaroce and the group $(SOCKET_GROUP)"; \
	else echo "kept $(DESTDIR)$(SYSCONFDIR)/metaroce/ (make uninstall PURGE=1 removes it, the user and the group)"; fi

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info build $(DIST)
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
