//! BHS/AHS/PDU decode: a byte stream split into PDUs the way the server's reader does
//! (`Bhs::plan` bounds the data segment before anything is read), every header decoded with
//! `Header::decode` and re-encoded. Invariants: decoding never panics, the plan never exceeds
//! the limit, and encode∘decode is stable after one round.
#![no_main]

use ironsan_fuzz::{next_pdu, Wire};
use ironsan_proto::pdu::{Header, Pdu};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&cfg, mut input)) = data.split_first() else {
        return;
    };
    // The limits the server uses: 8192 during login, the negotiated value afterwards.
    let max_data = match cfg & 3 {
        0 => 8192,
        1 => 262_144,
        2 => 512,
        _ => (1 << 24) - 1,
    };
    let (hd, dd) = (cfg & 4 != 0, cfg & 8 != 0);
    let mut n = 0;
    while n < 64 {
        n += 1;
        if input.len() >= 48 {
            let mut bhs = ironsan_proto::Bhs::default();
            bhs.0.copy_from_slice(&input[..48]);
            if let Ok(plan) = bhs.plan(hd, dd, max_data) {
                assert!(plan.data_len <= max_data as usize);
                assert!(plan.total() <= 255 * 4 + 4 + max_data as usize + 3 + 4);
            }
            let _ = bhs.opcode().is_initiator();
            let _ = bhs.itt();
        }
        match next_pdu(&mut input, max_data) {
            Wire::Pdu(bhs, pdu) => {
                let h = &pdu.header;
                if let Header::Unknown(raw) = h {
                    assert_eq!(*raw, bhs);
                }
                if let Header::ScsiCommand(c) = h {
                    let _ = c.lun.number();
                }
                let once = Header::decode(&h.encode());
                let twice = Header::decode(&once.encode());
                assert_eq!(once, twice, "encode/decode not stable for {bhs:?}");
                // Lengths survive a re-encode of the whole PDU.
                let again = Pdu::new(once, pdu.data.clone()).bhs();
                assert_eq!(again.data_len() as usize, pdu.data.len());
            }
            Wire::TooLong | Wire::Short => break,
        }
    }
});
