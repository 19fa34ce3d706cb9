/* SPDX-License-Identifier: Apache-2.0 */
/*
 * metaroce_hdr.h - MetaRoCE wire headers and the opcode table (spec
 * 02-headers.md: MR-BTH, MR-XH, MR-OPC, MR-ACK/MR-NAK/MR-RNR).
 *
 * All multi-byte fields are big-endian on the wire (__be types); convert only
 * through the mr_*() accessors below, as rxe_hdr.h does.  The same layouts are
 * field tables in metaroce_xdp/wire/headers.py and the opcode table is data
 * in metaroce_xdp/wire/opcodes.py; tests/kern/test_c_python_agree.py compiles this
 * header with gcc and compares sizes, masks and header lengths with Python.
 *
 * No kernel-only includes: compiled by BCC (kernel) and gcc (tests).
 */
#ifndef __METAROCE_HDR_H
#define __METAROCE_HDR_H

#include <linux/types.h>

#ifndef __always_inline
#define __always_inline inline __attribute__((always_inline))
#endif

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#define mr_ntohs(x) ((__u16)(x))
#define mr_ntohl(x) ((__u32)(x))
#define mr_ntohll(x) ((__u64)(x))
#else
#define mr_ntohs(x) ((__u16)__builtin_bswap16(x))
#define mr_ntohl(x) ((__u32)__builtin_bswap32(x))
#define mr_ntohll(x) ((__u64)__builtin_bswap64(x))
#endif
#define mr_htons(x) mr_ntohs(x)
#define mr_htonl(x) mr_ntohl(x)

/* A byte-swapped 16-bit field as a value the verifier knows is below 65536.
 * Kernels before 6.7 do not track bounds through a byte swap (BPF_END leaves
 * the register unknown), so pointer arithmetic with the swapped value fails to
 * load there ("math between pkt pointer and register with unbounded min
 * value", Debian 12's 6.1).  The mask that tells them is one clang can prove
 * redundant and would drop; the empty asm hides the value from clang, so the
 * mask is emitted.  Costs one instruction. */
#define mr_ntohs_bounded(x) ({                                                  \
	__u32 __mr_v = mr_ntohs(x);                                             \
	asm volatile("" : "+r"(__mr_v));                                        \
	__mr_v & 0xFFFF;                                                        \
})

/* ---- Base Transport Header, 12 bytes (MR-BTH-001) --------------------- */
struct mr_bth {
	__u8   opcode;
	__u8   flags;    /* SE bit7 | M bit6 | PadCnt bits5-4 | TVer bits3-0 */
	__be16 pkey;
	__be32 qpn;      /* FECN bit31 | BECN bit30 | Resv6 | DestQP bits23-0 */
	__be32 apsn;     /* AckReq bit31 | Resv7 | PSN bits23-0 */
};

#define MR_BTH_SE        0x80
#define MR_BTH_MIG       0x40
#define MR_BTH_PAD_MASK  0x30
#define MR_BTH_PAD_SHIFT 4
#define MR_BTH_TVER_MASK 0x0F
#define MR_BTH_FECN      0x80000000u
#define MR_BTH_BECN      0x40000000u
#define MR_BTH_ACKREQ    0x80000000u

static __always_inline __u32 mr_bth_qpn(const struct mr_bth *b)
{
	return mr_ntohl(b->qpn) & 0xFFFFFFu;
}
static __always_inline __u32 mr_bth_psn(const struct mr_bth *b)
{
	return mr_ntohl(b->apsn) & 0xFFFFFFu;
}
static __always_inline __u32 mr_bth_pad(const struct mr_bth *b)
{
	return (b->flags & MR_BTH_PAD_MASK) >> MR_BTH_PAD_SHIFT;
}
static __always_inline __u32 mr_bth_tver(const struct mr_bth *b)
{
	return b->flags & MR_BTH_TVER_MASK;
}

/* ---- RDMA Extended Transport Header, 16 bytes (MR-XH-001) ------------- */
struct mr_reth {
	__be64 va;
	__be32 rkey;
	__be32 dma_len;
};

/* ---- ACK Extended Transport Header, 4 bytes --------------------------- */
struct mr_aeth {
	__be32 smsn;     /* Syndrome bits31-24 | MSN bits23-0 */
};

static __always_inline __u32 mr_aeth_syndrome(const struct mr_aeth *a)
{
	return mr_ntohl(a->smsn) >> 24;
}
static __always_inline __u32 mr_aeth_msn(const struct mr_aeth *a)
{
	return mr_ntohl(a->smsn) & 0xFFFFFFu;
}

