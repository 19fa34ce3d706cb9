"""The Reliable Connected transport (compat profile), split by role as in Linux rxe.

  memory.py     PD, MR, lkey/rkey table, access and bounds checks (spec 08, MR-MEM)
  requester.py  send queue -> request packets, PSNs, retransmission (MR-RC, MR-RETRY)
  completer.py  ACK/NAK/READ response/ATOMIC ACK -> completions in WR order (MR-ACK, MR-NAK)
  responder.py  request packets -> memory, ACKs, NAKs, RNR, duplicates (MR-RC, MR-DUP, MR-ATOM)
  qp.py         the QP object and its state machine (spec 07, MR-QP)
  engine.py     the progress engine: a port (AF_XDP or in-process), QP table, timers
  port.py       the packet I/O interface and an in-process port pair for tests
  rxparse.py    received frame -> RxPkt (fields the transport needs)
"""
