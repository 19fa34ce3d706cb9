# MetaRoCE top-level targets.  `make demo` and `make test` install what is missing first.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup test demo bench soak clean lint conformance conformance-rxe

setup:
	@VENV=$(VENV) ./scripts/setup.sh

test: setup
	$(PY) -m pytest -q -rs $(PYTEST_ARGS)

demo: setup
	$(PY) -m tools.demo

# The table on stdout; docs/bench/: bench.json (schema in tools/bench.py), RESULTS.md, the plots.
# BENCH_ARGS passes options (python -m tools.bench --help), e.g. "--plane both".
BENCH_ARGS ?=
bench: setup
	$(PY) -m tools.bench --json docs/bench/bench.json $(BENCH_ARGS)

# The long checks (about 20 minutes): the fault matrix at 200,000 packets a case and a
# 10-minute soak at 1 % loss; SOAK_ARGS passes options (python -m tools.soak --help).
SOAK_ARGS ?=
soak: setup
	$(PY) -m tools.soak $(SOAK_ARGS)

# The conformance suite (spec 09) against the reference implementation in namespaces it builds;
# reports in conformance-report/ (JSON Lines, JUnit XML, Markdown, HTML, pcaps).  docs/conformance.md
# says how to run it against another implementation.
CONFORMANCE_ARGS ?=
conformance: setup
	$(PY) -m metaroce_xdp.conformance --self-test --report conformance-report $(CONFORMANCE_ARGS)

# The same suite against Linux Soft-RoCE (rdma_rxe) in the QEMU VM of ../shared/rxe-vm, through the
# rdma-core agent (metaroce_xdp/conformance/pyverbs_agent.py): tools/rxe_conformance.py builds and boots
# the VM, starts the agent in it and runs the tester in netns rxeh<ID>; it always tears down.
# Reports in conformance-report-rxe/.  RXE_VM_ARGS: e.g. "-i 3" for another VM instance.
RXE_VM_ARGS ?=
conformance-rxe: setup
	$(PY) -m tools.rxe_conformance $(RXE_VM_ARGS) -- $(abspath $(PY)) -m metaroce_xdp.conformance \
		--agent {agent} --iface {iface} --peer-ip {lt_ip} --report conformance-report-rxe $(CONFORMANCE_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
