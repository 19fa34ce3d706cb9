"""AF_XDP layer of the MetaRoCE reference endpoint.

Neighbours: the XDP programs in bpf/ steer RoCE frames into these sockets; the compiled
plane (metaroce_xdp/dp, numba loops) moves data through the rings.

  uapi   linux/if_xdp.h constants and ctypes structs
  xsk    Umem, XskSocket, Ring: socket set-up, ring mmap, teardown (control path)
  rings  jitted ring bursts and the UMEM frame pool (hot path, numpy + numba only);
         rx_burst_sg / tx_burst_sg / comp_reap_sg for multi-buffer sockets (XDP_USE_SG)
  port   XskPort: one RX queue's socket, UMEM and path resolver, which the compiled plane
         takes over (imported by dp/context.py, not here: it needs pyroute2)
"""
from .rings import (
    FramePool,
    comp_reap,
    comp_reap_sg,
    cons_avail,
    cons_release,
    fill_ring_refill,
    frame_alloc,
    frame_free,
    needs_wakeup,
    prod_free,
    prod_submit,
    rx_burst,
    rx_burst_sg,
    tx_burst,
    tx_burst_sg,
)
from .xsk import Ring, Umem, XskError, XskSocket, xskmap_set

__all__ = [
    "FramePool", "Ring", "Umem", "XskError", "XskSocket", "xskmap_set",
    "comp_reap", "comp_reap_sg", "cons_avail", "cons_release", "fill_ring_refill", "frame_alloc",
    "frame_free", "needs_wakeup", "prod_free", "prod_submit", "rx_burst", "rx_burst_sg", "tx_burst", "tx_burst_sg",
]
