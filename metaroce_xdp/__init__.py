"""MetaRoCE reference endpoint: wire codec, XDP/AF_XDP data path and RC transport.

Sub-packages:
  wire    -- the codec: headers, opcode table, ICRC, PSN arithmetic (spec 01/02)
  afxdp   -- AF_XDP sockets and rings mapped into numpy
"""

__version__ = "0.1.0"