/* AETH syndrome: bit 7 reserved (0), bits 6-5 type, bits 4-0 value (MR-XH-007). */
#define MR_AETH_TYPE_MASK        0x60
#define MR_AETH_ACK              0x00   /* value = credit count code */
#define MR_AETH_RNR_NAK          0x20   /* value = RNR timer code */
#define MR_AETH_RESERVED         0x40   /* reserved type: never valid */
#define MR_AETH_NAK              0x60   /* value = NAK code */
#define MR_AETH_VALUE_MASK       0x1F
#define MR_AETH_RSVD_BIT         0x80
#define MR_AETH_CREDIT_INVALID   0x1F

#define MR_NAK_PSN_SEQ_ERR       0
#define MR_NAK_INVALID_REQUEST   1
#define MR_NAK_REMOTE_ACCESS_ERR 2
#define MR_NAK_REMOTE_OP_ERR     3
#define MR_NAK_INVALID_RD_REQUEST 4

/* ---- Atomic Extended Transport Header, 28 bytes (packed: the u64s sit
 * at offsets 12 and 20 on the wire) ------------------------------------- */
struct mr_atomiceth {
	__be64 va;
	__be32 rkey;
	__be64 swap_add;
	__be64 compare;
} __attribute__((packed));

/* ---- Atomic ACK Extended Transport Header, 8 bytes -------------------- */
struct mr_atomicacketh {
	__be64 orig;
};

/* ---- Immediate data / Invalidate ETH, 4 bytes each -------------------- */
struct mr_immdt {
	__be32 imm;
};
struct mr_ieth {
	__be32 rkey;
};

/* ---- CNP: 16 reserved zero bytes after the BTH ------------------------- */
struct mr_cnp_pad {
	__u8 resv[16];
};

/* ---- Native Extended Transport Header, 16 bytes (MR-XH-017) ----------- */
struct mr_neth {
	__be32 flags_msn; /* FIRST bit31 | LAST bit30 | RETX bit29 | rsvd | MSN bits23-0 */
	__be32 offset;    /* byte offset of this payload in the message */
	__be32 msg_len;   /* whole message length */
	__be32 tsval;     /* sender timestamp, microseconds mod 2^32 */
};
#define MR_NETH_FIRST 0x80
#define MR_NETH_LAST  0x40
#define MR_NETH_RETX  0x20

/* ---- Receive Sequence Number header, 4 bytes (MR-XH-037): NATIVE_SEND,
 * NATIVE_SEND_IMM and NATIVE_WRITE_IMM carry it after the NETH ---------- */
struct mr_rsneth {
	__be32 rsn; /* reserved bits31-24 | RSN bits23-0: which receive WQE */
};

/* ---- SACK Extended Transport Header, 12 bytes + bitmap (MR-XH-026) ---- */
struct mr_sacketh {
	__be32 tsecr;
	__be16 credit;       /* 0xFFFF = no limit */
	__be16 ce_count;
	__be16 echo_sport;
	__u8   bitmap_words; /* 0..MR_SACK_MAX_WORDS u32 words follow */
	__u8   flags;        /* bit7 CE */
};
#define MR_SACK_FLAG_CE 0x80

#define MR_BTH_LEN           12
#define MR_RETH_LEN          16
#define MR_AETH_LEN          4
#define MR_ATOMICETH_LEN     28
#define MR_ATOMICACKETH_LEN  8
#define MR_IMMDT_LEN         4
#define MR_IETH_LEN          4
#define MR_NETH_LEN          16
#define MR_RSNETH_LEN        4
#define MR_SACKETH_LEN       12
#define MR_CNP_LEN           16

_Static_assert(sizeof(struct mr_bth) == MR_BTH_LEN, "BTH is 12 bytes");
_Static_assert(sizeof(struct mr_reth) == MR_RETH_LEN, "RETH is 16 bytes");
_Static_assert(sizeof(struct mr_aeth) == MR_AETH_LEN, "AETH is 4 bytes");
_Static_assert(sizeof(struct mr_atomiceth) == MR_ATOMICETH_LEN, "AtomicETH is 28 bytes");
_Static_assert(sizeof(struct mr_atomicacketh) == MR_ATOMICACKETH_LEN, "AtomicAckETH is 8 bytes");
_Static_assert(sizeof(struct mr_immdt) == MR_IMMDT_LEN, "ImmDt is 4 bytes");
_Static_assert(sizeof(struct mr_ieth) == MR_IETH_LEN, "IETH is 4 bytes");
_Static_assert(sizeof(struct mr_neth) == MR_NETH_LEN, "NETH is 16 bytes");
_Static_assert(sizeof(struct mr_rsneth) == MR_RSNETH_LEN, "RSNETH is 4 bytes");
_Static_assert(sizeof(struct mr_sacketh) == MR_SACKETH_LEN, "SACKETH is 12 bytes");
_Static_assert(sizeof(struct mr_cnp_pad) == MR_CNP_LEN, "CNP pad is 16 bytes");

