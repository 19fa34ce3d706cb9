"""MetaRoCE reference endpoint: wire codec, XDP/AF_XDP data path and RC transport.

    from metaroce_xdp import Context          # the endpoint: the compiled data plane (dp.Context)
    ctx = Context.open("eth1")

`Context` is `metaroce_xdp.dp.Context`: the verbs of the README over one GIL-free compiled loop per
port, what metaroced hosts -- the one implementation of the transport (scapy, the conformance
suite and Linux Soft-RoCE are the independent checks the tests run it against).  Importing this
package stays cheap: `Context` is loaded on first use (numpy, numba and BCC only then).

Sub-packages:
  wire    -- the codec: headers, opcode table, ICRC, PSN arithmetic (spec 01/02)
  afxdp   -- AF_XDP sockets and rings mapped into numpy
  dp      -- the compiled data plane (Context)
  daemon  -- metaroced and its client library
"""

from .version import __version__

__all__ = ["Context", "__version__"]


def __getattr__(name: str):
    if name == "Context":
        from .dp.context import Context
        return Context
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
