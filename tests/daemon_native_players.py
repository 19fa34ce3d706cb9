"""A client application of metaroced for tests/daemon/test_daemon_native_read.py: tests/daemon_players.py's Player
(one process, one JSON command a line on stdin, one JSON answer a line on stdout; the client library
only) with what READ and atomics on either profile need:

  setup size seed          as daemon_players, the MR registered with REMOTE_ATOMIC too
  accept profile / connect host port profile   the connection set-up offering `profile` (native|compat|auto)
  post ops=[...]           daemon_players' ops and "faa" (add), "cas" (compare, swap): 8 bytes at `off`
                           (the original value), the peer's buffer at `roff`
  u64 off n                n little-endian uint64 of the local buffer from `off`
  put_u64 off value        one uint64 into the local buffer
  query                    the daemon's query_qp (state, sq_psn, profile, native counters)

    python tests/daemon_native_players.py SOCKET IFNAME
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
from daemon_players import OPS, Player, serve  # noqa: E402
from players import FULL  # noqa: E402

from metaroce_xdp.verbs_types import QPCap, SendWR, WROpcode  # noqa: E402

ATOMIC_OPS = {"faa": WROpcode.ATOMIC_FETCH_AND_ADD, "cas": WROpcode.ATOMIC_CMP_AND_SWP}


class NativePlayer(Player):
    ACCESS = FULL
    CAP = QPCap(max_send_wr=256, max_recv_wr=64)
    DEPTH = 1024

    def _connected(self, conn) -> dict:
        return {**super()._connected(conn), "profile": self.qp.profile, "atomics": self.qp.atomics}

    def _wr(self, o: dict, wr_id: int):
        if o["op"] not in ATOMIC_OPS:
            return super()._wr(o, wr_id)
        return SendWR(wr_id=wr_id, opcode=ATOMIC_OPS[o["op"]], sg_list=[self.mr.sge(o.get("off", 0), 8)],
                      remote_addr=self.peer["va"] + o.get("roff", 0), rkey=self.peer["rkey"],
                      compare_add=o.get("add", o.get("compare", 0)), swap=o.get("swap", 0))

    def u64(self, off: int, n: int = 1) -> dict:
        return {"values": [int(v) for v in self.buf[off:off + 8 * n].view(np.uint64)]}

    def put_u64(self, off: int, value: int) -> dict:
        self.buf[off:off + 8].view(np.uint64)[0] = value
        return {}

    def query(self) -> dict:
        q = self.qp.query()
        q["state"] = q["state"].name
        return {"qp": q}


def main() -> int:
    assert set(ATOMIC_OPS).isdisjoint(OPS)
    return serve(NativePlayer(sys.argv[1], sys.argv[2]))


if __name__ == "__main__":
    raise SystemExit(main())
