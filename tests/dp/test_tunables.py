"""One source of tunables (metaroce_xdp/tunables.py): one default per knob, each environment variable read and
checked in one place, a bad value an InvalidArgument naming the variable; Context.open takes a Tunables and the
plane runs with it; metaroced builds its own from metaroced.toml (spin_idle, max_pending_events) with the same
overrides."""
from __future__ import annotations

import pytest

from metaroce_xdp import tunables
from metaroce_xdp.daemon.config import ConfigError, DaemonConfig
from metaroce_xdp.tunables import Tunables
from metaroce_xdp.verbs_types import InvalidArgument


def test_defaults_and_overrides():
    assert tunables.load(env={}) == Tunables()
    t = tunables.load(env={"METAROCE_WINDOW": "64", "METAROCE_DP_SPIN": "0", "METAROCE_XDP_SACKS": "0",
                           "METAROCE_READ_RATE_MBPS": "2500.5", "METAROCE_PORT_INFLIGHT": "0", "METAROCE_BUDGET": ""})
    assert (t.window, t.spin_idle, t.xdp_sacks, t.read_rate_mbps, t.port_inflight, t.budget) == \
        (64, 0, False, 2500.5, 0, 256)
    base = Tunables(spin_idle=200)            # metaroced's: its config, then the environment
    assert tunables.load(base, env={}).spin_idle == 200
    assert tunables.load(base, env={"METAROCE_DP_SPIN": "7"}).spin_idle == 7


@pytest.mark.parametrize("var,text", [("METAROCE_WINDOW", "0"), ("METAROCE_BUDGET", "many"),
                                      ("METAROCE_XDP_SACKS", "yes"), ("METAROCE_READ_RATE_MBPS", "nan"),
                                      ("METAROCE_DP_YIELD", "-1"), ("METAROCE_BUDGET", str(1 << 63)),
                                      ("METAROCE_READ_RATE_MBPS", "inf")])
def test_a_bad_value_names_the_variable(var, text):
    with pytest.raises(InvalidArgument, match=var):
        tunables.load(env={var: text})


def test_every_knob_has_one_variable():
    names = [v for v, _, _ in tunables.ENV.values()]
    assert len(names) == len(set(names)) and all(n.startswith("METAROCE_") for n in names)
    for n in names:                            # the module's table documents each
        assert n in tunables.__doc__


def test_daemon_config_carries_its_own_defaults():
    cfg = DaemonConfig()
    assert (cfg.spin_idle, cfg.max_pending_events) == (200, 1024)
    with pytest.raises(ConfigError, match="spin_idle"):
        DaemonConfig(spin_idle=-1).validate()
    with pytest.raises(ConfigError, match="max_pending_events"):
        DaemonConfig(max_pending_events=0).validate()


@pytest.mark.netns
def test_context_open_runs_with_the_tunables_given():
    from metaroce_xdp.dp import Context
    from metaroce_xdp.dp import layout as L
    from metaroce_xdp.topo import two_hosts
    topo, _ = two_hosts(prefix="mrtun")
    try:
        with topo.enter(topo[0]):
            ctx = Context.open("mr0", tunables=Tunables(window=77, budget=33, spin_idle=5, yield_after=0,
                                                         port_inflight=100))
        try:
            A = ctx.plane.A
            assert (A[L.P_WINDOW], A[L.P_BUDGET], A[L.P_SPIN_IDLE], A[L.P_YIELD_AFTER], A[L.P_INFL_CAP]) == \
                (77, 33, 5, 0, 100)
            assert ctx.plane.tunables.window == 77
        finally:
            ctx.close()
    finally:
        topo.close()
