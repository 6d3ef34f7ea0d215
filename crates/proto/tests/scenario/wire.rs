//! The bytes between the two ends: every PDU is encoded by `ironsan_proto::pdu` on one side
//! and decoded, through the two-stage decode (BHS, receive plan, payload), on the other. No
//! digests are negotiated; padding is sent and skipped.

use bytes::Bytes;
use ironsan_proto::pdu::{pad_len, Bhs, Header, Pdu, BHS_LEN};

/// One PDU on the wire: BHS, data segment, padding.
pub(crate) fn encode(header: &Header, data: &[u8]) -> Vec<u8> {
    let pdu = Pdu::new(header.clone(), Bytes::copy_from_slice(data));
    let bhs = pdu.bhs();
    let mut out = Vec::with_capacity(BHS_LEN + data.len() + 3);
    out.extend_from_slice(&bhs.0);
    out.extend_from_slice(data);
    out.resize(out.len() + pad_len(data.len()), 0);
    out
}

/// The BHS of an encoded PDU.
pub(crate) fn bhs(bytes: &[u8]) -> Bhs {
    let mut b = [0u8; BHS_LEN];
    b.copy_from_slice(&bytes[..BHS_LEN]);
    Bhs(b)
}

/// A PDU received: its BHS, its AHS and its data segment, bounded by `max_data` (the
/// receiver's MaxRecvDataSegmentLength) before anything is read.
pub(crate) fn decode(bytes: &[u8], max_data: u32) -> (Bhs, Bytes, Bytes) {
    let bhs = bhs(bytes);
    let plan = bhs
        .plan(false, false, max_data)
        .expect("the sender keeps within the receiver's MaxRecvDataSegmentLength");
    assert_eq!(bytes.len(), BHS_LEN + plan.total(), "one whole PDU");
    let ahs = Bytes::copy_from_slice(&bytes[BHS_LEN..BHS_LEN + plan.ahs_len]);
    let start = BHS_LEN + plan.ahs_len;
    let data = Bytes::copy_from_slice(&bytes[start..start + plan.data_len]);
    (bhs, ahs, data)
}

/// The decoded header of an encoded PDU.
pub(crate) fn header(bytes: &[u8]) -> Header {
    Header::decode(&bhs(bytes))
}

/// The bytes of a target PDU with ExpCmdSN and MaxCmdSN (BHS bytes 28..36) blanked: what a
/// resent PDU must match exactly (RFC 7143 §11.16).
pub(crate) fn without_window(bytes: &[u8]) -> Vec<u8> {
    let mut v = bytes.to_vec();
    v[28..36].fill(0);
    v
}
