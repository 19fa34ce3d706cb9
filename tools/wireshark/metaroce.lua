-- MetaRoCE native profile: a Wireshark / tshark dissector (Lua) for the native opcodes 0xC0-0xC6 and
-- their extension headers NETH, RSNETH and SACKETH (docs/spec/02-headers.md sections 3.7-3.9,
-- docs/spec/04-native.md section 4.2.2).
--
-- Compat MetaRoCE is byte-exact RoCEv2 and Wireshark's own InfiniBand dissector decodes it.  This
-- script takes UDP port 4791 over from it and hands every packet whose BTH opcode is below 0xC0 (RC,
-- CNP: compat packets, and the atomics of a native QP) back to the dissector that held the port before
-- (field names infiniband.*).  Packets with an opcode in the manufacturer-specific range 0xC0-0xFF are
-- decoded here (field names metaroce.*): the BTH, RETH, AETH, NETH, RSNETH, ImmDt, SACKETH and its
-- bitmap (with the PSN each set bit reports), payload, pad and ICRC (verified; MR-ICRC).
--
--   tshark -X lua_script:tools/wireshark/metaroce.lua -r capture.pcap
--   tshark -X lua_script:tools/wireshark/metaroce.lua -r capture.pcap -Y metaroce.sacketh \
--          -T fields -e metaroce.bth.psn -e metaroce.sacketh.bitmapwords -e metaroce.sacketh.sacked_psn
--
-- Or copy it to ~/.local/lib/wireshark/plugins/ (Wireshark >= 2.6; ~/.wireshark/plugins/ before) and
-- Wireshark and tshark load it at start.  Bit operations come from bit32, Wireshark's bit module or
-- Lua 5.3's operators; tested with tshark 4.0 (Lua 5.2) by tests/tools/test_wireshark_dissector.py.

local NATIVE_MIN = 0xC0           -- opcodes from here up are native (manufacturer-specific range)
local ROCE_PORT = 4791            -- IANA's RoCEv2 port (MR-ENC-019)

-- ---- bit operations, unsigned 32-bit whichever library this Lua has --------------------------------
local B = bit32 or bit
if B == nil then   -- Lua 5.3+ without either library: its own operators (compiled here: 5.2 cannot parse them)
    B = { band = load("return function(a, b) return a & b end")(),
          bxor = load("return function(a, b) return a ~ b end")(),
          rshift = load("return function(a, n) return a >> n end")() }
end
local function u32(x) return x % 4294967296 end
local function band(a, b) return u32(B.band(a, b)) end
local function bxor(a, b) return u32(B.bxor(a, b)) end
local function rshift(a, n) return u32(B.rshift(a, n)) end

-- ---- the opcode table (the native part of Table 2-1) ------------------------------------------------
-- headers after the BTH in wire order, and whether the opcode carries payload
local OPS = {
    [0xC0] = { name = "NATIVE_SEND",      hdrs = { "neth", "rsneth" },                   payload = true },
    [0xC1] = { name = "NATIVE_SEND_IMM",  hdrs = { "neth", "rsneth", "immdt" },          payload = true },
    [0xC2] = { name = "NATIVE_WRITE",     hdrs = { "reth", "neth" },                     payload = true },
    [0xC3] = { name = "NATIVE_WRITE_IMM", hdrs = { "reth", "neth", "rsneth", "immdt" },  payload = true },
    [0xC4] = { name = "NATIVE_READ_REQ",  hdrs = { "reth", "neth" },                     payload = false },
    [0xC5] = { name = "NATIVE_READ_RESP", hdrs = { "neth" },                             payload = true },
    [0xC6] = { name = "NATIVE_SACK",      hdrs = { "aeth", "sacketh" },                  payload = false },
}
local HDR_LEN = { reth = 16, aeth = 4, neth = 16, rsneth = 4, immdt = 4, sacketh = 12 }
local BTH_LEN, ICRC_LEN, SACK_MAX_WORDS = 12, 4, 32

local opcode_names = {}
for v, o in pairs(OPS) do opcode_names[v] = o.name end