/* ---- The opcode table (Table 2-1: MR-OPC-001, MR-OPC-009) --------------
 * Bit values are those of OpMask in metaroce_xdp/wire/opcodes.py: never
 * renumber.  Code tests masks, never lists of opcodes. */
#define MR_OPM_RETH          (1u << 0)
#define MR_OPM_AETH          (1u << 1)
#define MR_OPM_ATOMICETH     (1u << 2)
#define MR_OPM_ATOMICACKETH  (1u << 3)
#define MR_OPM_IMMDT         (1u << 4)
#define MR_OPM_IETH          (1u << 5)
#define MR_OPM_NETH          (1u << 6)
#define MR_OPM_SACKETH       (1u << 7)
#define MR_OPM_CNP           (1u << 8)
#define MR_OPM_PAYLOAD       (1u << 9)   /* may carry payload */
#define MR_OPM_REQ           (1u << 10)  /* requester -> responder */
#define MR_OPM_ACK           (1u << 11)  /* responder -> requester */
#define MR_OPM_SEND          (1u << 12)
#define MR_OPM_WRITE         (1u << 13)
#define MR_OPM_READ          (1u << 14)
#define MR_OPM_ATOMIC        (1u << 15)
#define MR_OPM_RWR           (1u << 16)  /* consumes a receive WQE */
#define MR_OPM_COMP          (1u << 17)  /* completes a message at the responder */
#define MR_OPM_START         (1u << 18)
#define MR_OPM_MIDDLE        (1u << 19)
#define MR_OPM_END           (1u << 20)
#define MR_OPM_NATIVE        (1u << 21)
#define MR_OPM_CONTROL       (1u << 22)  /* outside the PSN sequence (CNP) */
#define MR_OPM_RSNETH        (1u << 23)  /* native receive sequence number header */

/* Fixed header length (BTH + extension headers) derived from the mask, never
 * written by hand.  The SACK bitmap is variable and not included. */
#define MR_OP_HDR_LEN(m) (MR_BTH_LEN                                    \
	+ (((m) & MR_OPM_RETH) ? MR_RETH_LEN : 0)                       \
	+ (((m) & MR_OPM_ATOMICETH) ? MR_ATOMICETH_LEN : 0)             \
	+ (((m) & MR_OPM_AETH) ? MR_AETH_LEN : 0)                       \
	+ (((m) & MR_OPM_ATOMICACKETH) ? MR_ATOMICACKETH_LEN : 0)       \
	+ (((m) & MR_OPM_NETH) ? MR_NETH_LEN : 0)                       \
	+ (((m) & MR_OPM_RSNETH) ? MR_RSNETH_LEN : 0)                   \
	+ (((m) & MR_OPM_SACKETH) ? MR_SACKETH_LEN : 0)                 \
	+ (((m) & MR_OPM_IMMDT) ? MR_IMMDT_LEN : 0)                     \
	+ (((m) & MR_OPM_IETH) ? MR_IETH_LEN : 0)                       \
	+ (((m) & MR_OPM_CNP) ? MR_CNP_LEN : 0))

#define MR__S (MR_OPM_SEND | MR_OPM_REQ | MR_OPM_PAYLOAD)
#define MR__W (MR_OPM_WRITE | MR_OPM_REQ | MR_OPM_PAYLOAD)
#define MR__RR (MR_OPM_READ | MR_OPM_ACK | MR_OPM_PAYLOAD)
#define MR__AT MR_OPM_ATOMIC
#define MR__SE (MR_OPM_START | MR_OPM_END)

