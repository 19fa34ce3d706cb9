"""The native header rules of 02-headers.md belong to the native claim, not to a compat claim
(02-headers.md introduction, docs/spec/README.md 6.4 item 11)."""
from metaroce_xdp.conformance.spec import Catalogue, Claim


def test_native_header_rules_apply_only_to_a_native_claim():
    cat = Catalogue()
    compat = Claim(["compat"], {"ATOMICS"})
    native = Claim(["compat", "native"], {"ATOMICS"})
    for rid in ("MR-XH-003", "MR-XH-017", "MR-XH-026", "MR-XH-029", "MR-XH-037", "MR-XH-039", "MR-ECN-010"):
        assert cat[rid].native_only, rid
        assert not cat.applicable(rid, compat)[0], rid
        assert cat.applicable(rid, native)[0], rid
    for rid in ("MR-XH-001", "MR-XH-010", "MR-XH-015", "MR-XH-016", "MR-BTH-002", "MR-ECN-011", "MR-OPC-004"):
        assert not cat[rid].native_only, rid
        assert cat.applicable(rid, compat)[0], rid