local syndrome_types = { [0] = "ACK", [1] = "RNR NAK", [2] = "Reserved", [3] = "NAK" }
local nak_codes = { [0] = "PSN sequence error", [1] = "Invalid request", [2] = "Remote access error",
                    [3] = "Remote operational error", [4] = "Invalid RD request" }
local icrc_states = { [0] = "Unverified", [1] = "Good", [2] = "Bad" }

-- ---- protocol and fields ----------------------------------------------------------------------------
local p = Proto("metaroce", "MetaRoCE native profile")

local F = {
    -- BTH (02 section 2)
    bth          = ProtoField.bytes("metaroce.bth", "Base Transport Header", base.NONE),
    opcode       = ProtoField.uint8("metaroce.bth.opcode", "Opcode", base.HEX, opcode_names),
    se           = ProtoField.bool("metaroce.bth.se", "Solicited Event", 8, nil, 0x80),
    m            = ProtoField.bool("metaroce.bth.m", "MigReq", 8, nil, 0x40),
    padcnt       = ProtoField.uint8("metaroce.bth.padcnt", "Pad Count", base.DEC, nil, 0x30),
    tver         = ProtoField.uint8("metaroce.bth.tver", "Header Version", base.DEC, nil, 0x0F),
    pkey         = ProtoField.uint16("metaroce.bth.pkey", "Partition Key", base.HEX),
    fecn         = ProtoField.bool("metaroce.bth.fecn", "FECN", 8, nil, 0x80),
    becn         = ProtoField.bool("metaroce.bth.becn", "BECN", 8, nil, 0x40),
    resv6        = ProtoField.uint8("metaroce.bth.resv6", "Reserved (6 bits)", base.HEX, nil, 0x3F),
    destqp       = ProtoField.uint24("metaroce.bth.destqp", "Destination QP", base.HEX),
    ackreq       = ProtoField.bool("metaroce.bth.ackreq", "Acknowledge Request", 8, nil, 0x80),
    resv7        = ProtoField.uint8("metaroce.bth.resv7", "Reserved (7 bits)", base.HEX, nil, 0x7F),
    psn          = ProtoField.uint24("metaroce.bth.psn", "Packet Sequence Number", base.DEC),
    -- RETH (02 section 3.1)
    reth         = ProtoField.bytes("metaroce.reth", "RDMA Extended Transport Header", base.NONE),
    reth_va      = ProtoField.uint64("metaroce.reth.va", "Virtual Address", base.HEX),
    reth_rkey    = ProtoField.uint32("metaroce.reth.rkey", "Remote Key", base.HEX),
    reth_dmalen  = ProtoField.uint32("metaroce.reth.dmalen", "DMA Length", base.DEC),
    -- AETH (02 section 3.2)
    aeth         = ProtoField.bytes("metaroce.aeth", "ACK Extended Transport Header", base.NONE),
    aeth_syn     = ProtoField.uint8("metaroce.aeth.syndrome", "Syndrome", base.HEX),
    aeth_syn_t   = ProtoField.uint8("metaroce.aeth.syndrome.type", "Type", base.DEC, syndrome_types, 0x60),
    aeth_syn_v   = ProtoField.uint8("metaroce.aeth.syndrome.value", "Value", base.DEC, nil, 0x1F),
    aeth_msn     = ProtoField.uint24("metaroce.aeth.msn", "Message Sequence Number", base.DEC),
    -- NETH (02 section 3.7)
    neth         = ProtoField.bytes("metaroce.neth", "Native Extended Transport Header", base.NONE),
    neth_flags   = ProtoField.uint8("metaroce.neth.flags", "Flags", base.HEX),
    neth_first   = ProtoField.bool("metaroce.neth.first", "FIRST", 8, nil, 0x80),
    neth_last    = ProtoField.bool("metaroce.neth.last", "LAST", 8, nil, 0x40),
    neth_retx    = ProtoField.bool("metaroce.neth.retx", "RETX (retransmission)", 8, nil, 0x20),
    neth_rsvd    = ProtoField.uint8("metaroce.neth.rsvd", "Reserved", base.HEX, nil, 0x1F),
    neth_msn     = ProtoField.uint24("metaroce.neth.msn", "Message Sequence Number", base.DEC),
    neth_offset  = ProtoField.uint32("metaroce.neth.offset", "Offset", base.DEC),
    neth_msglen  = ProtoField.uint32("metaroce.neth.msglen", "Message Length", base.DEC),
    neth_tsval   = ProtoField.uint32("metaroce.neth.tsval", "TSval (us)", base.DEC),
    -- RSNETH (02 section 3.9)
    rsneth       = ProtoField.bytes("metaroce.rsneth", "Receive Sequence Number Extended Transport Header",
                                    base.NONE),
    rsneth_rsvd  = ProtoField.uint8("metaroce.rsneth.rsvd", "Reserved", base.HEX),
    rsneth_rsn   = ProtoField.uint24("metaroce.rsneth.rsn", "Receive Sequence Number", base.DEC),
    -- ImmDt (02 section 3.5)
    immdt        = ProtoField.uint32("metaroce.immdt", "Immediate Data", base.HEX),
    -- SACKETH (02 section 3.8)
    sack         = ProtoField.bytes("metaroce.sacketh", "Selective ACK Extended Transport Header", base.NONE),
    sack_tsecr   = ProtoField.uint32("metaroce.sacketh.tsecr", "TSecr", base.DEC),
    sack_credit  = ProtoField.uint16("metaroce.sacketh.credit", "Credit", base.DEC, { [0xFFFF] = "no limit" }),
    sack_ce      = ProtoField.uint16("metaroce.sacketh.cecount", "CE Count", base.DEC),
    sack_sport   = ProtoField.uint16("metaroce.sacketh.echosport", "Echo Sport", base.DEC),
    sack_words   = ProtoField.uint8("metaroce.sacketh.bitmapwords", "Bitmap Words", base.DEC),
    sack_flags   = ProtoField.uint8("metaroce.sacketh.flags", "Flags", base.HEX),
    sack_f_ce    = ProtoField.bool("metaroce.sacketh.flags.ce", "C (trigger CE-marked)", 8, nil, 0x80),
    sack_f_nots  = ProtoField.bool("metaroce.sacketh.flags.nots", "N (trigger had no TSval)", 8, nil, 0x40),
    sack_f_rsvd  = ProtoField.uint8("metaroce.sacketh.flags.rsvd", "Reserved", base.HEX, nil, 0x3F),
    sack_bitmap  = ProtoField.bytes("metaroce.sacketh.bitmap", "Bitmap", base.NONE),
    sack_word    = ProtoField.uint32("metaroce.sacketh.bitmap.word", "Bitmap word", base.HEX),
    sack_cum     = ProtoField.uint24("metaroce.sacketh.cumpsn", "Cumulative PSN", base.DEC),
    sack_missing = ProtoField.uint24("metaroce.sacketh.missing_psn", "First missing PSN", base.DEC),
    sack_psn     = ProtoField.uint24("metaroce.sacketh.sacked_psn", "PSN reported received", base.DEC),
    sack_count   = ProtoField.uint16("metaroce.sacketh.sacked_count", "PSNs reported received", base.DEC),
    -- the rest
    payload      = ProtoField.bytes("metaroce.payload", "Payload", base.NONE),
    pad          = ProtoField.bytes("metaroce.pad", "Pad", base.NONE),
    icrc         = ProtoField.uint32("metaroce.icrc", "ICRC", base.HEX),
    icrc_status  = ProtoField.uint8("metaroce.icrc.status", "ICRC status", base.DEC, icrc_states),
}
local fl = {}
for _, f in pairs(F) do fl[#fl + 1] = f end
p.fields = fl

local E = {
    short    = ProtoExpert.new("metaroce.short", "Packet shorter than its opcode's headers",
                               expert.group.MALFORMED, expert.severity.ERROR),
    words    = ProtoExpert.new("metaroce.sacketh.words_bad", "Bitmap Words above 32 (MR-XH-027)",
                               expert.group.MALFORMED, expert.severity.ERROR),
    reserved = ProtoExpert.new("metaroce.reserved_set", "Reserved bits set",
                               expert.group.PROTOCOL, expert.severity.WARN),
    opcode   = ProtoExpert.new("metaroce.opcode_reserved", "Reserved native opcode (0xC7-0xFF)",
                               expert.group.PROTOCOL, expert.severity.WARN),
    icrc     = ProtoExpert.new("metaroce.icrc.bad", "Bad ICRC", expert.group.CHECKSUM, expert.severity.ERROR),
    retx     = ProtoExpert.new("metaroce.retx", "Retransmission", expert.group.SEQUENCE, expert.severity.NOTE),
    fl       = ProtoExpert.new("metaroce.neth.fl_bad",
                               "FIRST/LAST contradict Offset, payload and Message Length (MR-XH-018)",
                               expert.group.MALFORMED, expert.severity.WARN),
}
p.experts = { E.short, E.words, E.reserved, E.opcode, E.icrc, E.retx, E.fl }

p.prefs.check_icrc = Pref.bool("Verify ICRC", true, "Compute the ICRC of native packets and compare")

-- ---- ICRC (MR-ICRC: CRC-32 over 8 x 0xFF, masked IP, UDP and BTH headers, then the rest) --------------
local crc_table = {}
for i = 0, 255 do
    local c = i
    for _ = 1, 8 do
        if c % 2 == 1 then c = bxor(rshift(c, 1), 0xEDB88320) else c = rshift(c, 1) end
    end
    crc_table[i] = c
end

local function crc_update(crc, s)
    for i = 1, #s do
        crc = bxor(crc_table[band(bxor(crc, s:byte(i)), 0xFF)], rshift(crc, 8))
    end
    return crc
end

local function set_byte(s, i, v)     -- 1-based index i of string s set to v
    return s:sub(1, i - 1) .. string.char(v) .. s:sub(i + 1)
end

local f_ip = Field.new("ip")
local f_ipv6 = Field.new("ipv6")
local f_udp = Field.new("udp")

local function last(...)
    local t = { ... }
    return t[#t]
end

-- The IP header of this packet from the frame (the last IP layer before this UDP), or nil.
local function ip_header()
    local v4, v6 = last(f_ip()), last(f_ipv6())
    if v4 ~= nil and v6 ~= nil then          -- tunnelled: the later one is ours
        if v4.offset > v6.offset then v6 = nil else v4 = nil end
    end
    if v4 ~= nil then
        local s = v4.range:raw()
        if #s ~= 20 then return nil end      -- MetaRoCE sends no IPv4 options (MR-ENC-008)
        s = set_byte(s, 2, 0xFF)             -- TOS
        s = set_byte(s, 9, 0xFF)             -- TTL
        s = set_byte(s, 11, 0xFF)            -- header checksum
        return set_byte(s, 12, 0xFF)
    end
    if v6 ~= nil then
        local s = v6.range:raw(0, 40)
        if #s ~= 40 then return nil end
        s = set_byte(s, 1, band(s:byte(1), 0xF0) + 0x0F)   -- traffic class and flow label
        s = set_byte(s, 2, 0xFF)
        s = set_byte(s, 3, 0xFF)
        s = set_byte(s, 4, 0xFF)
        return set_byte(s, 8, 0xFF)          -- hop limit
    end
    return nil
end

-- (computed ICRC or nil when the headers cannot be found), over tvb's bytes before the ICRC
local function icrc_of(tvb, len)
    local iph = ip_header()
    local udp = last(f_udp())
    if iph == nil or udp == nil then return nil end
    local uh = udp.range:raw(0, 8)
    uh = set_byte(set_byte(uh, 7, 0xFF), 8, 0xFF)       -- UDP checksum
    local bth = tvb:raw(0, BTH_LEN)
    bth = set_byte(bth, 5, 0xFF)                         -- FECN, BECN, Resv6
    local crc = 0xFFFFFFFF
    crc = crc_update(crc, string.rep("\255", 8))
    crc = crc_update(crc, iph)
    crc = crc_update(crc, uh)
    crc = crc_update(crc, bth)
    if len > BTH_LEN then crc = crc_update(crc, tvb:raw(BTH_LEN, len - BTH_LEN)) end
    return bxor(crc, 0xFFFFFFFF)
end

-- ---- header decoders: each (tvb, off, tree, info) -> bytes used -----------------------------------------
local BIT = {}
for i = 0, 31 do BIT[i] = math.floor(2 ^ i) end

local function psn_add(a, n) return (a + n) % 0x1000000 end

local dec = {}

function dec.reth(tvb, off, tree)
    local t = tree:add(F.reth, tvb(off, 16)):set_text("RETH")
    t:add(F.reth_va, tvb(off, 8))
    t:add(F.reth_rkey, tvb(off + 8, 4))
    t:add(F.reth_dmalen, tvb(off + 12, 4))
    return 16
end

function dec.aeth(tvb, off, tree, info)
    local syn = tvb(off, 1):uint()
    local kind = rshift(band(syn, 0x60), 5)
    local val = band(syn, 0x1F)
    local desc
    if kind == 0 then
        desc = "ACK" .. (val == 0x1F and "" or string.format(" (credit code %d)", val))
    elseif kind == 1 then
        desc = string.format("RNR NAK (timer %d)", val)
    elseif kind == 3 then
        desc = "NAK: " .. (nak_codes[val] or string.format("reserved %d", val))
    else
        desc = "reserved syndrome"
    end
    local t = tree:add(F.aeth, tvb(off, 4)):set_text("AETH: " .. desc)
    local st = t:add(F.aeth_syn, tvb(off, 1))
    st:add(F.aeth_syn_t, tvb(off, 1))
    st:add(F.aeth_syn_v, tvb(off, 1))
    t:add(F.aeth_msn, tvb(off + 1, 3))
    info.syndrome = desc
    info.kind = kind
    return 4
end

function dec.neth(tvb, off, tree, info)
    local flags = tvb(off, 1):uint()
    local names = {}
    if band(flags, 0x80) ~= 0 then names[#names + 1] = "F" end
    if band(flags, 0x40) ~= 0 then names[#names + 1] = "L" end
    if band(flags, 0x20) ~= 0 then names[#names + 1] = "R" end
    local msn, offset, mlen = tvb(off + 1, 3):uint(), tvb(off + 4, 4):uint(), tvb(off + 8, 4):uint()
    local t = tree:add(F.neth, tvb(off, 16)):set_text(string.format(
        "NETH: MSN %d, offset %d of %d%s", msn, offset, mlen,
        #names > 0 and (" [" .. table.concat(names, " ") .. "]") or ""))
    local ft = t:add(F.neth_flags, tvb(off, 1))
    ft:add(F.neth_first, tvb(off, 1))
    ft:add(F.neth_last, tvb(off, 1))
    local rt = ft:add(F.neth_retx, tvb(off, 1))
    local rs = ft:add(F.neth_rsvd, tvb(off, 1))
    if band(flags, 0x1F) ~= 0 then rs:add_proto_expert_info(E.reserved) end
    if band(flags, 0x20) ~= 0 then rt:add_proto_expert_info(E.retx) end
    t:add(F.neth_msn, tvb(off + 1, 3))
    t:add(F.neth_offset, tvb(off + 4, 4))
    t:add(F.neth_msglen, tvb(off + 8, 4))
    t:add(F.neth_tsval, tvb(off + 12, 4))
    info.neth_item, info.neth_flags, info.neth_offset, info.neth_msglen = ft, flags, offset, mlen
    info.neth = string.format("MSN=%d off=%d/%d%s", msn, offset, mlen,
                              #names > 0 and (" " .. table.concat(names, "")) or "")
    return 16
end

function dec.rsneth(tvb, off, tree, info)
    local rsn = tvb(off + 1, 3):uint()
    local t = tree:add(F.rsneth, tvb(off, 4)):set_text(string.format("RSNETH: RSN %d", rsn))
    local r = t:add(F.rsneth_rsvd, tvb(off, 1))
    if tvb(off, 1):uint() ~= 0 then r:add_proto_expert_info(E.reserved) end
    t:add(F.rsneth_rsn, tvb(off + 1, 3))
    info.rsn = rsn
    return 4
end

function dec.immdt(tvb, off, tree)
    tree:add(F.immdt, tvb(off, 4))
    return 4
end

function dec.sacketh(tvb, off, tree, info)
    local words = tvb(off + 10, 1):uint()
    local flags = tvb(off + 11, 1):uint()
    local t = tree:add(F.sack, tvb(off, 12)):set_text("SACKETH")
    t:add(F.sack_tsecr, tvb(off, 4))
    t:add(F.sack_credit, tvb(off + 4, 2))
    t:add(F.sack_ce, tvb(off + 6, 2))
    t:add(F.sack_sport, tvb(off + 8, 2))
    local wt = t:add(F.sack_words, tvb(off + 10, 1))
    local ft = t:add(F.sack_flags, tvb(off + 11, 1))
    ft:add(F.sack_f_ce, tvb(off + 11, 1))
    ft:add(F.sack_f_nots, tvb(off + 11, 1))
    local rs = ft:add(F.sack_f_rsvd, tvb(off + 11, 1))
    if band(flags, 0x3F) ~= 0 then rs:add_proto_expert_info(E.reserved) end
    local psn = info.psn
    if info.kind == 0 then     -- an ACK-type SACK: BTH.PSN is the cumulative PSN (MR-XH-028)
        t:add(F.sack_cum, psn):set_generated()
        t:add(F.sack_missing, psn_add(psn, 1)):set_generated()
    end
    info.words = words
    if words > SACK_MAX_WORDS then
        wt:add_proto_expert_info(E.words)
        return 12
    end
    local n = 12
    local got = 0
    if words > 0 then
        local avail = tvb:len() - (off + 12) - ICRC_LEN
        if avail < 4 * words then
            t:add_proto_expert_info(E.short)
            return 12
        end
        local bt = t:add(F.sack_bitmap, tvb(off + 12, 4 * words))
        bt:set_text(string.format("Bitmap: %d word%s", words, words == 1 and "" or "s"))
        for w = 0, words - 1 do
            local wr = tvb(off + 12 + 4 * w, 4)
            local word = wr:uint()
            local it = bt:add(F.sack_word, wr)
            -- bit i, from bit 31 of word 0 on, reports PSN BTH.PSN + 2 + i (MR-XH-029)
            local first_of_word = psn_add(psn, 2 + 32 * w)
            it:append_text(string.format(" (PSNs %d..%d)", first_of_word, psn_add(first_of_word, 31)))
            for b = 0, 31 do
                if band(word, BIT[31 - b]) ~= 0 then
                    it:add(F.sack_psn, psn_add(psn, 2 + 32 * w + b)):set_generated()
                    got = got + 1
                end
            end
        end
        n = n + 4 * words
    end
    t:add(F.sack_count, got):set_generated()
    t:set_len(n)
    info.sacked = got
    return n
end

-- ---- the native packet ---------------------------------------------------------------------------------
local function dissect_native(tvb, pinfo, tree)
    local len = tvb:len()
    local opcode = tvb(0, 1):uint()
    local op = OPS[opcode]
    pinfo.cols.protocol = "MetaRoCE"
    local root = tree:add(p, tvb())
    local info = { psn = tvb(9, 3):uint() }

    local bt = root:add(F.bth, tvb(0, BTH_LEN))
    bt:set_text(string.format("Base Transport Header: %s, QP 0x%06x, PSN %d",
                              op and op.name or string.format("opcode 0x%02x", opcode),
                              tvb(5, 3):uint(), info.psn))
    local oi = bt:add(F.opcode, tvb(0, 1))
    bt:add(F.se, tvb(1, 1))
    bt:add(F.m, tvb(1, 1))
    bt:add(F.padcnt, tvb(1, 1))
    bt:add(F.tver, tvb(1, 1))
    bt:add(F.pkey, tvb(2, 2))
    bt:add(F.fecn, tvb(4, 1))
    bt:add(F.becn, tvb(4, 1))
    bt:add(F.resv6, tvb(4, 1))
    bt:add(F.destqp, tvb(5, 3))
    bt:add(F.ackreq, tvb(8, 1))
    bt:add(F.resv7, tvb(8, 1))
    bt:add(F.psn, tvb(9, 3))

    local head = string.format("%s QP=0x%06x PSN=%d", op and op.name or string.format("0x%02x", opcode),
                               tvb(5, 3):uint(), info.psn)
    pinfo.cols.info = head
    if op == nil then
        oi:add_proto_expert_info(E.opcode)
        if len > BTH_LEN then root:add(F.payload, tvb(BTH_LEN)) end
        return len
    end

    -- the fixed headers
    local need = BTH_LEN + ICRC_LEN
    for _, h in ipairs(op.hdrs) do need = need + HDR_LEN[h] end
    if len < need then
        root:add_proto_expert_info(E.short)
        return len
    end
    local off = BTH_LEN
    for _, h in ipairs(op.hdrs) do
        off = off + dec[h](tvb, off, root, info)
    end

    -- payload, pad, ICRC
    local pad = rshift(band(tvb(1, 1):uint(), 0x30), 4)
    local rest = len - ICRC_LEN - off
    if rest < 0 or (op.payload and rest < pad) then
        root:add_proto_expert_info(E.short)
        return len
    end
    local plen = 0
    if op.payload then
        plen = rest - pad
        if plen > 0 then
            root:add(F.payload, tvb(off, plen)):set_text(string.format("Payload: %d bytes", plen))
        end
        if pad > 0 then root:add(F.pad, tvb(off + plen, pad)) end
    elseif rest > 0 then
        root:add(F.payload, tvb(off, rest)):set_text(string.format("Unexpected bytes: %d", rest))
    end
    -- MR-XH-018: F exactly at Offset 0, L exactly where the payload reaches Message Length (not checked
    -- for NATIVE_READ_REQ, whose flags are always both set)
    if info.neth_item ~= nil and opcode ~= 0xC4 then
        local f = band(info.neth_flags, 0x80) ~= 0
        local l = band(info.neth_flags, 0x40) ~= 0
        if f ~= (info.neth_offset == 0) or l ~= (info.neth_offset + plen == info.neth_msglen) then
            info.neth_item:add_proto_expert_info(E.fl)
        end
    end
    local it = root:add_le(F.icrc, tvb(len - ICRC_LEN, ICRC_LEN))     -- least significant byte first
    local carried = tvb(len - ICRC_LEN, ICRC_LEN):le_uint()
    local status = 0
    if p.prefs.check_icrc then
        local c = icrc_of(tvb, len - ICRC_LEN)
        if c ~= nil then
            status = (c == carried) and 1 or 2
            it:append_text(status == 1 and " [correct]" or string.format(" [incorrect, should be 0x%08x]", c))
            if status == 2 then it:add_proto_expert_info(E.icrc) end
        end
    end
    root:add(F.icrc_status, status):set_generated()

    -- the summary line
    local parts = { head }
    if info.syndrome then parts[#parts + 1] = info.syndrome end
    if info.neth then parts[#parts + 1] = info.neth end
    if info.rsn then parts[#parts + 1] = "RSN=" .. info.rsn end
    if info.words then
        parts[#parts + 1] = string.format("words=%d", info.words)
        if info.sacked then parts[#parts + 1] = string.format("sacked=%d", info.sacked) end
    end
    if op.payload then parts[#parts + 1] = string.format("len=%d", plen) end
    pinfo.cols.info = table.concat(parts, " ")
    root:append_text(", " .. op.name)
    return len
end

-- ---- registration: compat to the dissector that held the port, native here ----------------------------------
local udp_table = DissectorTable.get("udp.port")
local compat = udp_table:get_dissector(ROCE_PORT) or Dissector.get("data")

function p.dissector(tvb, pinfo, tree)
    if tvb:len() < BTH_LEN or tvb(0, 1):uint() < NATIVE_MIN then
        -- An exception in the compat dissector (Wireshark's InfiniBand dissector throws on some short
        -- payloads, with or without this script) is already shown as [Malformed Packet] when call()
        -- returns it as a Lua error: caught here so that it is not shown twice, as a Lua error too.
        local ok, used = pcall(compat.call, compat, tvb, pinfo, tree)
        if ok then return used end
        return tvb:len()
    end
    return dissect_native(tvb, pinfo, tree)
end

udp_table:add(ROCE_PORT, p)