/* X(value, NAME, mask): the whole table, one row per opcode. */
#define MR_OPCODE_TABLE(X)                                                                      \
	X(0x00, SEND_FIRST,                     MR__S | MR_OPM_RWR | MR_OPM_START)              \
	X(0x01, SEND_MIDDLE,                    MR__S | MR_OPM_MIDDLE)                          \
	X(0x02, SEND_LAST,                      MR__S | MR_OPM_COMP | MR_OPM_END)               \
	X(0x03, SEND_LAST_WITH_IMMEDIATE,       MR__S | MR_OPM_IMMDT | MR_OPM_COMP | MR_OPM_END) \
	X(0x04, SEND_ONLY,                      MR__S | MR_OPM_RWR | MR_OPM_COMP | MR__SE)      \
	X(0x05, SEND_ONLY_WITH_IMMEDIATE,       MR__S | MR_OPM_IMMDT | MR_OPM_RWR | MR_OPM_COMP | MR__SE) \
	X(0x06, RDMA_WRITE_FIRST,               MR__W | MR_OPM_RETH | MR_OPM_START)             \
	X(0x07, RDMA_WRITE_MIDDLE,              MR__W | MR_OPM_MIDDLE)                          \
	X(0x08, RDMA_WRITE_LAST,                MR__W | MR_OPM_END)                             \
	X(0x09, RDMA_WRITE_LAST_WITH_IMMEDIATE, MR__W | MR_OPM_IMMDT | MR_OPM_RWR | MR_OPM_COMP | MR_OPM_END) \
	X(0x0A, RDMA_WRITE_ONLY,                MR__W | MR_OPM_RETH | MR__SE)                   \
	X(0x0B, RDMA_WRITE_ONLY_WITH_IMMEDIATE, MR__W | MR_OPM_RETH | MR_OPM_IMMDT | MR_OPM_RWR | MR_OPM_COMP | MR__SE) \
	X(0x0C, RDMA_READ_REQUEST,              MR_OPM_READ | MR_OPM_REQ | MR_OPM_RETH | MR__SE) \
	X(0x0D, RDMA_READ_RESPONSE_FIRST,       MR__RR | MR_OPM_AETH | MR_OPM_START)            \
	X(0x0E, RDMA_READ_RESPONSE_MIDDLE,      MR__RR | MR_OPM_MIDDLE)                         \
	X(0x0F, RDMA_READ_RESPONSE_LAST,        MR__RR | MR_OPM_AETH | MR_OPM_END)              \
	X(0x10, RDMA_READ_RESPONSE_ONLY,        MR__RR | MR_OPM_AETH | MR__SE)                  \
	X(0x11, ACKNOWLEDGE,                    MR_OPM_ACK | MR_OPM_AETH | MR__SE)              \
	X(0x12, ATOMIC_ACKNOWLEDGE,             MR__AT | MR_OPM_ACK | MR_OPM_AETH | MR_OPM_ATOMICACKETH | MR__SE) \
	X(0x13, COMPARE_SWAP,                   MR__AT | MR_OPM_REQ | MR_OPM_ATOMICETH | MR__SE) \
	X(0x14, FETCH_ADD,                      MR__AT | MR_OPM_REQ | MR_OPM_ATOMICETH | MR__SE) \
	X(0x16, SEND_LAST_WITH_INVALIDATE,      MR__S | MR_OPM_IETH | MR_OPM_COMP | MR_OPM_END) \
	X(0x17, SEND_ONLY_WITH_INVALIDATE,      MR__S | MR_OPM_IETH | MR_OPM_RWR | MR_OPM_COMP | MR__SE) \
	X(0x81, CNP,                            MR_OPM_CNP | MR_OPM_CONTROL)                    \
	X(0xC0, NATIVE_SEND,                    MR__S | MR_OPM_NETH | MR_OPM_RSNETH | MR_OPM_RWR | MR_OPM_COMP | MR_OPM_NATIVE) \
	X(0xC1, NATIVE_SEND_IMM,                MR__S | MR_OPM_NETH | MR_OPM_RSNETH | MR_OPM_IMMDT | MR_OPM_RWR | MR_OPM_COMP | MR_OPM_NATIVE) \
	X(0xC2, NATIVE_WRITE,                   MR__W | MR_OPM_RETH | MR_OPM_NETH | MR_OPM_NATIVE) \
	X(0xC3, NATIVE_WRITE_IMM,               MR__W | MR_OPM_RETH | MR_OPM_NETH | MR_OPM_RSNETH | MR_OPM_IMMDT | MR_OPM_RWR | MR_OPM_COMP | MR_OPM_NATIVE) \
	X(0xC4, NATIVE_READ_REQ,                MR_OPM_READ | MR_OPM_REQ | MR_OPM_RETH | MR_OPM_NETH | MR__SE | MR_OPM_NATIVE) \
	X(0xC5, NATIVE_READ_RESP,               MR__RR | MR_OPM_NETH | MR_OPM_NATIVE)           \
	X(0xC6, NATIVE_SACK,                    MR_OPM_ACK | MR_OPM_AETH | MR_OPM_SACKETH | MR__SE | MR_OPM_NATIVE)

#define MR__OP_ENUM(v, name, m) MR_OP_##name = (v),
enum mr_opcode {
	MR_OPCODE_TABLE(MR__OP_ENUM)
};
#undef MR__OP_ENUM

/* Look an opcode up.  Returns the fixed header length (BTH included) and
 * stores the mask, or returns -1 for an opcode not in the table.  A switch,
 * not a global array: BCC has no .rodata for us, and clang turns this into a
 * short compare tree (BPF has no jump tables on this toolchain). */
#define MR__OP_CASE(v, name, m) case (v): *mask = (m); return MR_OP_HDR_LEN(m);
static __always_inline int mr_opcode_info(__u32 opcode, __u32 *mask)
{
	switch (opcode) {
	MR_OPCODE_TABLE(MR__OP_CASE)
	default:
		*mask = 0;
		return -1;
	}
}
#undef MR__OP_CASE

#endif /* __METAROCE_HDR_H */
